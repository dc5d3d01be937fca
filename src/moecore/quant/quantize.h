// One entry point for every recipe: quantize a row-major fp32 [rows, cols] operand for a usage.
//
//   auto spec = make_spec(Recipe::kBlockwise, element_format_for(Recipe::kBlockwise, Fp8Format::kHybrid,
//                                                                Role::kGradient), Role::kGradient);
//   QuantizedTensor q = quantize(dy_TN, T, N, spec, Usage::kRowwise);
//   const Tensor dy_decoded = decode_to_source(q);
#pragma once

#include <cstdint>

#include "moecore/quant/hadamard.h"
#include "moecore/quant/quantized_tensor.h"
#include "moecore/quant/recipe.h"
#include "moecore/tensor/tensor.h"

namespace moecore::quant {

struct QuantizeOptions {
  // Delayed scaling: this step's encode scale (DelayedScaling::scale()); other recipes compute their own.
  float tensor_scale = 1.0f;
  // Stochastic rounding (NVFP4 gradients): the seed of the counter-based random bits. Row-wise and column-wise
  // quantizations draw from separate streams.
  uint64_t seed = 0;
  // Signs of the random Hadamard transform (NVFP4 column-wise activations and gradients).
  RhtSigns rht_signs = te_rht_signs();
  // Where the column-wise transpose (and its Hadamard transform) is staged: the device of the call, so the
  // scratch is counted by its MemoryTracker and fenced by its allocator.
  Device device = Device::kCPU;
};

// Throws std::invalid_argument with a one-line message when a [rows, cols] operand cannot be quantized with `spec`:
// mxfp8 needs both dimensions divisible by 32 and nvfp4 both divisible by 16 (TE's MXFP8Quantizer.is_quantizable;
// NVFP4's 16-element blocks, 16x16 weight tiles and 16-point Hadamard groups along either dimension). moecore does
// not pad. Per-tensor and blockwise scaling take any shape (edge blocks cover what there is, as TE's kernels).
void check_quantizable(int64_t rows, int64_t cols, const QuantSpec& spec);

// Row-wise: blocks along cols, stored [rows, cols]. Column-wise: the transpose [cols, rows] is stored and blocked
// along its last dimension (the source's first), after the Hadamard transform when spec.rht. The stored block is
// spec.block_rows x spec.block_cols in both cases (a 1x128 row block of the transpose is a 128x1 column block of
// the source; 2D blocks are the same tiles).
QuantizedTensor quantize(const float* x, int64_t rows, int64_t cols, const QuantSpec& spec, Usage usage,
                         const QuantizeOptions& options = {});

// The decoded values in the source's layout [rows, cols]: column-wise data transposed back, the Hadamard transform
// undone where it was applied (so they compare with the input), allocated on `device` under `category`.
Tensor decode_to_source(const QuantizedTensor& q, const RhtSigns& signs = te_rht_signs(), Device device = Device::kCPU,
                        MemCategory category = MemCategory::kOther);

}  // namespace moecore::quant
