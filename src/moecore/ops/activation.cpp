#include "moecore/ops/activation.h"

#include "moecore/ops/dispatch.h"
#include "moecore/ops/precision.h"

namespace moecore::ops {
using detail::ptr;

void activation_forward(const Activation kind, Tensor& out_TF, const Tensor& inp_TF1) {
  constexpr const char* op = "activation_forward";
  detail::Staging staging;
  staging.write_only(out_TF, {&inp_TF1});
  detail::check_tensors(op, {&out_TF, &inp_TF1});
  const int64_t n = out_TF.numel();
  detail::check_numel(op, "inp_TF1", inp_TF1, kind == Activation::kSwiGLU ? 2 * n : n);
  const int64_t F = out_TF.ndim() > 0 ? out_TF.dim(-1) : n, T = F == 0 ? 0 : n / F;
  detail::dispatch(op, out_TF, [&]<typename S>(auto k) {
    switch (kind) {
      case Activation::kSwiGLU: k.swiglu_forward(ptr<S>(out_TF), ptr<S>(inp_TF1), T, F); break;
      case Activation::kGelu: k.gelu_forward(ptr<S>(out_TF), ptr<S>(inp_TF1), n); break;
      case Activation::kSquaredReLU: k.squared_relu_forward(ptr<S>(out_TF), ptr<S>(inp_TF1), n); break;
    }
  });
  detail::round_activations({&out_TF});
}

void activation_backward(const Activation kind, Tensor& dinp_TF1, const Tensor& dout_TF, const Tensor& inp_TF1) {
  constexpr const char* op = "activation_backward";
  const detail::Staging staging;
  detail::check_tensors(op, {&dinp_TF1, &dout_TF, &inp_TF1});
  const int64_t n = dout_TF.numel();
  detail::check_numel(op, "inp_TF1", inp_TF1, kind == Activation::kSwiGLU ? 2 * n : n);
  detail::check_numel(op, "dinp_TF1", dinp_TF1, inp_TF1.numel());
  const int64_t F = dout_TF.ndim() > 0 ? dout_TF.dim(-1) : n, T = F == 0 ? 0 : n / F;
  detail::dispatch(op, dout_TF, [&]<typename S>(auto k) {
    switch (kind) {
      case Activation::kSwiGLU: k.swiglu_backward(ptr<S>(dinp_TF1), ptr<S>(dout_TF), ptr<S>(inp_TF1), T, F); break;
      case Activation::kGelu: k.gelu_backward(ptr<S>(dinp_TF1), ptr<S>(dout_TF), ptr<S>(inp_TF1), n); break;
      case Activation::kSquaredReLU:
        k.squared_relu_backward(ptr<S>(dinp_TF1), ptr<S>(dout_TF), ptr<S>(inp_TF1), n);
        break;
    }
  });
  detail::round_activations({&dinp_TF1});
}

}  // namespace moecore::ops
