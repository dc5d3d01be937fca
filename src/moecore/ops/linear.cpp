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
#include "moecore/ops/delayed_scales_replay.h"
#include "moecore/ops/dispatch.h"
#include "moecore/ops/precision.h"
#include "moecore/ops/quantization.h"
#include "moecore/ops/weight_casts.h"

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
  const Device device = inputs.begin()->second->device();
  const auto check_defined = [op, device](const Tensor* t) {
    if (!t->defined()) detail::fail(op, "an argument tensor is undefined");
    if (t->device() != device) detail::fail(op, "tensors on different devices");
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
  constexpr const char* op = "linear_forward";
  const auto type = lowp_type(op, weight_OI.dtype());
  detail::with_kernels(op, weight_OI.device(), [&](auto k) {
    with_data(&out_TO, [&](auto* out) {
      with_data(bias_O, [&](const auto* bias) {
        k.linear_forward_lowp(type, out, bits(&inp_TI), bits(&weight_OI), bias, T, I, O);
      });
    });
  });
}

void linear_backward_lowp(Tensor* dinp_TI, Tensor* dweight_OI, Tensor* dbias_O, const Tensor& dout_TO,
                          const Tensor* inp_TI, const Tensor& weight_OI, const int64_t T, const int64_t I,
                          const int64_t O) {
  constexpr const char* op = "linear_backward";
  const auto type = lowp_type(op, weight_OI.dtype());
  detail::with_kernels(op, weight_OI.device(), [&](auto k) {
    with_data(dinp_TI, [&](auto* dinp) {
      with_data(dweight_OI, [&](auto* dweight) {
        with_data(dbias_O, [&](auto* dbias) {
          k.linear_backward_lowp(type, dinp, dweight, dbias, bits(&dout_TO), bits(inp_TI), bits(&weight_OI), T, I, O);
        });
      });
    });
  });
}

// Under --bf16 / --fp16 the fp32 operands of a layer's GEMMs hold 16-bit values (every op rounds what it writes to
// the activation dtype, the optimizer rounds the weights), so the GEMM Megatron runs in 16 bits is this fp32 GEMM up
// to summation order: that is the "convert" path of gemm_lowp.h. Where the device's table says the native path
// applies, the operands' 16-bit bits go to the CPU's bf16 / fp16 dot-product kernels instead (encoding them is
// exact). The result of either path is rounded by the caller like every activation.
std::optional<kernels::LowpType> native_lowp_type(const char* op, const Tensor& weight_OI) {
  if (weight_OI.dtype() != DType::kF32) return std::nullopt;
  const std::optional<DType> act = detail::native_gemm_dtype(weight_OI.device());
  if (!act) return std::nullopt;
  return lowp_type(op, *act);
}

// The 16-bit bits of an fp32 tensor's values (exact for values of that format), on its device; a tensor stored in
// that 16-bit dtype already (16-bit activations, staging.h) is its own bits.
Tensor encode_lowp(const char* op, const kernels::LowpType type, const Tensor& t) {
  if (t.dtype() == (type == kernels::LowpType::kBF16 ? DType::kBF16 : DType::kF16)) return t.view({t.numel()});
  Tensor bits_n = Tensor::uninitialized({t.numel()}, type == kernels::LowpType::kBF16 ? DType::kBF16 : DType::kF16,
                                        MemCategory::kOther, t.device());
  detail::with_kernels(op, t.device(), [&](auto k) {
    type == kernels::LowpType::kBF16 ? k.encode_bf16(bits_n.data<uint16_t>(), t.data<float>(), t.numel())
                                     : k.encode_fp16(bits_n.data<uint16_t>(), t.data<float>(), t.numel());
  });
  return bits_n;
}

// A weight's 16-bit bits: the step's kept cast (weight_casts.h), else cast now.
Tensor weight_lowp(const char* op, const kernels::LowpType type, const Tensor& weight_OI) {
  Tensor cast = cached_weight_cast(weight_OI, type == kernels::LowpType::kBF16 ? DType::kBF16 : DType::kF16);
  return cast.defined() ? cast : encode_lowp(op, type, weight_OI);
}

void linear_forward_native(const kernels::LowpType type, Tensor& out_TO, const Tensor& inp_TI, const Tensor& weight_OI,
                           const Tensor* bias_O, const int64_t T, const int64_t I, const int64_t O) {
  constexpr const char* op = "linear_forward";
  const Tensor x = encode_lowp(op, type, inp_TI);
  const Tensor w = weight_lowp(op, type, weight_OI);
  detail::with_kernels(op, weight_OI.device(), [&](auto k) {
    k.linear_forward_lowp(type, out_TO.data<float>(), bits(&x), bits(&w), bias_O ? bias_O->data<float>() : nullptr, T,
                          I, O);
  });
}

