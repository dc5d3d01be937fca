#include "moecore/quant/quantized_gemm.h"

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

// The operand quantized for `usage` and decoded in its stored layout ([rows, cols] row-wise, [cols, rows]
// column-wise, Hadamard-transformed where the recipe does so: the GEMM multiplies the transformed operands), on
// `device`.
Tensor quantize_decoded(const float* x, const int64_t rows, const int64_t cols, const Role role, const Usage usage,
                        const QuantizedLinearConfig& config, const Device device) {
  const ElementFormat element = element_format_for(config.recipe, config.format, role);
  const QuantSpec spec = make_spec(config.recipe, element, role);
  QuantizeOptions options;
  options.seed = config.seed;
  options.rht_signs = config.rht_signs;
  options.device = device;
  const DelayedOperand* delayed = config.recipe == Recipe::kDelayed ? &delayed_operand(config, role) : nullptr;
  if (delayed != nullptr) options.tensor_scale = delayed->scale;
  const QuantizedTensor q = quantize(x, rows, cols, spec, usage, options);
  if (delayed != nullptr && delayed->amax != nullptr) record_amax(delayed->amax, q.amax);
  Tensor decoded({q.rows, q.cols}, DType::kF32, MemCategory::kOther, device);
  q.decode_into(decoded.data<float>());
  return decoded;
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
  kernels::cpu::sgemm(false, true, N, K, T, 1.0f, dy_NT.data<float>(), T, x_KT.data<float>(), T, 0.0f, dw_NK, K);
}

}  // namespace moecore::quant
