// Naive reference input jitter: run by run, the factor from its definition.
#include "moecore/kernels/cpu/input_jitter.h"
#include "moecore/tensor/rng.h"

namespace moecore::kernels::ref {
namespace {

float jitter_factor(const CounterRng& rng, const int64_t counter, const double eps) {
  const float low = static_cast<float>(1.0 - eps), high = static_cast<float>(1.0 + eps);
  return low + (high - low) * rng.uniform(static_cast<uint64_t>(counter));
}

}  // namespace

template <typename T>
void input_jitter_forward(T* out, const T* inp, const int64_t* first_R, const int64_t R, const int64_t run,
                          const InputJitterSpec& spec) {
  const CounterRng rng(spec.seed, spec.key);
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t j = 0; j < run; ++j) {
      const int64_t i = r * run + j;
      out[i] = inp[i] * static_cast<T>(jitter_factor(rng, first_R[r] + j, spec.eps));
    }
  }
}

template <typename T>
void input_jitter_backward(T* dinp, const T* dout, const int64_t* first_R, const int64_t R, const int64_t run,
                           const InputJitterSpec& spec) {
  const CounterRng rng(spec.seed, spec.key);
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t j = 0; j < run; ++j) {
      const int64_t i = r * run + j;
      dinp[i] += dout[i] * static_cast<T>(jitter_factor(rng, first_R[r] + j, spec.eps));
    }
  }
}

template void input_jitter_forward<float>(float*, const float*, const int64_t*, int64_t, int64_t,
                                          const InputJitterSpec&);
template void input_jitter_forward<double>(double*, const double*, const int64_t*, int64_t, int64_t,
                                           const InputJitterSpec&);
template void input_jitter_backward<float>(float*, const float*, const int64_t*, int64_t, int64_t,
                                           const InputJitterSpec&);
template void input_jitter_backward<double>(double*, const double*, const int64_t*, int64_t, int64_t,
                                            const InputJitterSpec&);

}  // namespace moecore::kernels::ref
