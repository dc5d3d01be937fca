// Normal draws from the counter RNG (tensor/rng.h) at given element indices: parameter initialization, where a
// shard's elements take the one-process tensor's draws. The local elements are runs of `run` consecutive indices:
// out[r run + j] = sigma * CounterRng(seed, key).normal(first_R[r] + j).
#pragma once

#include <cstdint>

namespace moecore::kernels {

#define MOECORE_NORMAL_FILL_DECL \
  template <typename T>          \
  void normal_fill(T* out, const int64_t* first_R, int64_t R, int64_t run, uint64_t seed, uint64_t key, double sigma);

namespace cpu {
MOECORE_NORMAL_FILL_DECL
}
namespace ref {
MOECORE_NORMAL_FILL_DECL
}
#undef MOECORE_NORMAL_FILL_DECL

}  // namespace moecore::kernels
