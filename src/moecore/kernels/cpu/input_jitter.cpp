// Fast input jitter: a factor is a pure function of its counter, so the elements are independent (OpenMP over them).
#include "moecore/kernels/cpu/input_jitter.h"

#include "moecore/tensor/rng.h"

namespace moecore::kernels::cpu {
namespace {

constexpr int64_t kParallelMin = 8192;

// The factor generator of one call: fp32 bounds, fp32 arithmetic.
struct Factors {
  explicit Factors(const InputJitterSpec& spec)
      : rng(spec.seed, spec.key),
        low(static_cast<float>(1.0 - spec.eps)),
        width(static_cast<float>(1.0 + spec.eps) - static_cast<float>(1.0 - spec.eps)) {}
  float operator()(const int64_t counter) const { return low + width * rng.uniform(static_cast<uint64_t>(counter)); }
  CounterRng rng;
  float low, width;
};

}  // namespace

template <typename T>
void input_jitter_forward(T* out, const T* inp, const int64_t* first_R, const int64_t R, const int64_t run,
                          const InputJitterSpec& spec) {
  const Factors factor(spec);
  const int64_t n = R * run;
#pragma omp parallel for schedule(static) if (n > kParallelMin)
  for (int64_t i = 0; i < n; ++i) out[i] = inp[i] * static_cast<T>(factor(first_R[i / run] + i % run));
}

template <typename T>
void input_jitter_backward(T* dinp, const T* dout, const int64_t* first_R, const int64_t R, const int64_t run,
                           const InputJitterSpec& spec) {
  const int64_t n = R * run;
  if (spec.eps == 0.0) {
#pragma omp parallel for simd schedule(static) if (n > kParallelMin)
    for (int64_t i = 0; i < n; ++i) dinp[i] += dout[i];
    return;
  }
  const Factors factor(spec);
#pragma omp parallel for schedule(static) if (n > kParallelMin)
  for (int64_t i = 0; i < n; ++i) dinp[i] += dout[i] * static_cast<T>(factor(first_R[i / run] + i % run));
}

template void input_jitter_forward<float>(float*, const float*, const int64_t*, int64_t, int64_t,
                                          const InputJitterSpec&);
template void input_jitter_forward<double>(double*, const double*, const int64_t*, int64_t, int64_t,
                                           const InputJitterSpec&);
template void input_jitter_backward<float>(float*, const float*, const int64_t*, int64_t, int64_t,
                                           const InputJitterSpec&);
template void input_jitter_backward<double>(double*, const double*, const int64_t*, int64_t, int64_t,
                                            const InputJitterSpec&);

}  // namespace moecore::kernels::cpu
