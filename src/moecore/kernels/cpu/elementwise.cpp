// Small vector helpers: OpenMP over chunks, each a SIMD loop compiled per vector ISA.
#include "moecore/kernels/cpu/elementwise.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "moecore/kernels/cpu/vector_isa.h"

namespace moecore::kernels::cpu {
namespace {
constexpr int64_t kParallelMin = 65536;
constexpr int64_t kChunk = 4096;  // elements per call of a loop body

// Elements [i0, i1) of each helper, compiled per vector ISA.
template <typename T>
MOECORE_VECTOR_CLONES void add_chunk(T* y, const T* x, const int64_t i0, const int64_t i1) {
#pragma omp simd
  for (int64_t i = i0; i < i1; ++i) y[i] += x[i];
}

template <typename T>
MOECORE_VECTOR_CLONES void scale_chunk(T* y, const T alpha, const int64_t i0, const int64_t i1) {
#pragma omp simd
  for (int64_t i = i0; i < i1; ++i) y[i] *= alpha;
}

// Elements [i0, i1) read as four interleaved streams, a quarter each: one sequential stream per thread left the
// gradient-norm pass at two thirds of the memory bandwidth the optimizer's five streams reach.
constexpr int64_t kSumSquaresChunk = int64_t{1} << 18;
template <typename T>
MOECORE_VECTOR_CLONES double sum_squares_chunk(const T* x, const int64_t i0, const int64_t i1) {
  const int64_t quarter = (i1 - i0) / 4;
  const T *a = x + i0, *b = a + quarter, *c = b + quarter, *d = c + quarter;
  double ta = 0.0, tb = 0.0, tc = 0.0, td = 0.0;
#pragma omp simd reduction(+ : ta, tb, tc, td)
  for (int64_t i = 0; i < quarter; ++i) {
    ta += static_cast<double>(a[i]) * static_cast<double>(a[i]);
    tb += static_cast<double>(b[i]) * static_cast<double>(b[i]);
    tc += static_cast<double>(c[i]) * static_cast<double>(c[i]);
    td += static_cast<double>(d[i]) * static_cast<double>(d[i]);
  }
  double total = (ta + tb) + (tc + td);
  for (int64_t i = i0 + 4 * quarter; i < i1; ++i) total += static_cast<double>(x[i]) * static_cast<double>(x[i]);
  return total;
}

template <typename T>
MOECORE_VECTOR_CLONES int64_t count_non_finite_chunk(const T* x, const int64_t i0, const int64_t i1) {
  int64_t n_bad = 0;
#pragma omp simd reduction(+ : n_bad)
  for (int64_t i = i0; i < i1; ++i) n_bad += std::isfinite(x[i]) ? 0 : 1;
  return n_bad;
}
template <typename T>
MOECORE_VECTOR_CLONES int64_t count_zeros_chunk(const T* x, const int64_t i0, const int64_t i1) {
  int64_t zeros = 0;
#pragma omp simd reduction(+ : zeros)
  for (int64_t i = i0; i < i1; ++i) zeros += x[i] == T(0) ? 1 : 0;
  return zeros;
}
}  // namespace

template <typename T>
void add_inplace(T* y, const T* x, const int64_t n) {
#pragma omp parallel for schedule(static) if (n > kParallelMin)
  for (int64_t i = 0; i < n; i += kChunk) add_chunk(y, x, i, std::min(n, i + kChunk));
}

template <typename T>
void scale_inplace(T* y, const T alpha, const int64_t n) {
#pragma omp parallel for schedule(static) if (n > kParallelMin)
  for (int64_t i = 0; i < n; i += kChunk) scale_chunk(y, alpha, i, std::min(n, i + kChunk));
}

template <typename T>
double sum_squares(const T* x, const int64_t n) {
  double total = 0.0;
  // At least four chunks a thread, so that a tensor of a few chunks is not left mostly to one.
  const int64_t per_thread = n / (4 * static_cast<int64_t>(omp_get_max_threads()));
  const int64_t chunk = std::clamp<int64_t>(per_thread - per_thread % kChunk, kChunk, kSumSquaresChunk);
#pragma omp parallel for schedule(static) reduction(+ : total) if (n > kParallelMin)
  for (int64_t i = 0; i < n; i += chunk) total += sum_squares_chunk(x, i, std::min(n, i + chunk));
  return total;
}

// One parallel loop over every tensor's chunks: a norm over thousands of parameters (one per expert) as one call per
// tensor opened a parallel region for each and read each in short streams (bench/RESULTS.md).
template <typename T>
void sum_squares_each(const T* const* xs, const int64_t* ns, const int64_t count, double* sums) {
  struct Chunk {
    int64_t tensor, begin, end;
  };
  std::vector<Chunk> chunks;
  int64_t total = 0;
  for (int64_t j = 0; j < count; ++j) {
    for (int64_t begin = 0; begin < ns[j]; begin += kSumSquaresChunk) {
      chunks.push_back({j, begin, std::min(ns[j], begin + kSumSquaresChunk)});
    }
    total += ns[j];
  }
  std::vector<double> partial(chunks.size());
  const auto n_chunks = static_cast<int64_t>(chunks.size());
#pragma omp parallel for schedule(dynamic, 1) if (total > kParallelMin && n_chunks > 1)
  for (int64_t c = 0; c < n_chunks; ++c) {
    const Chunk& chunk = chunks[static_cast<size_t>(c)];
    partial[static_cast<size_t>(c)] = sum_squares_chunk(xs[chunk.tensor], chunk.begin, chunk.end);
  }
  std::fill(sums, sums + count, 0.0);
  for (int64_t c = 0; c < n_chunks; ++c) sums[chunks[static_cast<size_t>(c)].tensor] += partial[static_cast<size_t>(c)];
}

template <typename T>
bool all_finite(const T* x, const int64_t n) {
  int64_t n_bad = 0;
#pragma omp parallel for schedule(static) reduction(+ : n_bad) if (n > kParallelMin)
  for (int64_t i = 0; i < n; i += kChunk) n_bad += count_non_finite_chunk(x, i, std::min(n, i + kChunk));
  return n_bad == 0;
}

template <typename T>
int64_t count_zeros(const T* x, const int64_t n) {
  int64_t zeros = 0;
#pragma omp parallel for schedule(static) reduction(+ : zeros) if (n > kParallelMin)
  for (int64_t i = 0; i < n; i += kChunk) zeros += count_zeros_chunk(x, i, std::min(n, i + kChunk));
  return zeros;
}

float abs_max(const float* x, const int64_t n) {
  float amax = 0.0f;
#pragma omp parallel for schedule(static) reduction(max : amax) if (n > kParallelMin)
  for (int64_t i = 0; i < n; ++i) amax = std::fmax(amax, std::fabs(x[i]));
  return amax;
}

MOECORE_ELEMENTWISE_INSTANTIATE(float)
MOECORE_ELEMENTWISE_INSTANTIATE(double)

}  // namespace moecore::kernels::cpu
