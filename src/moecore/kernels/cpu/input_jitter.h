// Megatron's router input jitter (TopKRouter.apply_input_jitter) from the counter RNG: the factor of the element at
// counter c is Uniform(1 - eps, 1 + eps) in fp32, low + (high - low) * CounterRng(seed, key).uniform(c) with low and
// high the fp32 bounds (torch's rsample). The n = R x run elements are runs of `run` consecutive counters: element
// r run + j has counter first_R[r] + j (a rank's token rows take their one-process rows' factors).
#pragma once

#include <cstdint>

namespace moecore::kernels {

struct InputJitterSpec {
  double eps = 0.0;   // 0: every factor is 1
  uint64_t seed = 0;  // run seed
  uint64_t key = 0;   // the router's stream (layer x micro-batch x iteration)
};

// out = inp * factor (out may alias inp); dinp += dout * factor (the product rounded to T, then added).
#define MOECORE_INPUT_JITTER_DECL                                                                    \
  template <typename T>                                                                              \
  void input_jitter_forward(T* out, const T* inp, const int64_t* first_R, int64_t R, int64_t run,    \
                            const InputJitterSpec& spec);                                            \
  template <typename T>                                                                              \
  void input_jitter_backward(T* dinp, const T* dout, const int64_t* first_R, int64_t R, int64_t run, \
                             const InputJitterSpec& spec);

namespace cpu {
MOECORE_INPUT_JITTER_DECL
}
namespace ref {
MOECORE_INPUT_JITTER_DECL
}
#undef MOECORE_INPUT_JITTER_DECL

}  // namespace moecore::kernels
