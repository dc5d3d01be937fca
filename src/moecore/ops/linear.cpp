#include "moecore/ops/linear.h"

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <optional>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "moecore/kernels/cpu/convert.h"
#include "moecore/kernels/cpu/gemm_lowp.h"
#include "moecore/ops/dispatch.h"
#include "moecore/ops/precision.h"
#include "moecore/ops/quantization.h"

namespace moecore::ops {
using detail::opt;
using detail::ptr;

namespace {

bool is_low(const DType dtype) { return dtype == DType::kBF16 || dtype == DType::kF16; }

kernels::LowpType lowp_type(const char* op, const DType dtype) {
  if (!is_low(dtype)) detail::fail(op, std::string(dtype_name(dtype)) + " is not a low-precision dtype");
  return dtype == DType::kBF16 ? kernels::LowpType::kBF16 : kernels::LowpType::kF16;
}

// Low-precision checks: every tensor defined and on the CPU; the GEMM inputs in the weight's dtype; each output
// (and the bias) in that dtype or fp32.
void check_lowp(const char* op, const DType low, std::initializer_list<std::pair<const char*, const Tensor*>> inputs,
                std::initializer_list<std::pair<const char*, const Tensor*>> fp32_or_low) {
  const auto check_defined = [op](const Tensor* t) {
    if (!t->defined()) detail::fail(op, "an argument tensor is undefined");
    if (t->device() != Device::kCPU) detail::fail(op, "no backend for device " + std::string(device_name(t->device())));
  };
  const std::string low_name(dtype_name(low));
  for (const auto& [name, t] : inputs) {
    if (t == nullptr) continue;
    check_defined(t);
    if (t->dtype() != low) {
      detail::fail(op, "mixed dtypes: " + std::string(name) + " is " + std::string(dtype_name(t->dtype())) + ", the " +
                           low_name + " weight's GEMM inputs must be " + low_name);
    }
  }
  for (const auto& [name, t] : fp32_or_low) {
    if (t == nullptr) continue;
    check_defined(t);
    if (t->dtype() != low && t->dtype() != DType::kF32) {
      detail::fail(op, "mixed dtypes: " + std::string(name) + " is " + std::string(dtype_name(t->dtype())) +
                           ", with a " + low_name + " weight it must be " + low_name + " or float32");
    }
  }
}

// Calls fn with t's data as float* (fp32, or null t) or uint16_t* (bf16 / fp16 bits).
template <typename Fn>
void with_data(Tensor* t, Fn&& fn) {
  if (t == nullptr) {
    fn(static_cast<float*>(nullptr));
  } else if (t->dtype() == DType::kF32) {
    fn(t->data<float>());
  } else {
    fn(t->data<uint16_t>());
  }
}
template <typename Fn>
void with_data(const Tensor* t, Fn&& fn) {
  with_data(const_cast<Tensor*>(t), [&](auto* p) { fn(static_cast<const std::remove_pointer_t<decltype(p)>*>(p)); });
}

const uint16_t* bits(const Tensor* t) { return t == nullptr ? nullptr : t->data<uint16_t>(); }

void linear_forward_lowp(Tensor& out_TO, const Tensor& inp_TI, const Tensor& weight_OI, const Tensor* bias_O,
                         const int64_t T, const int64_t I, const int64_t O) {
  const auto type = lowp_type("linear_forward", weight_OI.dtype());
  const bool reference = active_backend() == Backend::kReference;
  with_data(&out_TO, [&](auto* out) {
    with_data(bias_O, [&](const auto* bias) {
      if (reference) {
        kernels::ref::linear_forward_lowp(type, out, bits(&inp_TI), bits(&weight_OI), bias, T, I, O);
      } else {
        kernels::cpu::linear_forward_lowp(type, out, bits(&inp_TI), bits(&weight_OI), bias, T, I, O);
      }
    });
  });
}

void linear_backward_lowp(Tensor* dinp_TI, Tensor* dweight_OI, Tensor* dbias_O, const Tensor& dout_TO,
                          const Tensor* inp_TI, const Tensor& weight_OI, const int64_t T, const int64_t I,
                          const int64_t O) {
  const auto type = lowp_type("linear_backward", weight_OI.dtype());
  const bool reference = active_backend() == Backend::kReference;
  with_data(dinp_TI, [&](auto* dinp) {
    with_data(dweight_OI, [&](auto* dweight) {
      with_data(dbias_O, [&](auto* dbias) {
        if (reference) {
          kernels::ref::linear_backward_lowp(type, dinp, dweight, dbias, bits(&dout_TO), bits(inp_TI), bits(&weight_OI),
                                             T, I, O);
        } else {
          kernels::cpu::linear_backward_lowp(type, dinp, dweight, dbias, bits(&dout_TO), bits(inp_TI), bits(&weight_OI),
                                             T, I, O);
        }
      });
    });
  });
}

// Under --bf16 / --fp16 the fp32 operands of a layer's GEMMs hold 16-bit values (every op rounds what it writes to
// activation_dtype(), the optimizer rounds the weights), so the GEMM Megatron runs in 16 bits is this fp32 GEMM up
// to summation order: that is the "convert" path of gemm_lowp.h. Where lowp_gemm_path picks "native", the operands'
// 16-bit bits go to the CPU's bf16 / fp16 dot-product kernels instead (encoding them is exact). The result of
// either path is rounded by the caller like every activation.
std::optional<kernels::LowpType> native_lowp_type(const Tensor& weight_OI) {
  if (weight_OI.dtype() != DType::kF32 || active_backend() == Backend::kReference) return std::nullopt;
  const DType act = activation_dtype();
  if (!is_low(act)) return std::nullopt;
  const auto type = act == DType::kBF16 ? kernels::LowpType::kBF16 : kernels::LowpType::kF16;
  if (kernels::cpu::lowp_gemm_path(type) != kernels::cpu::LowpGemmPath::kNative) return std::nullopt;
  return type;
}

// The 16-bit bits of n fp32 values (exact for values of that format).
std::vector<uint16_t> encode_lowp(const kernels::LowpType type, const float* data, const int64_t n) {
  std::vector<uint16_t> bits_n(static_cast<size_t>(n));
  if (type == kernels::LowpType::kBF16) {
    kernels::cpu::encode_bf16(bits_n.data(), data, n);
  } else {
    kernels::cpu::encode_fp16(bits_n.data(), data, n);
  }
  return bits_n;
}

void linear_forward_native(const kernels::LowpType type, Tensor& out_TO, const Tensor& inp_TI, const Tensor& weight_OI,
                           const Tensor* bias_O, const int64_t T, const int64_t I, const int64_t O) {
  const auto x = encode_lowp(type, inp_TI.data<float>(), T * I);
  const auto w = encode_lowp(type, weight_OI.data<float>(), O * I);
  kernels::cpu::linear_forward_lowp(type, out_TO.data<float>(), x.data(), w.data(),
                                    bias_O ? bias_O->data<float>() : nullptr, T, I, O);
}

void linear_backward_native(const kernels::LowpType type, Tensor* dinp_TI, Tensor* dweight_OI, Tensor* dbias_O,
                            const Tensor& dout_TO, const Tensor* inp_TI, const Tensor& weight_OI, const int64_t T,
                            const int64_t I, const int64_t O) {
  const auto dy = encode_lowp(type, dout_TO.data<float>(), T * O);
  const auto w = dinp_TI ? encode_lowp(type, weight_OI.data<float>(), O * I) : std::vector<uint16_t>();
  const auto x = dweight_OI ? encode_lowp(type, inp_TI->data<float>(), T * I) : std::vector<uint16_t>();
  kernels::cpu::linear_backward_lowp(type, dinp_TI ? dinp_TI->data<float>() : nullptr,
                                     dweight_OI ? dweight_OI->data<float>() : nullptr,
                                     dbias_O ? dbias_O->data<float>() : nullptr, dy.data(),
                                     dweight_OI ? x.data() : nullptr, dinp_TI ? w.data() : nullptr, T, I, O);
}

// The quantization config that applies to these fp32 tensors, or null.
const quant::QuantizedLinearConfig* quantization_for(const Tensor& weight_OI) {
  return weight_OI.dtype() == DType::kF32 ? linear_quantization() : nullptr;
}

// A [T, C] fp32 operand with zero rows appended up to Tp rows (no copy when Tp == T).
class PaddedRows {
 public:
  PaddedRows(const float* data, const int64_t T, const int64_t C, const int64_t Tp) : data_(data) {
    if (Tp == T) return;
    padded_.assign(static_cast<size_t>(Tp * C), 0.0f);
    std::copy(data, data + T * C, padded_.begin());
    data_ = padded_.data();
  }
  const float* data() const { return data_; }

