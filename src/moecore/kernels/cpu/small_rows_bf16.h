// A linear layer's products over a handful of rows on bf16 weights, for the grouped experts' small tiles (many
// experts, few tokens each). A tiled GEMM library (oneDNN's matmul) repacks the weight operand into its own layout
// on every call and pads the rows to its quantum, so a tile of 8 rows pays the weight's read and write twice over;
// these read the bf16 weight [O, I] in place, with AVX-512 (vdpbf16ps of AVX512-BF16 forward) where the CPU has it.
// Each block of weight rows is prefetched into L1 during the block before.
//   small_rows_forward_bf16   out_nO = x_nI W_OI^T: for 8 output columns at a time, two rows against 8 weight rows
//                             (vdpbf16ps on bf16 pairs; each weight load serves both rows), the 16 sums reduced in
//                             registers; products of bf16 values are exact in fp32, the sums are fp32 (in their own
//                             order, the same for every row whatever the rows beside it).
//   small_rows_data_bf16      dx_nI += dy_nO W_OI: each weight row widened to fp32 (exact) and multiplied by dy[r, o]
//                             and added (fused) into rows of dx held in registers, o = 0 .. O-1 in order; where dy
//                             holds bf16 values every product is exact, so the result is the reference's bit for bit.
#pragma once

#include <cstdint>

namespace moecore::kernels {

namespace cpu {
// Tiles of at most this many rows take these kernels in the grouped experts' native bf16 path where
// small_rows_bf16_usable() (grouped_mlp.cpp): measured against oneDNN's matmul with `bench_moe experts E 2048 192 256
// 15 0 bf16` on AMD Zen 5 (bench/RESULTS.md); the data kernel holds 8 rows in registers, and two passes over the
// weight lose to the GEMM.
constexpr int64_t kSmallRowsForwardMax = 16, kSmallRowsDataMax = 8;
// Whether this CPU runs them (AVX512-BF16).
bool small_rows_bf16_usable();
// Single-threaded, callable inside OpenMP regions; std::logic_error where not usable.
void small_rows_forward_bf16(float* out_nO, const uint16_t* x_nI, const uint16_t* w_OI, int64_t n, int64_t I,
                             int64_t O);
void small_rows_data_bf16(float* dx_nI, const float* dy_nO, const uint16_t* w_OI, int64_t n, int64_t I, int64_t O);
}  // namespace cpu

namespace ref {
// out = x W^T, each sum in double, rounded once.
void small_rows_forward_bf16(float* out_nO, const uint16_t* x_nI, const uint16_t* w_OI, int64_t n, int64_t I,
                             int64_t O);
// dx += dy W, o in order, one fp32 multiply and add each.
void small_rows_data_bf16(float* dx_nI, const float* dy_nO, const uint16_t* w_OI, int64_t n, int64_t I, int64_t O);
}  // namespace ref

}  // namespace moecore::kernels
