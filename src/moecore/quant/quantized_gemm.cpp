#include "moecore/quant/quantized_gemm.h"

#include <stdexcept>
#include <string>

#include "moecore/kernels/cpu/gemm.h"
#include "moecore/quant/quantize.h"

namespace moecore::quant {
namespace {

const DelayedOperand& delayed_operand(const QuantizedLinearConfig& config, const Role role) {
  switch (role) {
    case Role::kActivation: return config.x;
    case Role::kWeight: return config.w;
    case Role::kGradient: break;
  }
  return config.dy;
}

// The operand quantized for `usage` (delayed scaling: at its operand's scale, recording its amax where the operand
// has a slot and `record_amax_slot`).
QuantizedTensor quantize_operand(const float* x, const int64_t rows, const int64_t cols, const Role role,
                                 const Usage usage, const QuantizedLinearConfig& config, const Device device,
                                 const bool record_amax_slot = true) {
  const ElementFormat element = element_format_for(config.recipe, config.format, role);
  const QuantSpec spec = make_spec(config.recipe, element, role);
  QuantizeOptions options;
  options.seed = config.seed;
  options.rht_signs = config.rht_signs;
  options.device = device;
  const DelayedOperand* delayed = config.recipe == Recipe::kDelayed ? &delayed_operand(config, role) : nullptr;
  if (delayed != nullptr) options.tensor_scale = delayed->scale;
  QuantizedTensor q = quantize(x, rows, cols, spec, usage, options);
  if (record_amax_slot && delayed != nullptr && delayed->amax != nullptr) record_amax(delayed->amax, q.amax);
  return q;
}

// A quantized operand decoded in its stored layout ([rows, cols] row-wise, [cols, rows] column-wise,
// Hadamard-transformed where the recipe does so: the GEMM multiplies the transformed operands), on `device`.
Tensor decoded(const QuantizedTensor& q, const Device device) {
  Tensor out({q.rows, q.cols}, DType::kF32, MemCategory::kOther, device);
  q.decode_into(out.data<float>());
  return out;
}

// The operand quantized for `usage` and decoded.
Tensor quantize_decoded(const float* x, const int64_t rows, const int64_t cols, const Role role, const Usage usage,
                        const QuantizedLinearConfig& config, const Device device) {
  return decoded(quantize_operand(x, rows, cols, role, usage, config, device), device);
}

void wgrad_product(const Tensor& dy_NT, const Tensor& x_KT, float* dw_NK, const int64_t T, const int64_t K,
                   const int64_t N) {
  kernels::cpu::sgemm(false, true, N, K, T, 1.0f, dy_NT.data<float>(), T, x_KT.data<float>(), T, 0.0f, dw_NK, K);
}

}  // namespace

void quantized_fprop(const float* x_TK, const float* w_NK, float* y_TN, const int64_t T, const int64_t K,
                     const int64_t N, const QuantizedLinearConfig& config, const Device device) {
  const Tensor x = quantize_decoded(x_TK, T, K, Role::kActivation, Usage::kRowwise, config, device);
  const Tensor w = quantize_decoded(w_NK, N, K, Role::kWeight, Usage::kRowwise, config, device);
  kernels::cpu::sgemm(false, true, T, N, K, 1.0f, x.data<float>(), K, w.data<float>(), K, 0.0f, y_TN, N);
}

void quantized_dgrad(const float* dy_TN, const float* w_NK, float* dx_TK, const int64_t T, const int64_t K,
                     const int64_t N, const QuantizedLinearConfig& config, const Device device) {
  const Tensor dy = quantize_decoded(dy_TN, T, N, Role::kGradient, Usage::kRowwise, config, device);
  const Tensor w_KN = quantize_decoded(w_NK, N, K, Role::kWeight, Usage::kColumnwise, config, device);
  kernels::cpu::sgemm(false, true, T, K, N, 1.0f, dy.data<float>(), N, w_KN.data<float>(), N, 0.0f, dx_TK, K);
}

void quantized_wgrad(const float* dy_TN, const float* x_TK, float* dw_NK, const int64_t T, const int64_t K,
                     const int64_t N, const QuantizedLinearConfig& config, const Device device) {
  const Tensor dy_NT = quantize_decoded(dy_TN, T, N, Role::kGradient, Usage::kColumnwise, config, device);
  const Tensor x_KT = quantize_decoded(x_TK, T, K, Role::kActivation, Usage::kColumnwise, config, device);
  wgrad_product(dy_NT, x_KT, dw_NK, T, K, N);
}

PackedQuantizedTensor quantize_wgrad_input(const float* x_TK, const int64_t T, const int64_t K,
                                           const QuantizedLinearConfig& config, const MemCategory category,
                                           const Device device) {
  // The forward's copy for backward records no amax: the forward's row-wise quantization of x did (TE's cast
  // kernels write the row-wise and column-wise data in one pass with one amax).
  return pack(quantize_operand(x_TK, T, K, Role::kActivation, Usage::kColumnwise, config, device, false), device,
              category);
}

void quantized_wgrad_saved(const float* dy_TN, const PackedQuantizedTensor& x_KT, float* dw_NK, const int64_t T,
                           const int64_t K, const int64_t N, const QuantizedLinearConfig& config, const Device device) {
  if (x_KT.meta.rows != K || x_KT.meta.cols != T || x_KT.meta.usage != Usage::kColumnwise) {
    throw std::invalid_argument("the saved quantized input is not the column-wise [" + std::to_string(K) + ", " +
                                std::to_string(T) + "] operand of this weight gradient");
  }
  const Tensor dy_NT = quantize_decoded(dy_TN, T, N, Role::kGradient, Usage::kColumnwise, config, device);
  wgrad_product(dy_NT, decoded(unpack(x_KT), device), dw_NK, T, K, N);
}

}  // namespace moecore::quant