 private:
  const float* data_;
  std::vector<float> padded_;
};

int64_t padded_row_count(const int64_t T, const quant::Recipe recipe) {
  const int64_t multiple = quantization_row_multiple(recipe);
  return (T + multiple - 1) / multiple * multiple;
}

// Runs a quantized GEMM, reporting an operand the recipe cannot quantize as the op's error.
template <typename Fn>
void run_quantized(const char* op, Fn&& fn) {
  try {
    fn();
  } catch (const std::invalid_argument& e) {
    detail::fail(op, e.what());
  }
}

// dst[i] += src[i] for i < n.
void accumulate(float* dst, const float* src, const int64_t n) {
#pragma omp parallel for schedule(static) if (n > (1 << 16))
  for (int64_t i = 0; i < n; ++i) dst[i] += src[i];
}

// max |x_i| over n values (NaN skipped), the amax a cast records.
float abs_max(const float* x, const int64_t n) {
  float amax = 0.0f;
  for (int64_t i = 0; i < n; ++i) amax = std::fmax(amax, std::fabs(x[i]));
  return amax;
}

void linear_forward_quantized(Tensor& out_TO, const Tensor& inp_TI, const Tensor& weight_OI, const Tensor* bias_O,
                              const int64_t T, const int64_t I, const int64_t O,
                              const quant::QuantizedLinearConfig& base_config, quant::DelayedLinearScaling* delayed,
                              quant::DelayedForwardScales* forward_scales) {
  quant::QuantizedLinearConfig config = base_config;
  if (config.recipe == quant::Recipe::kDelayed) {
    if (delayed == nullptr) detail::fail("linear_forward", "FP8 delayed scaling needs the layer's scaling state");
    config.x = delayed->input();
    config.w = delayed->weight_for_forward();
    if (forward_scales != nullptr) *forward_scales = {config.x.scale, config.w.scale};
    // A forward without rows (an expert without tokens) still casts the weight in TE, recording its amax.
    if (T == 0 && config.w.amax != nullptr) {
      quant::record_amax(config.w.amax, abs_max(weight_OI.data<float>(), O * I));
    }
  }
  if (T == 0) return;  // no rows to quantize
  const int64_t Tp = padded_row_count(T, config.recipe);
  const PaddedRows x(inp_TI.data<float>(), T, I, Tp);
  float* out = out_TO.data<float>();
  std::vector<float> padded_out;
  if (Tp != T) padded_out.resize(static_cast<size_t>(Tp * O));
  float* y = Tp == T ? out : padded_out.data();
  run_quantized("linear_forward",
                [&] { quant::quantized_fprop(x.data(), weight_OI.data<float>(), y, Tp, I, O, config); });
  if (Tp != T) std::copy(y, y + T * O, out);
  if (bias_O != nullptr) {  // added to the fp32 product, as TE's GEMM epilogue adds it
    const float* bias = bias_O->data<float>();
#pragma omp parallel for schedule(static) if (T * O > (1 << 16))
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t o = 0; o < O; ++o) out[t * O + o] += bias[o];
    }
  }
}