void linear_backward_native(const kernels::LowpType type, Tensor* dinp_TI, Tensor* dweight_OI, Tensor* dbias_O,
                            const Tensor& dout_TO, const Tensor* inp_TI, const Tensor& weight_OI, const int64_t T,
                            const int64_t I, const int64_t O) {
  constexpr const char* op = "linear_backward";
  const Tensor dy = encode_lowp(op, type, dout_TO);
  const Tensor w = dinp_TI ? weight_lowp(op, type, weight_OI) : Tensor();
  const Tensor x = dweight_OI ? encode_lowp(op, type, *inp_TI) : Tensor();
  detail::with_kernels(op, weight_OI.device(), [&](auto k) {
    k.linear_backward_lowp(type, dinp_TI ? dinp_TI->data<float>() : nullptr,
                           dweight_OI ? dweight_OI->data<float>() : nullptr, dbias_O ? dbias_O->data<float>() : nullptr,
                           bits(&dy), dweight_OI ? bits(&x) : nullptr, dinp_TI ? bits(&w) : nullptr, T, I, O);
  });
}

// The quantization config that applies to these fp32 tensors, or null.
const quant::QuantizedLinearConfig* quantization_for(const Tensor& weight_OI) {
  return weight_OI.dtype() == DType::kF32 ? linear_quantization(weight_OI.device()) : nullptr;
}

// A [T, C] fp32 operand with zero rows appended up to Tp rows, on its device (the tensor itself when Tp == T).
Tensor padded_rows(const Tensor& t, const int64_t T, const int64_t C, const int64_t Tp) {
  if (Tp == T) return t;
  Tensor padded({Tp, C}, DType::kF32, MemCategory::kOther, t.device());
  std::copy_n(t.data<float>(), T * C, padded.data<float>());
  return padded;
}

int64_t padded_row_count(const int64_t T, const quant::Recipe recipe) {
  const int64_t multiple = quantization_row_multiple(recipe);
  return (T + multiple - 1) / multiple * multiple;
}

// Runs a quantized GEMM from the device's table, reporting an operand the recipe cannot quantize as the op's error.
template <typename Fn>
void run_quantized(const char* op, const Device device, Fn&& fn) {
  try {
    detail::with_kernels(op, device, fn);
  } catch (const std::invalid_argument& e) {
    detail::fail(op, e.what());
  }
}

void linear_forward_quantized(Tensor& out_TO, const Tensor& inp_TI, const Tensor& weight_OI, const Tensor* bias_O,
                              const int64_t T, const int64_t I, const int64_t O,
                              const quant::QuantizedLinearConfig& base_config, quant::DelayedLinearScaling* delayed,
                              quant::DelayedForwardScales* forward_scales, quant::PackedQuantizedTensor* saved_input) {
  constexpr const char* op = "linear_forward";
  const Device device = weight_OI.device();
  quant::QuantizedLinearConfig config = base_config;
  if (config.recipe == quant::Recipe::kDelayed) {
    if (delayed == nullptr) detail::fail(op, "FP8 delayed scaling needs the layer's scaling state");
    ScopedDelayedScales::Mode mode{};
    DelayedScalesLog* log = delayed_scales_log(&mode);
    if (log != nullptr && mode == ScopedDelayedScales::Mode::kReplay) {
      const quant::DelayedForwardScales scales = log->take(delayed);
      config.x = {scales.input, nullptr};
      config.w = {scales.weight, nullptr};
    } else {
      config.x = delayed->input();
      config.w = delayed->weight_for_forward();
      if (log != nullptr) log->record(delayed, {config.x.scale, config.w.scale});
    }
    if (forward_scales != nullptr) *forward_scales = {config.x.scale, config.w.scale};
    // A forward without rows (an expert without tokens) still casts the weight in TE, recording its amax.
    if (T == 0 && config.w.amax != nullptr) {
      float amax = 0.0f;
      detail::with_kernels(op, device, [&](auto k) { amax = k.abs_max(weight_OI.data<float>(), O * I); });
      quant::record_amax(config.w.amax, amax);
    }
  }
  if (T == 0) return;  // no rows to quantize
  const int64_t Tp = padded_row_count(T, config.recipe);
  const Tensor x = padded_rows(inp_TI, T, I, Tp);
  Tensor y = Tp == T ? out_TO : Tensor({Tp, O}, DType::kF32, MemCategory::kOther, device);
  run_quantized(op, device, [&](auto k) {
    k.quantized_fprop(x.data<float>(), weight_OI.data<float>(), y.data<float>(), Tp, I, O, config);
    if (saved_input != nullptr) {
      // wgrad's x operand now, at the scale fprop used (delayed: the forward's, as backward reads it), not recorded.
      quant::QuantizedLinearConfig input_config = config;
      input_config.x.amax = nullptr;
      *saved_input = k.quantize_wgrad_input(x.data<float>(), Tp, I, input_config, MemCategory::kActivations);
    }
  });
  if (Tp != T) std::copy_n(y.data<float>(), T * O, out_TO.data<float>());
  if (bias_O != nullptr) {  // added to the fp32 product, as TE's GEMM epilogue adds it
    detail::with_kernels(op, device,
                         [&](auto k) { k.add_bias_rows(out_TO.data<float>(), bias_O->data<float>(), T, O); });
  }
}

