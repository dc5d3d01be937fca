// c += a^T b for few rows of a and b: the weight gradient dW_OI += dY_nO^T X_nI of a linear layer over a handful of
// tokens (an expert's rows at many experts). With n rows the GEMM's work is n O I multiply-adds on O I outputs, so for
// small n the time is reading and writing c once; a tiled GEMM instead packs its operands and, on the 16-bit path,
// pads n to its quantum. rank_update keeps a stretch of one output row in registers while it adds the n products.
#pragma once

#include <cstdint>

namespace moecore::kernels {

namespace cpu {
// Row counts up to this take rank_update in the grouped experts' native 16-bit weight gradients (grouped_mlp.cpp);
// above it oneDNN's bf16 matmul was faster (`bench_moe experts E 2048 192 256 20 0 bf16` on AMD Zen 5, weight
// gradients added / written: 32 rows 3.2 / 2.4 ms -> 1.95 / 1.21, 14 rows 3.7 / 2.45 -> 3.3 / 2.4; at 12 rows the
// rank update 3.6 / 2.8 against 4.2 / 3.6; bench/RESULTS.md).
constexpr int64_t kRankUpdateMaxRows = 12;
// c_OI[o, i] += sum_r a_nO[r, o] b_nI[r, i], the products added to c in row order r = 0 .. n-1, each element alone
// (the same sums whatever the vector ISA: the kernels build without FMA contraction). Row-major, contiguous.
void rank_update(float* c_OI, const float* a_nO, const float* b_nI, int64_t n, int64_t O, int64_t I);
// rank_update in the compiler's vector loops: what CPUs without AVX-512 run. With AVX-512 rank_update runs the same
// sums in explicit vector code, whole vectors loaded and stored unmasked (the weight gradients of 256 experts over 8
// rows each: 5.0-5.3 -> 4.0-4.8 ms on AMD Zen 5, `bench_moe experts 256 2048 192 256 20 0 bf16`).
void rank_update_portable(float* c_OI, const float* a_nO, const float* b_nI, int64_t n, int64_t O, int64_t I);
// c_OI = a_nO^T b_nI (c not read: a gradient known to be zero), the same sums as rank_update on a zeroed c; with
// AVX-512 the rows go out in streaming stores, so c is written without being read into the cache first.
void rank_update_overwrite(float* c_OI, const float* a_nO, const float* b_nI, int64_t n, int64_t O, int64_t I);
}  // namespace cpu

namespace ref {
void rank_update(float* c_OI, const float* a_nO, const float* b_nI, int64_t n, int64_t O, int64_t I);
}

}  // namespace moecore::kernels
