#include "moecore/ops/grouped_mlp.h"

#include <algorithm>
#include <initializer_list>
#include <optional>
#include <string>
#include <vector>

#include "moecore/kernels/cpu/gemm_lowp.h"
#include "moecore/ops/dispatch.h"
#include "moecore/ops/precision.h"
#include "moecore/ops/quantization.h"
#include "moecore/ops/weight_casts.h"

namespace moecore::ops {
using detail::ptr;
namespace {

std::string expert(const char* what, const int64_t e) { return std::string(what) + " of expert " + std::to_string(e); }

// Checks the per-expert parameters (defined, one dtype and device with `like`, one shape for all experts) and the
// offsets; returns the kernels' shape.
kernels::GroupedMlpShape check_params(const char* op, const Tensor& like, const GroupedMlpParams& p,
                                      const std::span<const int64_t> offsets_E1, const GroupedMlpSpec& spec) {
  kernels::GroupedMlpShape s{};
  s.E = static_cast<int64_t>(p.fc1_weight_E.size());
  if (s.E == 0) detail::fail(op, "no experts");
  if (static_cast<int64_t>(p.fc2_weight_E.size()) != s.E) {
    detail::fail(op, std::to_string(p.fc2_weight_E.size()) + " fc2 weights for " + std::to_string(s.E) + " experts");
  }
  if (static_cast<int64_t>(offsets_E1.size()) != s.E + 1 || offsets_E1[0] != 0) {
    detail::fail(op, std::to_string(offsets_E1.size()) + " row offsets for " + std::to_string(s.E) +
                         " experts (expected E + 1 from 0)");
  }
  for (size_t e = 0; e + 1 < offsets_E1.size(); ++e) {
    if (offsets_E1[e + 1] < offsets_E1[e]) detail::fail(op, "row offsets decrease at expert " + std::to_string(e));
  }
  s.offsets_E1 = offsets_E1.data();
  const Tensor* w1 = p.fc1_weight_E[0];
  const Tensor* w2 = p.fc2_weight_E[0];
  if (w1 == nullptr || w2 == nullptr || w1->ndim() != 2 || w2->ndim() != 2) {
    detail::fail(op, "expert 0 needs 2-d fc1 and fc2 weights");
  }
  s.H = w1->dim(1);
  s.F = w2->dim(1);
  const int64_t F1 = activation_input_width(spec.activation, s.F);
  for (int64_t e = 0; e < s.E; ++e) {
    const auto i = static_cast<size_t>(e);
    for (const auto& [name, t, rows, cols] : {std::tuple{"fc1 weight", p.fc1_weight_E[i], F1, s.H},
                                              std::tuple{"fc2 weight", p.fc2_weight_E[i], s.H, s.F}}) {
      if (t == nullptr) detail::fail(op, expert(name, e) + " is null");
      detail::check_tensors(op, {&like, t});
      if (t->ndim() != 2 || t->dim(0) != rows || t->dim(1) != cols) {
        detail::fail(op, expert(name, e) + " is " + t->shape_str() + ", expected [" + std::to_string(rows) + ", " +
                             std::to_string(cols) + "]");
      }
    }
  }
  for (const auto& [name, biases, n] :
       {std::tuple{"fc1 bias", p.fc1_bias_E, F1}, std::tuple{"fc2 bias", p.fc2_bias_E, s.H}}) {
    if (!biases.empty() && static_cast<int64_t>(biases.size()) != s.E) {
      detail::fail(
          op, std::string(name) + "es: " + std::to_string(biases.size()) + " for " + std::to_string(s.E) + " experts");
    }
    for (const Tensor* b : biases) {
      if (b == nullptr) continue;
      detail::check_tensors(op, {&like, b});
      detail::check_numel(op, name, *b, n);
    }
  }
  switch (spec.activation) {
    case Activation::kGelu: s.activation = kernels::MlpActivation::kGelu; break;
    case Activation::kSwiGLU: s.activation = kernels::MlpActivation::kSwiGLU; break;
    case Activation::kSquaredReLU: s.activation = kernels::MlpActivation::kSquaredReLU; break;
  }
  s.probs_on_input = spec.probs_on_input;
  s.rounding = kernels::ActivationRounding::kNone;
  if (like.dtype() == DType::kF32 || detail::is_16bit(like.dtype())) {
    if (!grouped_mlp_fused(like.device())) {
      detail::fail(op,
                   "FP8 / FP4 quantization is not fused: run the experts through ops::linear_forward / "
                   "linear_backward");
    }
    const DType act = activation_dtype(like.device());
    if (act == DType::kBF16) s.rounding = kernels::ActivationRounding::kBF16;
    if (act == DType::kF16) s.rounding = kernels::ActivationRounding::kF16;
    if (const std::optional<DType> native = detail::native_gemm_dtype(like.device())) {
      s.native_gemm = true;
      s.native_type = *native == DType::kBF16 ? kernels::LowpType::kBF16 : kernels::LowpType::kF16;
    }
  }
  return s;
}

// A saved activation the spec needs: present, of the case's dtype, `numel` elements.
void check_saved(const char* op, const char* name, const Tensor& like, const Tensor* t, const int64_t numel) {
  if (t == nullptr) detail::fail(op, std::string(name) + " is needed and null");
  detail::check_tensors(op, {&like, t});
  detail::check_numel(op, name, *t, numel);
}

template <typename S, typename Span>
std::vector<S*> data_of(const Span& tensors_E, const int64_t E) {
  std::vector<S*> out(static_cast<size_t>(E), nullptr);
  for (size_t e = 0; e < tensors_E.size(); ++e) out[e] = tensors_E[e] ? tensors_E[e]->template data<S>() : nullptr;
  return out;
}

template <typename S>
struct Pointers {  // keeps the per-expert pointer arrays alive for the kernel call
  std::vector<const S*> w1, b1, w2, b2;
  std::vector<Tensor> casts;  // the step's kept 16-bit casts (weight_casts.h) of w1 and w2, when every one is kept
  std::vector<const uint16_t*> w1_16, w2_16;
  kernels::GroupedMlpWeights<S> weights() const {
    return {w1.data(),
            b1.empty() ? nullptr : b1.data(),
            w2.data(),
            b2.empty() ? nullptr : b2.data(),
            w1_16.empty() ? nullptr : w1_16.data(),
            w2_16.empty() ? nullptr : w2_16.data()};
  }
};
template <typename S>
Pointers<S> pointers(const GroupedMlpParams& p, const int64_t E) {
  Pointers<S> out;
  out.w1 = data_of<const S>(p.fc1_weight_E, E);
  out.w2 = data_of<const S>(p.fc2_weight_E, E);
  if (!p.fc1_bias_E.empty()) out.b1 = data_of<const S>(p.fc1_bias_E, E);
  if (!p.fc2_bias_E.empty()) out.b2 = data_of<const S>(p.fc2_bias_E, E);
  return out;
}

// The native GEMMs' 16-bit weights from the step's kept casts, where a scope keeps them for every expert.
void add_kept_casts(Pointers<float>& w, const GroupedMlpParams& p, const kernels::GroupedMlpShape& s) {
  if (!s.native_gemm || !weight_casts_live()) return;
  const DType dtype = s.native_type == kernels::LowpType::kBF16 ? DType::kBF16 : DType::kF16;
  std::vector<const uint16_t*> w1_16, w2_16;
  for (int64_t e = 0; e < s.E; ++e) {
    const Tensor* fc1 = p.fc1_weight_E[static_cast<size_t>(e)];
    const Tensor* fc2 = p.fc2_weight_E[static_cast<size_t>(e)];
    if (fc1 == nullptr || fc2 == nullptr) return;
    Tensor cast1 = cached_weight_cast(*fc1, dtype), cast2 = cached_weight_cast(*fc2, dtype);
    if (!cast1.defined() || !cast2.defined()) return;
    w1_16.push_back(cast1.data<uint16_t>());
    w2_16.push_back(cast2.data<uint16_t>());
    w.casts.push_back(std::move(cast1));
    w.casts.push_back(std::move(cast2));
  }
  w.w1_16 = std::move(w1_16);
  w.w2_16 = std::move(w2_16);
}

template <typename S>
const S* opt_data(const Tensor* t) {
  return t == nullptr ? nullptr : ptr<S>(*t);
}

// The 16-bit kernels apply (grouped_mlp.h): on the CPU, every activation tensor (null entries skipped) bf16, or every
// one fp16, and `fp32` tensors fp32 (probabilities, dprobs); returns the activations' format.
std::optional<kernels::LowpType> activations16(std::initializer_list<const Tensor*> activations,
                                               std::initializer_list<const Tensor*> fp32) {
  const Tensor& first = **activations.begin();
  if (first.device() != Device::kCPU || !detail::is_16bit(first.dtype())) return std::nullopt;
  for (const Tensor* t : activations) {
    if (t != nullptr && t->dtype() != first.dtype()) return std::nullopt;
  }
  for (const Tensor* t : fp32) {
    if (t != nullptr && t->dtype() != DType::kF32) return std::nullopt;
  }
  return first.dtype() == DType::kBF16 ? kernels::LowpType::kBF16 : kernels::LowpType::kF16;
}

// The activations' format is the one the kernels round to.
bool rounds_to(const std::optional<kernels::LowpType> type, const kernels::ActivationRounding rounding) {
  return type && rounding == (*type == kernels::LowpType::kBF16 ? kernels::ActivationRounding::kBF16
                                                                : kernels::ActivationRounding::kF16);
}

// Every tensor of the spans (null entries skipped) fp32.
template <typename... Spans>
bool all_fp32(const Spans&... spans) {
  const auto fp32 = [](const auto& span) {
    return std::all_of(span.begin(), span.end(),
                       [](const Tensor* t) { return t == nullptr || t->dtype() == DType::kF32; });
  };
  return (fp32(spans) && ...);
}

// d(fc1 output) of every row, as the backward allocates it: the row-local pass writes it, the weight-gradient pass
// reads it (fp32 where the tensors are 16-bit: the kernels' fp32 steps read it as it is).
DType workspace_dtype(const Tensor& dy_RH) { return detail::is_16bit(dy_RH.dtype()) ? DType::kF32 : dy_RH.dtype(); }
Tensor workspace(const Tensor& dy_RH, const int64_t R, const int64_t F1) {
  return Tensor({R, F1}, workspace_dtype(dy_RH), MemCategory::kActivations, dy_RH.device());
}

template <typename S>
S* bits_of(Tensor* t) {
  return t == nullptr ? nullptr : t->data<S>();
}
template <typename S>
const S* bits_of(const Tensor* t) {
  return t == nullptr ? nullptr : t->data<S>();
}

}  // namespace

bool grouped_mlp_fused(const Device device) { return linear_quantization(device) == nullptr; }

Tensor grouped_mlp_backward_workspace(const Tensor& dy_RH, const GroupedMlpParams& params,
                                      const std::span<const int64_t> offsets_E1, const GroupedMlpSpec& spec) {
  constexpr const char* op = "grouped_mlp_backward_workspace";
  detail::check_tensors(op, {&dy_RH});
  const kernels::GroupedMlpShape s = check_params(op, dy_RH, params, offsets_E1, spec);
  return workspace(dy_RH, offsets_E1.back(), s.F1());
}

void grouped_mlp_forward(Tensor& y_RH, Tensor& fc1_RF1, Tensor* act_RF, Tensor* h_RF, Tensor* xs_RH, const Tensor& x_RH,
                         const Tensor& probs_R, const GroupedMlpParams& params,
                         const std::span<const int64_t> offsets_E1, const GroupedMlpSpec& spec) {
  constexpr const char* op = "grouped_mlp_forward";
  detail::Staging staging;
  detail::check_tensors(op, {&y_RH, &fc1_RF1, &x_RH, &probs_R});
  const kernels::GroupedMlpShape s = check_params(op, y_RH, params, offsets_E1, spec);
  const int64_t R = offsets_E1.back();
  detail::check_numel(op, "x_RH", x_RH, R * s.H);
  detail::check_numel(op, "probs_R", probs_R, R);
  detail::check_numel(op, "y_RH", y_RH, R * s.H);
  detail::check_numel(op, "fc1_RF1", fc1_RF1, R * s.F1());
  if (s.weighted_swiglu()) {
    check_saved(op, "h_RF", y_RH, h_RF, R * s.F);
  } else {
    check_saved(op, "act_RF", y_RH, act_RF, R * s.F);
  }
  if (s.probs_on_input) check_saved(op, "xs_RH", y_RH, xs_RH, R * s.H);
  Tensor* saved_RF = s.weighted_swiglu() ? h_RF : act_RF;
  Tensor* xs = s.probs_on_input ? xs_RH : nullptr;
  const bool fp32_params = all_fp32(params.fc1_weight_E, params.fc1_bias_E, params.fc2_weight_E, params.fc2_bias_E);
  if (const auto type = activations16({&y_RH, &fc1_RF1, saved_RF, xs, &x_RH}, {&probs_R});
      rounds_to(type, s.rounding) && fp32_params) {
    Pointers<float> w = pointers<float>(params, s.E);
    add_kept_casts(w, params, s);
    kernels::cpu::grouped_mlp_forward16(*type, y_RH.data<uint16_t>(), fc1_RF1.data<uint16_t>(),
                                        s.weighted_swiglu() ? nullptr : act_RF->data<uint16_t>(),
                                        s.weighted_swiglu() ? h_RF->data<uint16_t>() : nullptr, bits_of<uint16_t>(xs),
                                        x_RH.data<uint16_t>(), probs_R.data<float>(), w.weights(), s);
    return;
  }
  // Every output is overwritten: 16-bit ones are not widened first.
  for (Tensor* out : {&y_RH, &fc1_RF1, s.weighted_swiglu() ? h_RF : act_RF, s.probs_on_input ? xs_RH : nullptr}) {
    if (out != nullptr) staging.write_only(*out, {&x_RH, &probs_R});
  }
  detail::dispatch(op, y_RH, [&]<typename S>(auto k) {
    const Pointers<S> w = pointers<S>(params, s.E);
    k.grouped_mlp_forward(ptr<S>(y_RH), ptr<S>(fc1_RF1), s.weighted_swiglu() ? nullptr : ptr<S>(*act_RF),
                          s.weighted_swiglu() ? ptr<S>(*h_RF) : nullptr, s.probs_on_input ? ptr<S>(*xs_RH) : nullptr,
                          ptr<S>(x_RH), ptr<S>(probs_R), w.weights(), s);
  });
}

void grouped_mlp_backward(Tensor& dx_RH, Tensor& dprobs_R, const GroupedMlpGrads& grads, const Tensor& dy_RH,
                          const Tensor& x_RH, const Tensor* xs_RH, const Tensor& fc1_RF1, const Tensor* act_RF,
                          const Tensor* h_RF, const Tensor& probs_R, const GroupedMlpParams& params,
                          const std::span<const int64_t> offsets_E1, const GroupedMlpSpec& spec,
                          const GroupedMlpBackwardSplit* split) {
  constexpr const char* op = "grouped_mlp_backward";
  detail::Staging staging;
  const GroupedMlpBackwardPart part = split != nullptr ? split->part : GroupedMlpBackwardPart::kAll;
  const bool data = part != GroupedMlpBackwardPart::kWeights, weights = part != GroupedMlpBackwardPart::kData;
  if (data) {
    detail::check_tensors(op, {&dx_RH, &dprobs_R, &dy_RH, &x_RH, &fc1_RF1, &probs_R});
  } else {  // dx_RH and dprobs_R unused
    detail::check_tensors(op, {&dy_RH, &x_RH, &fc1_RF1, &probs_R});
  }
  kernels::GroupedMlpShape s = check_params(op, dy_RH, params, offsets_E1, spec);
  s.part = part;
  const int64_t R = offsets_E1.back();
  detail::check_numel(op, "dy_RH", dy_RH, R * s.H);
  if (data) detail::check_numel(op, "dx_RH", dx_RH, R * s.H);
  detail::check_numel(op, "x_RH", x_RH, R * s.H);
  detail::check_numel(op, "probs_R", probs_R, R);
  if (data) detail::check_numel(op, "dprobs_R", dprobs_R, R);
  detail::check_numel(op, "fc1_RF1", fc1_RF1, R * s.F1());
  if (s.weighted_swiglu()) {
    check_saved(op, "h_RF", dy_RH, h_RF, R * s.F);
  } else {
    check_saved(op, "act_RF", dy_RH, act_RF, R * s.F);
  }
  if (s.probs_on_input) check_saved(op, "xs_RH", dy_RH, xs_RH, R * s.H);
  Tensor* ws = split != nullptr ? split->dfc1_workspace_RF1 : nullptr;
  if (ws == nullptr && part != GroupedMlpBackwardPart::kAll) {
    detail::fail(op, "a kData / kWeights part needs dfc1_workspace_RF1 (grouped_mlp_backward_workspace)");
  }
  if (ws != nullptr) {
    if (ws->defined() && ws->dtype() != workspace_dtype(dy_RH)) {
      detail::fail(op, "dfc1_workspace_RF1 is " + std::string(dtype_name(ws->dtype())) + ", expected " +
                           std::string(dtype_name(workspace_dtype(dy_RH))));
    }
    detail::check_tensors(op, {&dy_RH, ws});
    detail::check_numel(op, "dfc1_workspace_RF1", *ws, R * s.F1());
  }
  const auto check_grads = [&](const char* name, const std::span<Tensor* const> grads_E, const int64_t numel) {
    if (!grads_E.empty() && static_cast<int64_t>(grads_E.size()) != s.E) {
      detail::fail(
          op, std::string(name) + ": " + std::to_string(grads_E.size()) + " for " + std::to_string(s.E) + " experts");
    }
    for (const Tensor* g : grads_E) {
      if (g == nullptr) continue;
      detail::check_tensors(op, {&dy_RH, g});
      detail::check_numel(op, name, *g, numel);
    }
  };
  check_grads("fc1 weight gradients", grads.fc1_weight_E, s.F1() * s.H);
  check_grads("fc1 bias gradients", grads.fc1_bias_E, s.F1());
  check_grads("fc2 weight gradients", grads.fc2_weight_E, s.H * s.F);
  check_grads("fc2 bias gradients", grads.fc2_bias_E, s.H);
  if (!grads.weights_zero_E.empty() && static_cast<int64_t>(grads.weights_zero_E.size()) != s.E) {
    detail::fail(op, "weights_zero_E: " + std::to_string(grads.weights_zero_E.size()) + " for " + std::to_string(s.E) +
                         " experts");
  }
  const uint8_t* weights_zero_E = weights && !grads.weights_zero_E.empty() ? grads.weights_zero_E.data() : nullptr;
  // What the part writes: kData no gradient, kWeights neither dx nor dprobs.
  const GroupedMlpGrads none{};
  const GroupedMlpGrads& written = weights ? grads : none;
  Tensor* dx = data ? &dx_RH : nullptr;
  Tensor* dprobs = data ? &dprobs_R : nullptr;
  const Tensor* saved_RF = s.weighted_swiglu() ? h_RF : act_RF;
  const Tensor* xs = s.probs_on_input ? xs_RH : nullptr;
  const auto type = activations16({&dy_RH, dx, &x_RH, &fc1_RF1, saved_RF, xs}, {&probs_R, dprobs});
  const bool fp32_params = all_fp32(params.fc1_weight_E, params.fc1_bias_E, params.fc2_weight_E, params.fc2_bias_E,
                                    written.fc1_weight_E, written.fc1_bias_E, written.fc2_weight_E, written.fc2_bias_E);
  Tensor own_workspace;
  if (ws == nullptr) {
    own_workspace = workspace(dy_RH, R, s.F1());
    ws = &own_workspace;
  }
  if (rounds_to(type, s.rounding) && fp32_params) {
    Pointers<float> w = pointers<float>(params, s.E);
    if (data) add_kept_casts(w, params, s);  // the weight gradients read no weight
    const std::vector<float*> dw1 = data_of<float>(written.fc1_weight_E, s.E),
                              db1 = data_of<float>(written.fc1_bias_E, s.E),
                              dw2 = data_of<float>(written.fc2_weight_E, s.E),
                              db2 = data_of<float>(written.fc2_bias_E, s.E);
    const kernels::GroupedMlpGrads<float> g{dw1.data(), db1.data(), dw2.data(), db2.data(), weights_zero_E};
    kernels::cpu::grouped_mlp_backward16(
        *type, bits_of<uint16_t>(dx), bits_of<float>(dprobs), g, ws->data<float>(), dy_RH.data<uint16_t>(),
        x_RH.data<uint16_t>(), bits_of<uint16_t>(xs), fc1_RF1.data<uint16_t>(),
        s.weighted_swiglu() ? nullptr : act_RF->data<uint16_t>(),
        s.weighted_swiglu() ? h_RF->data<uint16_t>() : nullptr, probs_R.data<float>(), w.weights(), s);
    return;
  }
  // dprobs_R is overwritten, dx_RH accumulates (staged in first); a kWeights call stages neither, so nothing it did
  // not compute is narrowed back.
  if (dprobs != nullptr) staging.write_only(*dprobs, {&dy_RH, &x_RH, &probs_R});
  detail::dispatch(op, dy_RH, [&]<typename S>(auto k) {
    const Pointers<S> w = pointers<S>(params, s.E);
    const std::vector<S*> dw1 = data_of<S>(written.fc1_weight_E, s.E), db1 = data_of<S>(written.fc1_bias_E, s.E),
                          dw2 = data_of<S>(written.fc2_weight_E, s.E), db2 = data_of<S>(written.fc2_bias_E, s.E);
    const kernels::GroupedMlpGrads<S> g{dw1.data(), db1.data(), dw2.data(), db2.data(), weights_zero_E};
    k.grouped_mlp_backward(detail::opt<S>(dx), detail::opt<S>(dprobs), g, ptr<S>(*ws), ptr<S>(dy_RH), ptr<S>(x_RH),
                           s.probs_on_input ? ptr<S>(*xs_RH) : nullptr, ptr<S>(fc1_RF1),
                           s.weighted_swiglu() ? nullptr : ptr<S>(*act_RF),
                           s.weighted_swiglu() ? ptr<S>(*h_RF) : nullptr, ptr<S>(probs_R), w.weights(), s);
  });
}

}  // namespace moecore::ops