void linear_backward_quantized(Tensor* dinp_TI, Tensor* dweight_OI, Tensor* dbias_O, const Tensor& dout_TO,
                               const Tensor* inp_TI, const Tensor& weight_OI, const int64_t T, const int64_t I,
                               const int64_t O, const quant::QuantizedLinearConfig& base_config,
                               quant::DelayedLinearScaling* delayed,
                               const quant::DelayedForwardScales* forward_scales) {
  constexpr const char* op = "linear_backward";
  if (T == 0) return;  // every gradient gets a zero contribution
  quant::QuantizedLinearConfig config = base_config;
  if (config.recipe == quant::Recipe::kDelayed) {
    if (delayed == nullptr || forward_scales == nullptr) {
      detail::fail(op, "FP8 delayed scaling needs the layer's scaling state and its forward's scales");
    }
    // x and W at the scales their forward used, as TE saves them quantized for both usages (not recorded again).
    config.x = {forward_scales->input, nullptr};
    config.w = {forward_scales->weight, nullptr};
    config.dy = delayed->grad_output();
  }
  config.seed = quantization_seed(base_config.seed, gradient_fingerprint(dout_TO.data<float>(), T * O));
  const int64_t Tp = padded_row_count(T, config.recipe);
  const PaddedRows dy(dout_TO.data<float>(), T, O, Tp);
  if (dinp_TI != nullptr) {
    std::vector<float> dx(static_cast<size_t>(Tp * I));
    run_quantized(op, [&] { quant::quantized_dgrad(dy.data(), weight_OI.data<float>(), dx.data(), Tp, I, O, config); });
    accumulate(dinp_TI->data<float>(), dx.data(), T * I);
  }
  if (dweight_OI != nullptr) {
    const PaddedRows x(inp_TI->data<float>(), T, I, Tp);
    std::vector<float> dw(static_cast<size_t>(O * I));
    run_quantized(op, [&] { quant::quantized_wgrad(dy.data(), x.data(), dw.data(), Tp, I, O, config); });
    accumulate(dweight_OI->data<float>(), dw.data(), O * I);
  }
  if (dbias_O != nullptr) {  // reduced from the unquantized gradient
    detail::dispatch(op, dout_TO, [&]<typename S>(auto k) {
      k.linear_backward(static_cast<S*>(nullptr), static_cast<S*>(nullptr), ptr<S>(*dbias_O), ptr<S>(dout_TO),
                        static_cast<const S*>(nullptr), ptr<S>(weight_OI), T, I, O);
    });
  }
}

}  // namespace

