#include "moecore/ops/init.h"

#include <string>

#include "moecore/ops/dispatch.h"

namespace moecore::ops {
using detail::ptr;

void normal_fill(Tensor& out, const std::span<const int64_t> first_R, const int64_t run, const uint64_t seed,
                 const uint64_t key, const double sigma) {
  constexpr const char* op = "normal_fill";
  detail::check_tensors(op, {&out});
  if (run < 0) detail::fail(op, "negative run length " + std::to_string(run));
  const auto R = static_cast<int64_t>(first_R.size());
  detail::check_numel(op, "out", out, R * run);
  for (const int64_t first : first_R) {
    if (first < 0) detail::fail(op, "negative element index " + std::to_string(first));
  }
  detail::dispatch(op, out,
                   [&]<typename S>(auto k) { k.normal_fill(ptr<S>(out), first_R.data(), R, run, seed, key, sigma); });
}

}  // namespace moecore::ops
