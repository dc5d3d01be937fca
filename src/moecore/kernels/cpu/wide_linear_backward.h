// The fp32 backward of a linear layer over few tokens and many outputs: the output layer on a chunk of logits rows.
// Two whole-matrix GEMMs (dinp += dout weight, dweight += dout^T inp) each stream dout and the weight-sized operand
// from memory, and over a short chunk those passes, not the products, set the pace. Here the outputs go in blocks
// of kBlock: each block's dout columns, weight rows and weight-gradient rows are read once and used for both products
// while in cache, the blocks spread over the threads. On a 2-core Xeon (AVX-512, no AMX), 2 threads, the backward of
// a 256-row chunk at vocabulary 32000 and hidden 512 took 0.78 of the two GEMMs' time, a 128-row one 0.87, a 160-row
// one at vocabulary 50304 and hidden 192 0.90, a 320-row one 0.95; from 512 rows on the two GEMMs kept pace or won
// (bench_output_layer, bench/RESULTS.md). Internal to kernels/cpu (gemm.cpp).
#pragma once

#include <cstdint>

namespace moecore::kernels::cpu::wide_linear_backward {

constexpr int64_t kBlock = 512;      // outputs per block: [n, 512] of dout and [512, I] of the weight and its gradient
constexpr int64_t kGroups = 8;       // dinp partial sums, a fixed count so that the bits do not depend on the threads
constexpr int64_t kMaxTokens = 320;  // measured: 128-320 rows won, 512 did not
constexpr int64_t kMinOutputs = kGroups * kBlock;
constexpr int64_t kMaxInputs = 1024;  // measured at 192-1024; a block's weight rows stay within a core's L2

// Whether linear_backward's fp32 GEMMs run as here: both gradients wanted, and a shape within the measured range.
inline bool applies(const int64_t n_tokens, const int64_t in_features, const int64_t out_features) {
  return n_tokens > 0 && n_tokens <= kMaxTokens && out_features >= kMinOutputs && in_features > 0 &&
         in_features <= kMaxInputs;
}

// dinp_TI += dout_TO @ weight_OI and dweight_OI += dout_TO^T @ inp_TI, block by block. Each output of dweight is one
// GEMM's sum over the tokens as before; dinp sums kGroups partial sums (each its blocks' GEMMs, in order) in order.
void run(float* dinp_TI, float* dweight_OI, const float* dout_TO, const float* inp_TI, const float* weight_OI,
         int64_t n_tokens, int64_t in_features, int64_t out_features);

}  // namespace moecore::kernels::cpu::wide_linear_backward