void linear_forward(Tensor& out_TO, const Tensor& inp_TI, const Tensor& weight_OI, const Tensor* bias_O,
                    quant::DelayedLinearScaling* delayed, quant::DelayedForwardScales* forward_scales) {
  constexpr const char* op = "linear_forward";
  const bool low = weight_OI.defined() && is_low(weight_OI.dtype());
  if (low) {
    check_lowp(op, weight_OI.dtype(), {{"inp_TI", &inp_TI}, {"weight_OI", &weight_OI}},
               {{"out_TO", &out_TO}, {"bias_O", bias_O}});
  } else {
    detail::check_tensors(op, {&out_TO, &inp_TI, &weight_OI, bias_O});
  }
  const int64_t O = weight_OI.dim(0), I = weight_OI.numel() / O, T = inp_TI.numel() / I;
  detail::check_numel(op, "inp_TI", inp_TI, T * I);
  detail::check_numel(op, "out_TO", out_TO, T * O);
  if (bias_O != nullptr) detail::check_numel(op, "bias_O", *bias_O, O);
  if (low) {
    linear_forward_lowp(out_TO, inp_TI, weight_OI, bias_O, T, I, O);
    return;
  }
  if (const auto* config = quantization_for(weight_OI)) {
    linear_forward_quantized(out_TO, inp_TI, weight_OI, bias_O, T, I, O, *config, delayed, forward_scales);
    detail::round_activations({&out_TO});
    return;
  }
  if (const auto type = native_lowp_type(weight_OI)) {
    linear_forward_native(*type, out_TO, inp_TI, weight_OI, bias_O, T, I, O);
    detail::round_activations({&out_TO});
    return;
  }
  detail::dispatch(op, out_TO, [&]<typename S>(auto k) {
    k.linear_forward(ptr<S>(out_TO), ptr<S>(inp_TI), ptr<S>(weight_OI), opt<S>(bias_O), T, I, O);
  });
  detail::round_activations({&out_TO});
}

