// NVFP4's random Hadamard transform (RHT): each run of 16 consecutive elements along a row is multiplied by
// M = diag(s) H16 / 4, with H16 the Sylvester Hadamard matrix (H[i][j] = (-1)^popcount(i & j)) and s a vector of
// random signs; M is orthogonal, so applying it to both operands of a GEMM along their common reduction
// dimension leaves the product unchanged while spreading outliers over 16 elements. TE applies it only to the
// column-wise data of activations and gradients, i.e. along the token dimension of the wgrad GEMM
// (NVFP4BlockScaling: "RHT is currently only applied to column-wise usage so that it can be used for wgrad GEMM";
// transformer_engine/pytorch/tensor/nvfp4_tensor.py get_rht_matrix, custom_recipes/reference_nvfp4.py _apply_rht).
#pragma once

#include <array>
#include <cstdint>

namespace moecore::quant {

constexpr int64_t kRhtSize = 16;
using RhtSigns = std::array<float, kRhtSize>;

// TE's fixed sign vector (nvfp4_tensor.py get_wgrad_sign_vector): TE draws its signs once, not per seed.
RhtSigns te_rht_signs();
// Signs drawn from a seed (bit 0 of Philox(seed, stream "quant.rht_signs", i)), for experiments with other draws.
RhtSigns rht_signs_from_seed(uint64_t seed);

// out[r, 16b + j] = (sum_{i = 0..15, in order} s_i H[i][j] x[r, 16b + i]) * 0.25 in fp32, i.e. x_row @ M per
// 16-element group; cols % 16 == 0 (std::invalid_argument otherwise). `out` may not alias `x`.
void rht_rows(const float* x, int64_t rows, int64_t cols, const RhtSigns& signs, float* out);
// The inverse (M^T): x[r, 16b + i] = s_i (sum_{j in order} H[i][j] y[r, 16b + j]) * 0.25.
void inverse_rht_rows(const float* y, int64_t rows, int64_t cols, const RhtSigns& signs, float* out);

}  // namespace moecore::quant
