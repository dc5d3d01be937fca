// Whole-tensor elementwise ops.
#pragma once

#include <cstdint>

#include "moecore/tensor/tensor.h"

namespace moecore::ops {

void add_(Tensor& y, const Tensor& x);  // y += x (same number of elements)
void scale_(Tensor& y, double alpha);   // y *= alpha
double sum_squares(const Tensor& x);    // sum of x^2, accumulated in double
bool all_finite(const Tensor& x);
int64_t count_zeros(const Tensor& x);  // elements equal to zero (-0 too)

}  // namespace moecore::ops
