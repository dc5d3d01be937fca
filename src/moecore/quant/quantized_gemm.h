// The three GEMMs of a linear layer y = x W^T with quantized operands, as TE's Linear quantizes them
// (transformer_engine/pytorch/module/linear.py with the recipe's quantizers): each operand is quantized along the
// GEMM's reduction dimension, then the product of the decoded operands is accumulated in fp32
// (kernels::cpu::sgemm), which is what the tensor cores compute up to the accumulation order.
//
//   GEMM    product           reduction   operands (usage)
//   fprop   y  = x W^T        K           x row-wise (activation), W row-wise (weight)
//   dgrad   dx = dy W         N           dy row-wise (gradient), W column-wise (weight)
//   wgrad   dW = dy^T x       T           dy column-wise (gradient), x column-wise (activation)
//
// Per recipe: tensorwise / delayed one scale per operand; blockwise 1x128 x and dy, 128x128 W; mxfp8 1x32
// everywhere; nvfp4 1x16 x and dy, 16x16 W, stochastic rounding for dy, and the Hadamard transform on wgrad's
// operands (column-wise x and dy, both along T, so it cancels in the product).
#pragma once

#include <cstdint>

#include "moecore/quant/delayed_linear_scaling.h"
#include "moecore/quant/delayed_scaling.h"
#include "moecore/quant/hadamard.h"
#include "moecore/quant/packed_quantized_tensor.h"
#include "moecore/quant/recipe.h"
#include "moecore/tensor/device.h"

namespace moecore::quant {

struct QuantizedLinearConfig {
  Recipe recipe = Recipe::kTensorwise;
  Fp8Format format = Fp8Format::kHybrid;  // ignored by nvfp4
  uint64_t seed = 0;                      // nvfp4 gradients' stochastic rounding
  // Linear layers save their input quantized for wgrad (quantize_wgrad_input) where they are its only keeper, as
  // TE's modules do. false keeps the high-precision input (a test-only switch: the two must train bit for bit).
  bool save_quantized_input = true;
  RhtSigns rht_signs = te_rht_signs();
  // Recipe::kDelayed: the options of every layer's scaling state (delayed_linear_scaling.h), and for one GEMM call
  // each operand's scale and amax slot (the layer's state gives them; its formats are element_format_for's). The
  // caller updates the states after the step.
  DelayedScalingOptions delayed;
  DelayedOperand x, w, dy;
};

// `device` is the one the operands live on (a host-accessible one): the quantized operands are staged there, counted
// by its MemoryTracker (MemCategory::kOther) and fenced by its allocator.
// y_TN = x_TK @ w_NK^T.
void quantized_fprop(const float* x_TK, const float* w_NK, float* y_TN, int64_t T, int64_t K, int64_t N,
                     const QuantizedLinearConfig& config, Device device);
// dx_TK = dy_TN @ w_NK.
void quantized_dgrad(const float* dy_TN, const float* w_NK, float* dx_TK, int64_t T, int64_t K, int64_t N,
                     const QuantizedLinearConfig& config, Device device);
// dw_NK = dy_TN^T @ x_TK.
void quantized_wgrad(const float* dy_TN, const float* x_TK, float* dw_NK, int64_t T, int64_t K, int64_t N,
                     const QuantizedLinearConfig& config, Device device);

// Saving the input quantized (TE's Linear saves inputmat quantized for the column-wise usage, module/linear.py): the
// forward quantizes x_TK as wgrad's operand (column-wise, activation role: under delayed scaling at config.x.scale,
// recording no amax; NVFP4 with the Hadamard transform; activations never round stochastically, so the backward's
// seed plays no part) and packs it under `category`; wgrad then reads it instead of quantizing x again. The two
// give quantized_wgrad's result bit for bit.
PackedQuantizedTensor quantize_wgrad_input(const float* x_TK, int64_t T, int64_t K, const QuantizedLinearConfig& config,
                                           MemCategory category, Device device);
void quantized_wgrad_saved(const float* dy_TN, const PackedQuantizedTensor& x_KT, float* dw_NK, int64_t T, int64_t K,
                           int64_t N, const QuantizedLinearConfig& config, Device device);

}  // namespace moecore::quant