void linear_backward_quantized(Tensor* dinp_TI, Tensor* dweight_OI, Tensor* dbias_O, const Tensor& dout_TO,
                               const Tensor* inp_TI, const Tensor& weight_OI, const int64_t T, const int64_t I,
                               const int64_t O, const quant::QuantizedLinearConfig& base_config,
                               quant::DelayedLinearScaling* delayed, const quant::DelayedForwardScales* forward_scales,
                               const quant::PackedQuantizedTensor* saved_input) {
  constexpr const char* op = "linear_backward";
  if (T == 0) return;  // every gradient gets a zero contribution
  const Device device = weight_OI.device();
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
  const Tensor dy = padded_rows(dout_TO, T, O, Tp);
  if (dinp_TI != nullptr) {
    Tensor dx({Tp, I}, DType::kF32, MemCategory::kOther, device);
    run_quantized(op, device, [&](auto k) {
      k.quantized_dgrad(dy.data<float>(), weight_OI.data<float>(), dx.data<float>(), Tp, I, O, config);
      k.add_inplace(dinp_TI->data<float>(), dx.data<float>(), T * I);
    });
  }
  if (dweight_OI != nullptr) {
    Tensor dw({O, I}, DType::kF32, MemCategory::kOther, device);
    if (saved_input != nullptr) {
      run_quantized(op, device, [&](auto k) {
        k.quantized_wgrad_saved(dy.data<float>(), *saved_input, dw.data<float>(), Tp, I, O, config);
      });
    } else {
      const Tensor x = padded_rows(*inp_TI, T, I, Tp);
      run_quantized(op, device, [&](auto k) {
        k.quantized_wgrad(dy.data<float>(), x.data<float>(), dw.data<float>(), Tp, I, O, config);
      });
    }
    detail::with_kernels(op, device,
                         [&](auto k) { k.add_inplace(dweight_OI->data<float>(), dw.data<float>(), O * I); });
  }
  if (dbias_O != nullptr) {  // reduced from the unquantized gradient
    detail::dispatch(op, dout_TO, [&]<typename S>(auto k) {
      k.linear_backward(static_cast<S*>(nullptr), static_cast<S*>(nullptr), ptr<S>(*dbias_O), ptr<S>(dout_TO),
                        static_cast<const S*>(nullptr), ptr<S>(weight_OI), T, I, O);
    });
  }
}

}  // namespace

namespace {

void linear_forward_f32(Tensor& out_TO, const Tensor& inp_TI, const Tensor& weight_OI, const Tensor* bias_O,
                        quant::DelayedLinearScaling* delayed, quant::DelayedForwardScales* forward_scales,
                        quant::PackedQuantizedTensor* saved_input) {
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
    linear_forward_quantized(out_TO, inp_TI, weight_OI, bias_O, T, I, O, *config, delayed, forward_scales,
                             config->save_quantized_input ? saved_input : nullptr);
    detail::round_activations({&out_TO});
    return;
  }
  if (const auto type = native_lowp_type(op, weight_OI)) {
    linear_forward_native(*type, out_TO, inp_TI, weight_OI, bias_O, T, I, O);
    detail::round_activations({&out_TO});
    return;
  }
  detail::dispatch(op, out_TO, [&]<typename S>(auto k) {
    k.linear_forward(ptr<S>(out_TO), ptr<S>(inp_TI), ptr<S>(weight_OI), opt<S>(bias_O), T, I, O);
  });
  detail::round_activations({&out_TO});
}

