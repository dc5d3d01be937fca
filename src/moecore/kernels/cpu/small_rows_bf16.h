// A linear layer's products over a handful of rows on bf16 weights, for the grouped experts' small tiles (many
// experts, few tokens each). A tiled GEMM library (oneDNN's matmul) repacks the weight operand into its own layout
// on every call and pads the rows to its quantum, so a tile of 8 rows pays the weight's read and write twice over;
// these read the bf16 weight [O, I] in place, with AVX512-BF16 (vdpbf16ps) where the CPU has it.
// Each block of weight rows is prefetched into L1 during the block before.
//   small_rows_forward_bf16   out_nO = x_nI W_OI^T: for 8 output columns at a time, two rows against 8 weight rows
//                             (vdpbf16ps on bf16 pairs; each weight load serves both rows), the 16 sums reduced in
//                             registers; products of bf16 values are exact in fp32, the sums are fp32 (in their own
//                             order, the same for every row whatever the rows beside it).
//   small_rows_data_bf16      dx_nI += dy_nO W_OI: dy rounded to bf16 (exact where it holds bf16 values, as the
//                             native path's activations), weight rows two at a time interleaved into bf16 pairs and
//                             multiplied by dy's pairs with vdpbf16ps into rows of dx held in registers: for o = 0, 2,
//                             4, .. the o + 1 product is added, then the o product, each rounded to fp32 once (its
//                             products are exact), bf16 denormals read as zero and denormal sums flushed, as the
//                             instruction defines. Where vdpbf16ps does not outpace the fp32 FMAs (bf16_dot_rate.h:
//                             Intel), small_rows_data_widened instead: each weight row widened to fp32 (exact) and
//                             multiplied by dy[r, o] and added (fused) into rows of dx in registers, o = 0 .. O-1 in
//                             order; where dy holds bf16 values every product is exact.
#pragma once

#include <cstdint>

namespace moecore::kernels {

namespace cpu {
// Tiles of at most this many rows take these kernels in the grouped experts' native bf16 path where
// small_rows_bf16_usable() (grouped_mlp.cpp): measured against oneDNN's matmul with `bench_moe experts E 2048 192 256
// 15 0 bf16` on AMD Zen 5 (bench/RESULTS.md), where both kernels beat it up to 32 rows (level at 32). The data kernel
// holds 8 rows in registers and re-reads the expert's weight (from L2) for each further 8, the forward 2 rows. Where
// the matmul runs on AMX tiles they keep to the bounds measured before the data kernel ran on vdpbf16ps (16 and 8
// rows; not measured on AMX).
constexpr int64_t kSmallRowsForwardMax = 32, kSmallRowsDataMax = 32;
constexpr int64_t kSmallRowsForwardMaxAmx = 16, kSmallRowsDataMaxAmx = 8;
// Whether this CPU runs them (AVX512-BF16).
bool small_rows_bf16_usable();
// Single-threaded, callable inside OpenMP regions; std::logic_error where not usable.
void small_rows_forward_bf16(float* out_nO, const uint16_t* x_nI, const uint16_t* w_OI, int64_t n, int64_t I,
                             int64_t O);
void small_rows_data_bf16(float* dx_nI, const float* dy_nO, const uint16_t* w_OI, int64_t n, int64_t I, int64_t O);
void small_rows_data_widened(float* dx_nI, const float* dy_nO, const uint16_t* w_OI, int64_t n, int64_t I, int64_t O);
// Which data kernel the grouped experts take: small_rows_data_bf16 where vdpbf16ps outpaces the fp32 FMAs, else
// small_rows_data_widened.
bool small_rows_data_pairs();
}  // namespace cpu

namespace ref {
// out = x W^T, each sum in double, rounded once.
void small_rows_forward_bf16(float* out_nO, const uint16_t* x_nI, const uint16_t* w_OI, int64_t n, int64_t I,
                             int64_t O);
// dx += dy W in vdpbf16ps's order and rounding: dy rounded to bf16, o = 0, 2, .. with the o + 1 product first, each
// product added with one fp32 rounding (fmaf), bf16 denormals as zero, denormal results flushed to zero.
void small_rows_data_bf16(float* dx_nI, const float* dy_nO, const uint16_t* w_OI, int64_t n, int64_t I, int64_t O);
// dx += dy W, o in order, one fp32 multiply and add each.
void small_rows_data_widened(float* dx_nI, const float* dy_nO, const uint16_t* w_OI, int64_t n, int64_t I, int64_t O);
}  // namespace ref

}  // namespace moecore::kernels
