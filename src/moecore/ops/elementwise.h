// Whole-tensor elementwise ops.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "moecore/tensor/tensor.h"

namespace moecore::ops {

void add_(Tensor& y, const Tensor& x);  // y += x (same number of elements)
void scale_(Tensor& y, double alpha);   // y *= alpha
double sum_squares(const Tensor& x);    // sum of x^2, accumulated in double
// sum_squares of each tensor (one device, one dtype), in one pass over all of them; each sum independent of the thread
// count (a gradient norm over many parameters).
std::vector<double> sum_squares_each(std::span<const Tensor> xs);
bool all_finite(const Tensor& x);
int64_t count_zeros(const Tensor& x);  // elements equal to zero (-0 too)

}  // namespace moecore::ops