void linear_backward_f32(Tensor* dinp_TI, Tensor* dweight_OI, Tensor* dbias_O, const Tensor& dout_TO,
                         const Tensor* inp_TI, const Tensor& weight_OI, quant::DelayedLinearScaling* delayed,
                         const quant::DelayedForwardScales* forward_scales,
                         const quant::PackedQuantizedTensor* saved_input) {
  constexpr const char* op = "linear_backward";
  const bool low = weight_OI.defined() && is_low(weight_OI.dtype());
  if (low) {
    check_lowp(op, weight_OI.dtype(), {{"dout_TO", &dout_TO}, {"inp_TI", inp_TI}, {"weight_OI", &weight_OI}},
               {{"dinp_TI", dinp_TI}, {"dweight_OI", dweight_OI}, {"dbias_O", dbias_O}});
  } else {
    detail::check_tensors(op, {dinp_TI, dweight_OI, dbias_O, &dout_TO, inp_TI, &weight_OI});
  }
  const bool quantized = quantization_for(weight_OI) != nullptr;
  if (saved_input != nullptr && !quantized) detail::fail(op, "a saved quantized input without a quantized recipe");
  if (dweight_OI != nullptr && inp_TI == nullptr && saved_input == nullptr) {
    detail::fail(op, "dweight_OI needs inp_TI or its saved quantization");
  }
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
                              forward_scales, saved_input);
    detail::round_activations({dinp_TI});
    return;
  }
  if (const auto type = native_lowp_type(op, weight_OI)) {
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

}  // namespace

// 16-bit activations (staging.h): the input, the output and the input gradient are staged in fp32, so the fp32, the
// native 16-bit and the quantized GEMMs see exactly the values of the fp32-storage path.
void linear_forward(Tensor& out_TO, const Tensor& inp_TI, const Tensor& weight_OI, const Tensor* bias_O,
                    quant::DelayedLinearScaling* delayed, quant::DelayedForwardScales* forward_scales,
                    quant::PackedQuantizedTensor* saved_input) {
  if (saved_input != nullptr) *saved_input = quant::PackedQuantizedTensor();
  if (weight_OI.defined() && is_low(weight_OI.dtype())) {
    linear_forward_f32(out_TO, inp_TI, weight_OI, bias_O, delayed, forward_scales, nullptr);
    return;
  }
  detail::Staging staging;
  // The native 16-bit GEMMs read a 16-bit input's bits as they are; the others read it staged in fp32.
  const bool native = quantization_for(weight_OI) == nullptr && native_lowp_type("linear_forward", weight_OI) &&
                      (inp_TI.dtype() == DType::kF32 || inp_TI.dtype() == activation_dtype(inp_TI.device()));
  linear_forward_f32(staging.write_only(out_TO, {&inp_TI}), native ? inp_TI : staging.in(inp_TI), weight_OI, bias_O,
                     delayed, forward_scales, saved_input);
}

void linear_backward(Tensor* dinp_TI, Tensor* dweight_OI, Tensor* dbias_O, const Tensor& dout_TO, const Tensor* inp_TI,
                     const Tensor& weight_OI, quant::DelayedLinearScaling* delayed,
                     const quant::DelayedForwardScales* forward_scales,
                     const quant::PackedQuantizedTensor* saved_input) {
  if (saved_input != nullptr && !saved_input->defined()) saved_input = nullptr;
  if (weight_OI.defined() && is_low(weight_OI.dtype())) {
    linear_backward_f32(dinp_TI, dweight_OI, dbias_O, dout_TO, inp_TI, weight_OI, delayed, forward_scales, saved_input);
    return;
  }
  detail::Staging staging;
  const auto raw = [](const Tensor* t) {  // a tensor the native GEMMs read as it is
    return t == nullptr || t->dtype() == DType::kF32 || t->dtype() == activation_dtype(t->device());
  };
  const bool native = quantization_for(weight_OI) == nullptr && native_lowp_type("linear_backward", weight_OI) &&
                      raw(&dout_TO) && raw(inp_TI);
  linear_backward_f32(staging.out(dinp_TI), dweight_OI, dbias_O, native ? dout_TO : staging.in(dout_TO),
                      native ? inp_TI : staging.in(inp_TI), weight_OI, delayed, forward_scales, saved_input);
}

std::string gemm_library(const Device device) {
  std::string name;
  detail::with_kernels("gemm_library", device, [&](auto k) { name = k.gemm_library(); });
  return name;
}

bool gemm_lowp_native(const DType dtype, const Device device) {
  const kernels::LowpType type = lowp_type("gemm_lowp_native", dtype);
  bool native = false;
  detail::with_kernels("gemm_lowp_native", device, [&](auto k) { native = k.lowp_gemm_native(type); });
  return native;
}

std::string gemm_lowp_library(const DType dtype, const Device device) {
  const kernels::LowpType type = lowp_type("gemm_lowp_library", dtype);
  std::string name;
  detail::with_kernels("gemm_lowp_library", device, [&](auto k) { name = k.gemm_lowp_library(type); });
  return name;
}

}  // namespace moecore::ops
