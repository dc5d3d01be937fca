// Finding non-finite values (NaN, +Inf, -Inf) in a tensor: loaded weights are checked with it, so that a damaged
// checkpoint is an error naming the tensor instead of a model that silently computes NaN.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "moecore/tensor/tensor.h"

namespace moecore {

struct NonFiniteElement {
  int64_t index = 0;  // flat, row-major
  double value = 0.0;
};

// The first non-finite element of a floating tensor (F32, F64, BF16, F16); nullopt when every element is finite or
// the dtype is an integer one.
std::optional<NonFiniteElement> first_nonfinite(const Tensor& x);

// "NaN", "Inf" or "-Inf".
std::string nonfinite_name(double value);

// Throws std::runtime_error "NAME holds a non-finite value (NaN) at element 17" when `x` holds one.
void require_finite(const Tensor& x, const std::string& name);

}  // namespace moecore
