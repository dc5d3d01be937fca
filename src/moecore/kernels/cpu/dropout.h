// Dropout from the counter RNG: element i is dropped iff CounterRng(seed, key).uniform(offset + i) < p, kept
// elements are scaled by 1/(1-p). The mask is regenerated in backward, never stored.
#pragma once

#include <cstdint>

namespace moecore::kernels {

struct DropoutSpec {
  float p = 0.0f;     // drop probability; 0 disables
  uint64_t seed = 0;  // run seed
  uint64_t key = 0;   // call site x micro-batch x iteration: distinct for every dropout application
  // Element i uses RNG counter offset + i, so a shard of a tensor (tensor / sequence parallelism) draws the mask
  // of its place in the one-process tensor.
  uint64_t offset = 0;
};

#define MOECORE_DROPOUT_DECL                                                      \
  template <typename T>                                                           \
  void dropout_forward(T* out, const T* inp, int64_t n, const DropoutSpec& spec); \
  template <typename T>                                                           \
  void dropout_backward(T* dinp, const T* dout, int64_t n, const DropoutSpec& spec);

namespace cpu {
MOECORE_DROPOUT_DECL
}
namespace ref {
MOECORE_DROPOUT_DECL
}
#undef MOECORE_DROPOUT_DECL

}  // namespace moecore::kernels
