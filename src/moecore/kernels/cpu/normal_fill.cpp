// Counter-RNG normal fill, OpenMP over elements (each element's draw depends on its index only).
#include "moecore/kernels/cpu/normal_fill.h"

#include "moecore/tensor/rng.h"

namespace moecore::kernels::cpu {

template <typename T>
void normal_fill(T* out, const int64_t* first_R, const int64_t R, const int64_t run, const uint64_t seed,
                 const uint64_t key, const double sigma) {
  const CounterRng rng(seed, key);
  const int64_t n = R * run;
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    out[i] = static_cast<T>(sigma * rng.normal(static_cast<uint64_t>(first_R[i / run] + i % run)));
  }
}

template void normal_fill<float>(float*, const int64_t*, int64_t, int64_t, uint64_t, uint64_t, double);
template void normal_fill<double>(double*, const int64_t*, int64_t, int64_t, uint64_t, uint64_t, double);

}  // namespace moecore::kernels::cpu
