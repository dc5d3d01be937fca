// Reference counter-RNG normal fill: run by run.
#include "moecore/kernels/cpu/normal_fill.h"
#include "moecore/tensor/rng.h"

namespace moecore::kernels::ref {

template <typename T>
void normal_fill(T* out, const int64_t* first_R, const int64_t R, const int64_t run, const uint64_t seed,
                 const uint64_t key, const double sigma) {
  const CounterRng rng(seed, key);
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t j = 0; j < run; ++j) {
      out[r * run + j] = static_cast<T>(sigma * rng.normal(static_cast<uint64_t>(first_R[r] + j)));
    }
  }
}

template void normal_fill<float>(float*, const int64_t*, int64_t, int64_t, uint64_t, uint64_t, double);
template void normal_fill<double>(double*, const int64_t*, int64_t, int64_t, uint64_t, uint64_t, double);

}  // namespace moecore::kernels::ref
