// Fast dropout: the mask bit of element i is a pure function of (seed, key, i), so elements are independent
// and the loop parallelises without any shared RNG state.
#include "moecore/kernels/cpu/dropout.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

#include "moecore/tensor/rng.h"

namespace moecore::kernels::cpu {
namespace {

constexpr int64_t kParallelMin = 8192;

void check_p(const float p) {
  if (!(p >= 0.0f && p <= 1.0f)) throw std::invalid_argument("dropout: p=" + std::to_string(p) + " not in [0, 1]");
}

}  // namespace

template <typename T>
void dropout_forward(T* out, const T* inp, const int64_t n, const DropoutSpec& spec) {
  check_p(spec.p);
  if (spec.p == 0.0f) {
    std::copy_n(inp, n, out);
    return;
  }
  const CounterRng rng(spec.seed, spec.key);
  const T scale = T(1) / (T(1) - static_cast<T>(spec.p));  // unused when p == 1 (everything dropped)
#pragma omp parallel for schedule(static) if (n > kParallelMin)
  for (int64_t i = 0; i < n; ++i) {
    out[i] = rng.uniform(spec.offset + static_cast<uint64_t>(i)) < spec.p ? T(0) : inp[i] * scale;
  }
}

template <typename T>
void dropout_backward(T* dinp, const T* dout, const int64_t n, const DropoutSpec& spec) {
  check_p(spec.p);
  if (spec.p == 0.0f) {
#pragma omp parallel for simd schedule(static) if (n > kParallelMin)
    for (int64_t i = 0; i < n; ++i) dinp[i] += dout[i];
    return;
  }
  const CounterRng rng(spec.seed, spec.key);
  const T scale = T(1) / (T(1) - static_cast<T>(spec.p));
#pragma omp parallel for schedule(static) if (n > kParallelMin)
  for (int64_t i = 0; i < n; ++i) {
    if (!(rng.uniform(spec.offset + static_cast<uint64_t>(i)) < spec.p)) dinp[i] += dout[i] * scale;
  }
}

template void dropout_forward<float>(float*, const float*, int64_t, const DropoutSpec&);
template void dropout_forward<double>(double*, const double*, int64_t, const DropoutSpec&);
template void dropout_backward<float>(float*, const float*, int64_t, const DropoutSpec&);
template void dropout_backward<double>(double*, const double*, int64_t, const DropoutSpec&);

}  // namespace moecore::kernels::cpu
