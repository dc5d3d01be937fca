// Conversions between floating-point tensors.
#pragma once

#include "moecore/tensor/tensor.h"

namespace moecore::ops {

// dst = src, element by element, between any two of fp32, fp64, bf16 and fp16 (same number of elements, any
// shapes): narrowing rounds to nearest even once (NaN stays NaN, overflow goes to Inf), widening is exact, the same
// dtype copies.
void convert(Tensor& dst, const Tensor& src);

}  // namespace moecore::ops
