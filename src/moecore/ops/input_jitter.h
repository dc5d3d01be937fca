// The router's input jitter on tensors (semantics: kernels/cpu/input_jitter.h): the factors are regenerated in
// backward, never stored. inp / out / dinp / dout are [R, run] (any shape of R x run elements) of one dtype (fp32 or
// fp64); row r's elements use counters first_R[r] + [0, run). Like every op they round what they write to a 16-bit
// activation dtype (ops/precision.h); the router computes under an fp32 scope.
#pragma once

#include <cstdint>
#include <span>

#include "moecore/kernels/cpu/input_jitter.h"
#include "moecore/tensor/tensor.h"

namespace moecore::ops {

using kernels::InputJitterSpec;

// out = inp * factor (overwrites; may alias inp).
void input_jitter_forward(Tensor& out, const Tensor& inp, std::span<const int64_t> first_R, int64_t run,
                          const InputJitterSpec& spec);
// dinp += dout * factor.
void input_jitter_backward(Tensor& dinp, const Tensor& dout, std::span<const int64_t> first_R, int64_t run,
                           const InputJitterSpec& spec);

}  // namespace moecore::ops
