// Test inputs for the 16-bit paths: fp32 tensors holding values of a 16-bit format, and their 16-bit copies.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

#include "moecore/ops/ops.h"
#include "moecore/ops/precision.h"

namespace moecore::ops::test {

// Normal draws rounded to `dtype`, in an fp32 tensor counted under `category` (kParams: a model parameter's storage).
inline Tensor random_values(const std::vector<int64_t>& shape, const DType dtype, const uint32_t seed,
                            const MemCategory category = MemCategory::kOther) {
  Tensor t(shape, DType::kF32, category);
  std::mt19937 gen(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = normal(gen);
  round_to_dtype_(t, dtype);
  return t;
}

// `t` converted to `dtype` (exact for values of that format).
inline Tensor as_dtype(const Tensor& t, const DType dtype) {
  Tensor out(t.shape(), dtype);
  convert(out, t);
  return out;
}

}  // namespace moecore::ops::test
