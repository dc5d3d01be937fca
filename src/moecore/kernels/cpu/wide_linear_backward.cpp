#include "moecore/kernels/cpu/wide_linear_backward.h"

#include <omp.h>

#include <algorithm>
#include <vector>

#include "moecore/kernels/cpu/gemm.h"
#include "moecore/kernels/cpu/onednn_matmul.h"

namespace moecore::kernels::cpu::wide_linear_backward {

void run(float* dinp_TI, float* dweight_OI, const float* dout_TO, const float* inp_TI, const float* weight_OI,
         const int64_t n_tokens, const int64_t in_features, const int64_t out_features) {
  const int64_t T = n_tokens, I = in_features, O = out_features;
  const int64_t n_blocks = (O + kBlock - 1) / kBlock;
  // The dinp partial sums, in a buffer the calling thread keeps across calls (a chunk's backward runs several times a
  // step; every partial is written before it is read).
  thread_local std::vector<float> partials_buffer;
  if (partials_buffer.size() < static_cast<size_t>(kGroups * T * I)) {
    partials_buffer.resize(static_cast<size_t>(kGroups * T * I));
  }
  float* const partials = partials_buffer.data();
  // sgemm inside the region runs on the calling thread (onednn_matmul_threads, oneDNN's own nesting rule).
#pragma omp parallel for schedule(static) num_threads(onednn_matmul_threads())
  for (int64_t group = 0; group < kGroups; ++group) {
    float* partial_TI = partials + group * T * I;
    const int64_t first = n_blocks * group / kGroups, last = n_blocks * (group + 1) / kGroups;
    for (int64_t block = first; block < last; ++block) {
      const int64_t o0 = block * kBlock, rows = std::min(kBlock, O - o0);
      sgemm(false, false, T, I, rows, 1.0f, dout_TO + o0, O, weight_OI + o0 * I, I, block == first ? 0.0f : 1.0f,
            partial_TI, I);
      sgemm(true, false, rows, I, T, 1.0f, dout_TO + o0, O, inp_TI, I, 1.0f, dweight_OI + o0 * I, I);
    }
  }
#pragma omp parallel for schedule(static) num_threads(onednn_matmul_threads()) if (T * I > 16384)
  for (int64_t t = 0; t < T; ++t) {
    float* dinp_I = dinp_TI + t * I;
    for (int64_t group = 0; group < kGroups; ++group) {
      const float* partial_I = partials + (group * T + t) * I;
#pragma omp simd
      for (int64_t i = 0; i < I; ++i) dinp_I[i] += partial_I[i];
    }
  }
}

}  // namespace moecore::kernels::cpu::wide_linear_backward
