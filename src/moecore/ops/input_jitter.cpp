#include "moecore/ops/input_jitter.h"

#include <string>

#include "moecore/ops/dispatch.h"
#include "moecore/ops/precision.h"

namespace moecore::ops {
using detail::ptr;

namespace {

void check_runs(const char* op, const Tensor& t, const char* name, const std::span<const int64_t> first_R,
                const int64_t run, const InputJitterSpec& spec) {
  if (run < 0) detail::fail(op, "negative run length " + std::to_string(run));
  if (!(spec.eps >= 0.0)) detail::fail(op, "eps " + std::to_string(spec.eps) + " is negative");
  detail::check_numel(op, name, t, static_cast<int64_t>(first_R.size()) * run);
  for (const int64_t first : first_R) {
    if (first < 0) detail::fail(op, "negative counter " + std::to_string(first));
  }
}

}  // namespace

void input_jitter_forward(Tensor& out, const Tensor& inp, const std::span<const int64_t> first_R, const int64_t run,
                          const InputJitterSpec& spec) {
  constexpr const char* op = "input_jitter_forward";
  const detail::Staging staging;
  detail::check_tensors(op, {&out, &inp});
  check_runs(op, inp, "inp", first_R, run, spec);
  detail::check_numel(op, "out", out, inp.numel());
  const auto R = static_cast<int64_t>(first_R.size());
  detail::dispatch(op, inp, [&]<typename T>(auto k) {
    k.input_jitter_forward(ptr<T>(out), ptr<T>(inp), first_R.data(), R, run, spec);
  });
  detail::round_activations({&out});
}

void input_jitter_backward(Tensor& dinp, const Tensor& dout, const std::span<const int64_t> first_R, const int64_t run,
                           const InputJitterSpec& spec) {
  constexpr const char* op = "input_jitter_backward";
  const detail::Staging staging;
  detail::check_tensors(op, {&dinp, &dout});
  check_runs(op, dout, "dout", first_R, run, spec);
  detail::check_numel(op, "dinp", dinp, dout.numel());
  const auto R = static_cast<int64_t>(first_R.size());
  detail::dispatch(op, dout, [&]<typename T>(auto k) {
    k.input_jitter_backward(ptr<T>(dinp), ptr<T>(dout), first_R.data(), R, run, spec);
  });
  detail::round_activations({&dinp});
}

}  // namespace moecore::ops
