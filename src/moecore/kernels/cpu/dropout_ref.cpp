// Naive reference dropout, used by the tests.
#include <stdexcept>

#include "moecore/kernels/cpu/dropout.h"
#include "moecore/tensor/rng.h"

namespace moecore::kernels::ref {

template <typename T>
void dropout_forward(T* out, const T* inp, const int64_t n, const DropoutSpec& spec) {
  if (!(spec.p >= 0.0f && spec.p <= 1.0f)) throw std::invalid_argument("dropout: p not in [0, 1]");
  const CounterRng rng(spec.seed, spec.key);
  for (int64_t i = 0; i < n; ++i) {
    const bool dropped = spec.p > 0.0f && rng.uniform(spec.offset + static_cast<uint64_t>(i)) < spec.p;
    out[i] = dropped ? T(0) : inp[i] / (T(1) - static_cast<T>(spec.p));
  }
}

template <typename T>
void dropout_backward(T* dinp, const T* dout, const int64_t n, const DropoutSpec& spec) {
  if (!(spec.p >= 0.0f && spec.p <= 1.0f)) throw std::invalid_argument("dropout: p not in [0, 1]");
  const CounterRng rng(spec.seed, spec.key);
  for (int64_t i = 0; i < n; ++i) {
    const bool dropped = spec.p > 0.0f && rng.uniform(spec.offset + static_cast<uint64_t>(i)) < spec.p;
    if (!dropped) dinp[i] += dout[i] / (T(1) - static_cast<T>(spec.p));
  }
}

template void dropout_forward<float>(float*, const float*, int64_t, const DropoutSpec&);
template void dropout_forward<double>(double*, const double*, int64_t, const DropoutSpec&);
template void dropout_backward<float>(float*, const float*, int64_t, const DropoutSpec&);
template void dropout_backward<double>(double*, const double*, int64_t, const DropoutSpec&);

}  // namespace moecore::kernels::ref
