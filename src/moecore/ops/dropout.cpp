#include "moecore/ops/dropout.h"

#include "moecore/ops/dispatch.h"
#include "moecore/ops/precision.h"

namespace moecore::ops {
using detail::ptr;

void dropout_forward(Tensor& out, const Tensor& inp, const DropoutSpec& spec) {
  constexpr const char* op = "dropout_forward";
  detail::Staging staging;
  staging.write_only(out, {&inp});
  detail::check_tensors(op, {&out, &inp});
  detail::check_numel(op, "out", out, inp.numel());
  detail::dispatch(op, inp,
                   [&]<typename T>(auto k) { k.dropout_forward(ptr<T>(out), ptr<T>(inp), inp.numel(), spec); });
  detail::round_activations({&out});
}

void dropout_backward(Tensor& dinp, const Tensor& dout, const DropoutSpec& spec) {
  constexpr const char* op = "dropout_backward";
  const detail::Staging staging;
  detail::check_tensors(op, {&dinp, &dout});
  detail::check_numel(op, "dinp", dinp, dout.numel());
  detail::dispatch(op, dout,
                   [&]<typename T>(auto k) { k.dropout_backward(ptr<T>(dinp), ptr<T>(dout), dout.numel(), spec); });
  detail::round_activations({&dinp});
}

}  // namespace moecore::ops