void linear_backward(Tensor* dinp_TI, Tensor* dweight_OI, Tensor* dbias_O, const Tensor& dout_TO, const Tensor* inp_TI,
                     const Tensor& weight_OI, quant::DelayedLinearScaling* delayed,
                     const quant::DelayedForwardScales* forward_scales) {
  constexpr const char* op = "linear_backward";
  const bool low = weight_OI.defined() && is_low(weight_OI.dtype());
  if (low) {
    check_lowp(op, weight_OI.dtype(), {{"dout_TO", &dout_TO}, {"inp_TI", inp_TI}, {"weight_OI", &weight_OI}},
               {{"dinp_TI", dinp_TI}, {"dweight_OI", dweight_OI}, {"dbias_O", dbias_O}});
  } else {
    detail::check_tensors(op, {dinp_TI, dweight_OI, dbias_O, &dout_TO, inp_TI, &weight_OI});
  }
  if (dweight_OI != nullptr && inp_TI == nullptr) detail::fail(op, "dweight_OI needs inp_TI");
  const int64_t O = weight_OI.dim(0), I = weight_OI.numel() / O, T = dout_TO.numel() / O;
  detail::check_numel(op, "dout_TO", dout_TO, T * O);
  if (dinp_TI != nullptr) detail::check_numel(op, "dinp_TI", *dinp_TI, T * I);
  if (inp_TI != nullptr) detail::check_numel(op, "inp_TI", *inp_TI, T * I);
  if (dweight_OI != nullptr) detail::check_numel(op, "dweight_OI", *dweight_OI, O * I);
  if (dbias_O != nullptr) detail::check_numel(op, "dbias_O", *dbias_O, O);
  if (low) {
    linear_backward_lowp(dinp_TI, dweight_OI, dbias_O, dout_TO, inp_TI, weight_OI, T, I, O);
    return;
  }
  if (const auto* config = quantization_for(weight_OI)) {
    linear_backward_quantized(dinp_TI, dweight_OI, dbias_O, dout_TO, inp_TI, weight_OI, T, I, O, *config, delayed,
                              forward_scales);
    detail::round_activations({dinp_TI});
    return;
  }
  if (const auto type = native_lowp_type(weight_OI)) {
    linear_backward_native(*type, dinp_TI, dweight_OI, dbias_O, dout_TO, inp_TI, weight_OI, T, I, O);
    detail::round_activations({dinp_TI});
    return;
  }
  detail::dispatch(op, dout_TO, [&]<typename S>(auto k) {
    k.linear_backward(opt<S>(dinp_TI), opt<S>(dweight_OI), opt<S>(dbias_O), ptr<S>(dout_TO), opt<S>(inp_TI),
                      ptr<S>(weight_OI), T, I, O);
  });
  detail::round_activations({dinp_TI});  // weight and bias gradients stay fp32 (main grads)
}

std::string gemm_library() { return kernels::cpu::gemm_library(); }

std::string gemm_lowp_library(const DType dtype) {
  return kernels::cpu::gemm_lowp_library(lowp_type("gemm_lowp_library", dtype));
}

}  // namespace moecore::ops
