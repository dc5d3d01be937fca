#include "moecore/ops/grouped_linear.h"

#include <string>
#include <vector>

#include "moecore/kernels/cpu/gemm_lowp.h"
#include "moecore/ops/dispatch.h"
#include "moecore/ops/linear.h"
#include "moecore/ops/precision.h"
#include "moecore/ops/quantization.h"

namespace moecore::ops {
using detail::ptr;
namespace {

struct Shape {
  int64_t E = 0, I = 0, O = 0, R = 0;
};

// Checks the weights (defined, [O, I] each, one dtype with `like`), the offsets and the optional per-expert spans.
Shape check_group(const char* op, const Tensor& like, std::span<const Tensor* const> weights_E,
                  std::span<const int64_t> offsets_E1) {
  Shape s;
  s.E = static_cast<int64_t>(weights_E.size());
  if (s.E == 0) detail::fail(op, "no experts");
  if (static_cast<int64_t>(offsets_E1.size()) != s.E + 1 || offsets_E1[0] != 0) {
    detail::fail(op, std::to_string(offsets_E1.size()) + " row offsets for " + std::to_string(s.E) +
                         " experts (expected E + 1 from 0)");
  }
  for (size_t e = 0; e + 1 < offsets_E1.size(); ++e) {
    if (offsets_E1[e + 1] < offsets_E1[e]) detail::fail(op, "row offsets decrease at expert " + std::to_string(e));
  }
  s.R = offsets_E1.back();
  for (int64_t e = 0; e < s.E; ++e) {
    const Tensor* w = weights_E[static_cast<size_t>(e)];
    if (w == nullptr) detail::fail(op, "weight of expert " + std::to_string(e) + " is null");
    detail::check_tensors(op, {&like, w});
    if (w->ndim() != 2) detail::fail(op, "weight of expert " + std::to_string(e) + " is " + w->shape_str());
    if (e == 0) {
      s.O = w->dim(0);
      s.I = w->dim(1);
    } else if (w->dim(0) != s.O || w->dim(1) != s.I) {
      detail::fail(op, "weight of expert " + std::to_string(e) + " is " + w->shape_str() + ", expert 0's [" +
                           std::to_string(s.O) + ", " + std::to_string(s.I) + "]");
    }
  }
  return s;
}

template <typename Span>
void check_per_expert(const char* op, const char* name, const Tensor& like, const Span& tensors_E, const Shape& s,
                      const int64_t numel) {
  if (!tensors_E.empty() && static_cast<int64_t>(tensors_E.size()) != s.E) {
    detail::fail(op, std::string(name) + " has " + std::to_string(tensors_E.size()) + " entries for " +
                         std::to_string(s.E) + " experts");
  }
  for (const Tensor* t : tensors_E) {
    if (t == nullptr) continue;
    detail::check_tensors(op, {&like, t});
    detail::check_numel(op, name, *t, numel);
  }
}

// The grouped kernels cover fp32 / fp64 GEMMs; FP8 / FP4 and the native 16-bit path go through ops::linear.
bool per_expert_path(const Tensor& like) {
  if (like.dtype() != DType::kF32) return false;
  if (linear_quantization(like.device()) != nullptr) return true;
  const DType act = activation_dtype(like.device());
  if (act != DType::kBF16 && act != DType::kF16) return false;
  const auto type = act == DType::kBF16 ? kernels::LowpType::kBF16 : kernels::LowpType::kF16;
  bool native = false;
  detail::with_kernels("grouped_linear", like.device(), [&](auto k) { native = k.lowp_gemm_native(type); });
  return native;
}

template <typename S>
std::vector<const S*> data_of(std::span<const Tensor* const> tensors_E, const int64_t E) {
  std::vector<const S*> out(static_cast<size_t>(E), nullptr);
  for (size_t e = 0; e < tensors_E.size(); ++e) out[e] = tensors_E[e] ? tensors_E[e]->data<S>() : nullptr;
  return out;
}
template <typename S>
std::vector<S*> data_of(std::span<Tensor* const> tensors_E, const int64_t E) {
  std::vector<S*> out(static_cast<size_t>(E), nullptr);
  for (size_t e = 0; e < tensors_E.size(); ++e) out[e] = tensors_E[e] ? tensors_E[e]->data<S>() : nullptr;
  return out;
}

}  // namespace

void grouped_linear_forward(Tensor& out_RO, const Tensor& x_RI, std::span<const Tensor* const> weights_E,
                            std::span<const Tensor* const> biases_E, std::span<const int64_t> offsets_E1) {
  constexpr const char* op = "grouped_linear_forward";
  detail::check_tensors(op, {&out_RO, &x_RI});
  const Shape s = check_group(op, out_RO, weights_E, offsets_E1);
  check_per_expert(op, "biases_E", out_RO, biases_E, s, s.O);
  detail::check_numel(op, "x_RI", x_RI, s.R * s.I);
  detail::check_numel(op, "out_RO", out_RO, s.R * s.O);
  if (per_expert_path(out_RO)) {
    for (int64_t e = 0; e < s.E; ++e) {
      const int64_t begin = offsets_E1[e], end = offsets_E1[e + 1];
      if (end == begin) continue;
      Tensor out = out_RO.view({s.R, s.O}).slice_rows(begin, end);
      linear_forward(out, x_RI.view({s.R, s.I}).slice_rows(begin, end), *weights_E[e],
                     biases_E.empty() ? nullptr : biases_E[e]);
    }
    return;
  }
  detail::dispatch(op, out_RO, [&]<typename S>(auto k) {
    const std::vector<const S*> w = data_of<S>(weights_E, s.E), b = data_of<S>(biases_E, s.E);
    k.grouped_linear_forward(ptr<S>(out_RO), ptr<S>(x_RI), w.data(), biases_E.empty() ? nullptr : b.data(),
                             offsets_E1.data(), s.E, s.I, s.O);
  });
  detail::round_activations({&out_RO});
}

void grouped_linear_backward(Tensor* dx_RI, std::span<Tensor* const> dweights_E, std::span<Tensor* const> dbiases_E,
                             const Tensor& dout_RO, const Tensor* x_RI, std::span<const Tensor* const> weights_E,
                             std::span<const int64_t> offsets_E1) {
  constexpr const char* op = "grouped_linear_backward";
  detail::check_tensors(op, {&dout_RO, dx_RI, x_RI});
  const Shape s = check_group(op, dout_RO, weights_E, offsets_E1);
  check_per_expert(op, "dweights_E", dout_RO, dweights_E, s, s.O * s.I);
  check_per_expert(op, "dbiases_E", dout_RO, dbiases_E, s, s.O);
  detail::check_numel(op, "dout_RO", dout_RO, s.R * s.O);
  if (dx_RI != nullptr) detail::check_numel(op, "dx_RI", *dx_RI, s.R * s.I);
  bool weight_grads = false;
  for (const Tensor* t : dweights_E) weight_grads = weight_grads || t != nullptr;
  if (weight_grads && x_RI == nullptr) detail::fail(op, "dweights_E needs x_RI");
  if (x_RI != nullptr) detail::check_numel(op, "x_RI", *x_RI, s.R * s.I);
  if (per_expert_path(dout_RO)) {
    for (int64_t e = 0; e < s.E; ++e) {
      const int64_t begin = offsets_E1[e], end = offsets_E1[e + 1];
      if (end == begin) continue;
      Tensor dx = dx_RI ? dx_RI->view({s.R, s.I}).slice_rows(begin, end) : Tensor();
      const Tensor x = x_RI ? x_RI->view({s.R, s.I}).slice_rows(begin, end) : Tensor();
      linear_backward(dx_RI ? &dx : nullptr, dweights_E.empty() ? nullptr : dweights_E[e],
                      dbiases_E.empty() ? nullptr : dbiases_E[e], dout_RO.view({s.R, s.O}).slice_rows(begin, end),
                      x_RI ? &x : nullptr, *weights_E[e]);
    }
    return;
  }
  detail::dispatch(op, dout_RO, [&]<typename S>(auto k) {
    const std::vector<const S*> w = data_of<S>(weights_E, s.E);
    const std::vector<S*> dw = data_of<S>(dweights_E, s.E), db = data_of<S>(dbiases_E, s.E);
    k.grouped_linear_backward(dx_RI ? dx_RI->data<S>() : nullptr, dweights_E.empty() ? nullptr : dw.data(),
                              dbiases_E.empty() ? nullptr : db.data(), ptr<S>(dout_RO),
                              x_RI ? x_RI->data<S>() : nullptr, w.data(), offsets_E1.data(), s.E, s.I, s.O);
  });
  detail::round_activations({dx_RI});
}

}  // namespace moecore::ops
