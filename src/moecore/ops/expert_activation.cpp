#include "moecore/ops/expert_activation.h"

#include "moecore/ops/dispatch.h"
#include "moecore/ops/precision.h"

namespace moecore::ops {
using detail::ptr;

namespace {

// [T, F] from h (or dh): F its last dimension.
void sizes(const Tensor& h_TF, int64_t& T, int64_t& F) {
  const int64_t n = h_TF.numel();
  F = h_TF.ndim() > 0 ? h_TF.dim(-1) : n;
  T = F == 0 ? 0 : n / F;
}

}  // namespace

void weighted_swiglu_forward(Tensor& h_TF, const Tensor& inp_T2F, const Tensor& probs_T) {
  constexpr const char* op = "weighted_swiglu_forward";
  const detail::Staging staging;
  detail::check_tensors(op, {&h_TF, &inp_T2F, &probs_T});
  int64_t T = 0, F = 0;
  sizes(h_TF, T, F);
  detail::check_numel(op, "inp_T2F", inp_T2F, 2 * T * F);
  detail::check_numel(op, "probs_T", probs_T, T);
  detail::dispatch(op, h_TF, [&]<typename S>(auto k) {
    k.weighted_swiglu_forward(ptr<S>(h_TF), ptr<S>(inp_T2F), ptr<S>(probs_T), T, F);
  });
  detail::round_activations({&h_TF});
}

void weighted_swiglu_backward(Tensor& dinp_T2F, Tensor& dprobs_T, const Tensor& dh_TF, const Tensor& inp_T2F,
                              const Tensor& probs_T) {
  constexpr const char* op = "weighted_swiglu_backward";
  const detail::Staging staging;
  detail::check_tensors(op, {&dinp_T2F, &dprobs_T, &dh_TF, &inp_T2F, &probs_T});
  int64_t T = 0, F = 0;
  sizes(dh_TF, T, F);
  detail::check_numel(op, "inp_T2F", inp_T2F, 2 * T * F);
  detail::check_numel(op, "dinp_T2F", dinp_T2F, 2 * T * F);
  detail::check_numel(op, "probs_T", probs_T, T);
  detail::check_numel(op, "dprobs_T", dprobs_T, T);
  detail::dispatch(op, dh_TF, [&]<typename S>(auto k) {
    k.weighted_swiglu_backward(ptr<S>(dinp_T2F), ptr<S>(dprobs_T), ptr<S>(dh_TF), ptr<S>(inp_T2F), ptr<S>(probs_T), T,
                               F);
  });
  detail::round_activations({&dinp_T2F});
}

}  // namespace moecore::ops
