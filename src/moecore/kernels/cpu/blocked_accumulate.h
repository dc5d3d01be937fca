// C += a product, where C is large: oneDNN 2.6.3's GEMMs accumulating (beta 1) into an fp32 C of tens of MiB ran
// 10-40% below their beta-0 rate (the output layer's weight gradient, 32128 x 512: bf16 matmul at K 256-512, sgemm
// at K 256; AMD Zen 5, bench/RESULTS.md), while C of a few MiB kept pace. Such a product runs in blocks of rows, each
// written with beta 0 into a buffer that stays in cache and then added to C. Internal to kernels/cpu (gemm.cpp,
// gemm_lowp.cpp).
#pragma once

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace moecore::kernels::cpu::blocked_accumulate {

constexpr int64_t kMinElements = int64_t{1} << 23;     // of C (32 MiB): below, beta 1 kept pace
constexpr int64_t kBufferElements = int64_t{1} << 21;  // of a block (8 MiB)

// Whether C[M, N] is large enough, and its rows short enough, to be accumulated in blocks.
inline bool applies(const int64_t M, const int64_t N) { return M * N >= kMinElements && N <= kBufferElements / 2; }

// The calling thread's block buffer, one for every caller of run().
inline std::vector<float>& thread_buffer() {
  thread_local std::vector<float> buffer;
  return buffer;
}

// C[M, N] (leading dimension ldc) += the product product(m0, rows, buffer) writes into buffer ([rows, N], dense) for
// rows m0 .. m0 + rows, block by block; each element is the same fp32 sum plus C as a beta-1 GEMM's, up to the order
// of the sum (oneDNN blocks K by the shape). The buffer is kept by the calling thread (product, a beta-0 GEMM, must
// not come back here); the adds run on `threads`.
template <typename Product>
void run(const int64_t M, const int64_t N, float* C, const int64_t ldc, const int threads, Product&& product) {
  const int64_t rows = std::max<int64_t>(1, kBufferElements / N);
  std::vector<float>& buffer = thread_buffer();
  const auto size = static_cast<size_t>(std::min(rows, M) * N);
  if (buffer.size() < size) buffer.resize(size);
  for (int64_t m0 = 0; m0 < M; m0 += rows) {
    const int64_t m_len = std::min(rows, M - m0);
    product(m0, m_len, buffer.data());
    const float* sum = buffer.data();
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t i = 0; i < m_len; ++i) {
      float* c = C + (m0 + i) * ldc;
      const float* p = sum + i * N;
      for (int64_t j = 0; j < N; ++j) c[j] += p[j];
    }
  }
}

}  // namespace moecore::kernels::cpu::blocked_accumulate
