// Low-precision linear layers (Megatron's --fp8-format / --fp4-format with TransformerEngine's Linear): while a
// ScopedLinearQuantization with a config is live, ops::linear_forward / linear_backward on fp32 tensors compute
// their three GEMMs with quantized operands (quant::quantized_fprop / quantized_dgrad / quantized_wgrad: each operand
// quantized along the GEMM's reduction dimension, products accumulated in fp32). The bias and its gradient stay in
// high precision, as TE adds the bias in the GEMM epilogue and reduces dbias from the unquantized gradient.
// Row counts that do not fit the recipe's block (mxfp8: 32 rows, nvfp4: 16) are padded with zero rows, as
// Megatron's Fp8Padding pads each expert's tokens (megatron/core/transformer/moe/experts.py): zero rows add nothing
// to the products and do not change any scale. bf16 / fp16 and fp64 tensors are never quantized. Under
// quant::Recipe::kDelayed the config carries only the recipe's options: each call names its layer's
// quant::DelayedLinearScaling (the linear ops' `delayed` argument), whose scales it quantizes with and whose amax
// histories it records into.
#pragma once

#include <cstdint>

#include "moecore/quant/quantized_gemm.h"
#include "moecore/tensor/device.h"

namespace moecore::ops {

// The innermost live ScopedLinearQuantization's config of `device`, or null (high precision).
const quant::QuantizedLinearConfig* linear_quantization(Device device = Device::kCPU);

// Sets the quantization of the linear layers on `device` until destroyed (for every thread, so OpenMP workers agree;
// nests and restores the previous one; null switches quantization off, as Megatron keeps its router and bf16 layers
// unquantized). The config must outlive the scope. Create and destroy it on one thread, outside parallel regions.
class ScopedLinearQuantization {
 public:
  explicit ScopedLinearQuantization(const quant::QuantizedLinearConfig* config, Device device = Device::kCPU);
  ~ScopedLinearQuantization();
  ScopedLinearQuantization(const ScopedLinearQuantization&) = delete;
  ScopedLinearQuantization& operator=(const ScopedLinearQuantization&) = delete;

 private:
  Device device_;
  const quant::QuantizedLinearConfig* previous_;
};

// Stochastic rounding of NVFP4 gradients: a quantized linear_backward call draws its random bits from
// quantization_seed(config.seed, gradient_fingerprint(dout)), so a run is reproducible from its seed, and no two
// calls share a stream unless their gradients are identical, whatever order OpenMP workers make the calls in (the
// experts' GEMMs run in parallel, so a call counter would not be reproducible).
uint64_t gradient_fingerprint(const float* data, int64_t n);
uint64_t quantization_seed(uint64_t base_seed, uint64_t fingerprint);

// The row multiple a recipe's blocks need along the token dimension (mxfp8 32, nvfp4 16, others 1).
int64_t quantization_row_multiple(quant::Recipe recipe);

}  // namespace moecore::ops
