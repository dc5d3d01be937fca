// Fast causal GQA attention: blocked over 64 query rows (and 64 key columns in the key-parallel backward), the
// heavy products done as single-threaded GEMMs (the GEMM library's, gemm.h) on strided views inside OpenMP tasks, the
// fully masked upper triangle skipped block-wise, the probability matrix recomputed from lse in backward instead of
// stored.
#include "moecore/kernels/cpu/attention.h"

#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "moecore/kernels/cpu/gemm.h"
#include "moecore/kernels/cpu/vector_isa.h"
#include "moecore/tensor/rng.h"

namespace moecore::kernels::cpu {
namespace {

constexpr int64_t kBlock = 64;
// Below this many multiply-adds (S^2 B N d) a call runs on one thread: fork/join would cost more than it saves.
constexpr int64_t kParallelWork = int64_t{1} << 18;

CBLAS_TRANSPOSE blas_op(const bool transpose) { return transpose ? CblasTrans : CblasNoTrans; }

// Row-major C = alpha op(A) op(B) + beta C.
void gemm_rm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
             const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  sgemm(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}
void gemm_rm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, double alpha, const double* A, int64_t lda,
             const double* B, int64_t ldb, double beta, double* C, int64_t ldc) {
  cblas_dgemm(CblasRowMajor, blas_op(trans_a), blas_op(trans_b), static_cast<blasint>(M), static_cast<blasint>(N),
              static_cast<blasint>(K), alpha, A, static_cast<blasint>(lda), B, static_cast<blasint>(ldb), beta, C,
              static_cast<blasint>(ldc));
}

void check_args(const AttentionDims& dims, const DropoutSpec& dropout, const char* fn) {
  if (dims.S < 0 || dims.B < 0 || dims.N <= 0 || dims.G <= 0 || dims.head_dim <= 0 || dims.N % dims.G != 0) {
    throw std::invalid_argument(std::string(fn) + ": bad dims S=" + std::to_string(dims.S) +
                                " B=" + std::to_string(dims.B) + " N=" + std::to_string(dims.N) +
                                " G=" + std::to_string(dims.G) + " head_dim=" + std::to_string(dims.head_dim) +
                                " (need N, G, head_dim > 0 and N divisible by G)");
  }
  if (!(dropout.p >= 0.0f && dropout.p < 1.0f)) {
    throw std::invalid_argument(std::string(fn) + ": dropout p=" + std::to_string(dropout.p) + " is outside [0, 1)");
  }
}

// Strides and offsets of the [S, B, N, d] / [S, B, G, d] layouts.
struct Geometry {
  explicit Geometry(const AttentionDims& dims)
      : S(dims.S),
        B(dims.B),
        N(dims.N),
        G(dims.G),
        d(dims.head_dim),
        heads_per_group(dims.N / dims.G),
        ld_q(dims.B * dims.N * dims.head_dim),
        ld_kv(dims.B * dims.G * dims.head_dim),
        dropout_heads(dims.dropout_total_heads > 0 ? dims.dropout_total_heads : dims.N),
        dropout_head_offset(dims.dropout_head_offset) {}
  int64_t q_offset(int64_t i, int64_t b, int64_t h) const { return ((i * B + b) * N + h) * d; }
  int64_t kv_offset(int64_t j, int64_t b, int64_t g) const { return ((j * B + b) * G + g) * d; }
  int64_t row_offset(int64_t b, int64_t h) const { return (b * N + h) * S; }  // into lse_BNS
  int64_t n_blocks() const { return (S + kBlock - 1) / kBlock; }
  bool parallel() const { return S * S * B * N * d > kParallelWork; }

  // RNG counter base of head h's probabilities: the one-process head index under tensor parallelism.
  int64_t dropout_row(int64_t b, int64_t h) const { return (b * dropout_heads + dropout_head_offset + h) * S; }

  int64_t S, B, N, G, d, heads_per_group, ld_q, ld_kv, dropout_heads, dropout_head_offset;
};

// Dropout on the probabilities of one head: element (i, j) is kept iff uniform(counter) >= p.
struct HeadDropout {
  HeadDropout(const DropoutSpec& spec, const Geometry& geo, int64_t b, int64_t h)
      : active(spec.p > 0.0f),
        p(spec.p),
        keep_scale(1.0 / (1.0 - static_cast<double>(spec.p))),
        rng(spec.seed, spec.key),
        head_base(static_cast<uint64_t>(geo.dropout_row(b, h)) * static_cast<uint64_t>(geo.S)),
        S(static_cast<uint64_t>(geo.S)) {}
  bool kept(int64_t i, int64_t j) const {
    return rng.uniform(head_base + static_cast<uint64_t>(i) * S + static_cast<uint64_t>(j)) >= p;
  }

  bool active;
  float p;
  double keep_scale;
  CounterRng rng;
  uint64_t head_base, S;
};

// Per-thread scratch: two [kBlock, S] tiles.
template <typename T>
class Scratch {
 public:
  explicit Scratch(int64_t tile_elems) : tile_elems_(tile_elems), buf_(2 * tile_elems * omp_get_max_threads()) {}
  T* tile(int which) { return buf_.data() + (2 * omp_get_thread_num() + which) * tile_elems_; }

 private:
  int64_t tile_elems_;
  std::vector<T> buf_;
};

// Forward for query rows [i0, i1) of head (b, h); keys [0, i1). Compiled per vector ISA (the softmax loops).
template <typename T>
MOECORE_VECTOR_CLONES void forward_block(T* out, T* lse, const T* q, const T* k, const T* v, const Geometry& geo,
                                         double scale, const HeadDropout& drop, int64_t b, int64_t h, int64_t i0,
                                         int64_t i1, T* probs) {
  const int64_t rows = i1 - i0, keys = i1, g = h / geo.heads_per_group;
  gemm_rm(false, true, rows, keys, geo.d, static_cast<T>(scale), q + geo.q_offset(i0, b, h), geo.ld_q,
          k + geo.kv_offset(0, b, g), geo.ld_kv, T(0), probs, keys);
  T* lse_row = lse + geo.row_offset(b, h);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t i = i0 + r, n_valid = i + 1;
    T* row = probs + r * keys;
    const T row_max = *std::max_element(row, row + n_valid);
    double sum = 0.0;
    for (int64_t j = 0; j < n_valid; ++j) {
      const T e = std::exp(row[j] - row_max);
      row[j] = e;
      sum += static_cast<double>(e);
    }
    std::fill(row + n_valid, row + keys, T(0));
    lse_row[i] = static_cast<T>(static_cast<double>(row_max) + std::log(sum));
    if (drop.active) {
      const T kept_scale = static_cast<T>(drop.keep_scale / sum);
      for (int64_t j = 0; j < n_valid; ++j) row[j] = drop.kept(i, j) ? row[j] * kept_scale : T(0);
    } else {
      const T inv_sum = static_cast<T>(1.0 / sum);
      for (int64_t j = 0; j < n_valid; ++j) row[j] *= inv_sum;
    }
  }
  gemm_rm(false, false, rows, geo.d, keys, T(1), probs, keys, v + geo.kv_offset(0, b, g), geo.ld_kv, T(0),
          out + geo.q_offset(i0, b, h), geo.ld_q);
}

// Inputs of the backward shared by all tasks.
template <typename T>
struct BackwardInputs {
  const T *dout, *q, *k, *v, *lse, *delta;  // delta_BNS = rowsum(dout * out) = rowsum(dP * P)
  Geometry geo;
  double scale;
  DropoutSpec dropout;
};

// For query rows [i0, i1) and keys [j0, j1) of head (b, h), fills (row-major, ld = j1 - j0)
//   pd = P * mask / (1 - p)  (dropped probabilities, for dV)
//   ds = scale * P * (dPd * mask / (1 - p) - delta)  (gradient of the unscaled scores q k^T)
// with both zero above the diagonal. Compiled per vector ISA (the elementwise loops).
template <typename T>
MOECORE_VECTOR_CLONES void backward_tiles(const BackwardInputs<T>& in, int64_t b, int64_t h, int64_t i0, int64_t i1,
                                          int64_t j0, int64_t j1, T* pd, T* ds) {
  const Geometry& geo = in.geo;
  const int64_t rows = i1 - i0, cols = j1 - j0, g = h / geo.heads_per_group;
  gemm_rm(false, true, rows, cols, geo.d, static_cast<T>(in.scale), in.q + geo.q_offset(i0, b, h), geo.ld_q,
          in.k + geo.kv_offset(j0, b, g), geo.ld_kv, T(0), pd, cols);
  gemm_rm(false, true, rows, cols, geo.d, T(1), in.dout + geo.q_offset(i0, b, h), geo.ld_q,
          in.v + geo.kv_offset(j0, b, g), geo.ld_kv, T(0), ds, cols);
  const HeadDropout drop(in.dropout, geo, b, h);
  const T scale = static_cast<T>(in.scale), keep_scale = static_cast<T>(drop.keep_scale);
  const T* lse_row = in.lse + geo.row_offset(b, h);
  const T* delta_row = in.delta + geo.row_offset(b, h);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t i = i0 + r, n_valid = std::clamp<int64_t>(i + 1 - j0, 0, cols);
    T* pd_row = pd + r * cols;
    T* ds_row = ds + r * cols;
    const T lse_i = lse_row[i], delta_i = delta_row[i];
    if (drop.active) {
      for (int64_t c = 0; c < n_valid; ++c) {
        const T p = std::exp(pd_row[c] - lse_i);
        const T mask = drop.kept(i, j0 + c) ? keep_scale : T(0);
        pd_row[c] = p * mask;
        ds_row[c] = scale * p * (ds_row[c] * mask - delta_i);
      }
    } else {
      for (int64_t c = 0; c < n_valid; ++c) {
        const T p = std::exp(pd_row[c] - lse_i);
        pd_row[c] = p;
        ds_row[c] = scale * p * (ds_row[c] - delta_i);
      }
    }
    std::fill(pd_row + n_valid, pd_row + cols, T(0));
    std::fill(ds_row + n_valid, ds_row + cols, T(0));
  }
}

// One task per (b, kv group): all its heads and query blocks, writing dq, dk, dv of the group directly.
template <typename T>
void backward_by_group(T* dq, T* dk, T* dv, const BackwardInputs<T>& in) {
  const Geometry& geo = in.geo;
  Scratch<T> scratch(kBlock * geo.S);
#pragma omp parallel for schedule(dynamic, 1) if (geo.parallel())
  for (int64_t bg = 0; bg < geo.B * geo.G; ++bg) {
    const int64_t b = bg / geo.G, g = bg % geo.G;
    T* pd = scratch.tile(0);
    T* ds = scratch.tile(1);
    for (int64_t h = g * geo.heads_per_group; h < (g + 1) * geo.heads_per_group; ++h) {
      for (int64_t i0 = 0; i0 < geo.S; i0 += kBlock) {
        const int64_t i1 = std::min(geo.S, i0 + kBlock), rows = i1 - i0;
        backward_tiles(in, b, h, i0, i1, 0, i1, pd, ds);
        const int64_t q_off = geo.q_offset(i0, b, h), kv_off = geo.kv_offset(0, b, g);
        gemm_rm(true, false, i1, geo.d, rows, T(1), pd, i1, in.dout + q_off, geo.ld_q, T(1), dv + kv_off, geo.ld_kv);
        gemm_rm(true, false, i1, geo.d, rows, T(1), ds, i1, in.q + q_off, geo.ld_q, T(1), dk + kv_off, geo.ld_kv);
        gemm_rm(false, false, rows, geo.d, i1, T(1), ds, i1, in.k + kv_off, geo.ld_kv, T(1), dq + q_off, geo.ld_q);
      }
    }
  }
}

// Two passes with more parallelism when there are few (b, group) pairs: tasks (b, group, key block) produce dk, dv;
// tasks (b, head, query block) produce dq. Recomputes the score tiles twice.
template <typename T>
void backward_by_block(T* dq, T* dk, T* dv, const BackwardInputs<T>& in) {
  const Geometry& geo = in.geo;
  const int64_t n_blocks = geo.n_blocks();
  Scratch<T> scratch(kBlock * geo.S);
#pragma omp parallel if (geo.parallel())
  {
    T* pd = scratch.tile(0);
    T* ds = scratch.tile(1);
    // Key block 0 sees every query row, the last one the fewest: start the big tasks first. The dq loop below
    // reads nothing this one writes, so threads move on without a barrier.
#pragma omp for schedule(dynamic, 1) nowait
    for (int64_t task = 0; task < n_blocks * geo.B * geo.G; ++task) {
      const int64_t bg = task % (geo.B * geo.G), b = bg / geo.G, g = bg % geo.G;
      const int64_t j0 = task / (geo.B * geo.G) * kBlock, j1 = std::min(geo.S, j0 + kBlock), cols = j1 - j0;
      const int64_t kv_off = geo.kv_offset(j0, b, g);
      for (int64_t h = g * geo.heads_per_group; h < (g + 1) * geo.heads_per_group; ++h) {
        for (int64_t i0 = j0; i0 < geo.S; i0 += kBlock) {
          const int64_t i1 = std::min(geo.S, i0 + kBlock), rows = i1 - i0, q_off = geo.q_offset(i0, b, h);
          backward_tiles(in, b, h, i0, i1, j0, j1, pd, ds);
          gemm_rm(true, false, cols, geo.d, rows, T(1), pd, cols, in.dout + q_off, geo.ld_q, T(1), dv + kv_off,
                  geo.ld_kv);
          gemm_rm(true, false, cols, geo.d, rows, T(1), ds, cols, in.q + q_off, geo.ld_q, T(1), dk + kv_off, geo.ld_kv);
        }
      }
    }
    // Query block n-1 sees the most keys: start it first.
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < n_blocks * geo.B * geo.N; ++task) {
      const int64_t bh = task % (geo.B * geo.N), b = bh / geo.N, h = bh % geo.N, g = h / geo.heads_per_group;
      const int64_t i0 = (n_blocks - 1 - task / (geo.B * geo.N)) * kBlock, i1 = std::min(geo.S, i0 + kBlock);
      backward_tiles(in, b, h, i0, i1, 0, i1, pd, ds);
      const int64_t q_off = geo.q_offset(i0, b, h);
      gemm_rm(false, false, i1 - i0, geo.d, i1, T(1), ds, i1, in.k + geo.kv_offset(0, b, g), geo.ld_kv, T(1),
              dq + q_off, geo.ld_q);
    }
  }
}

}  // namespace

template <typename T>
void attention_forward(T* out_SBNd, T* lse_BNS, const T* q_SBNd, const T* k_SBGd, const T* v_SBGd,
                       const AttentionDims& dims, const DropoutSpec& dropout) {
  check_args(dims, dropout, "attention_forward");
  const Geometry geo(dims);
  const int64_t n_blocks = geo.n_blocks();
  Scratch<T> scratch(kBlock * geo.S);
#pragma omp parallel for schedule(dynamic, 1) if (geo.parallel())
  for (int64_t task = 0; task < n_blocks * geo.B * geo.N; ++task) {
    const int64_t bh = task % (geo.B * geo.N), b = bh / geo.N, h = bh % geo.N;
    const int64_t i0 = (n_blocks - 1 - task / (geo.B * geo.N)) * kBlock;  // biggest blocks first
    const HeadDropout drop(dropout, geo, b, h);
    forward_block(out_SBNd, lse_BNS, q_SBNd, k_SBGd, v_SBGd, geo, dims.scale, drop, b, h, i0,
                  std::min(geo.S, i0 + kBlock), scratch.tile(0));
  }
}

template <typename T>
void attention_backward(T* dq_SBNd, T* dk_SBGd, T* dv_SBGd, const T* dout_SBNd, const T* q_SBNd, const T* k_SBGd,
                        const T* v_SBGd, const T* out_SBNd, const T* lse_BNS, const AttentionDims& dims,
                        const DropoutSpec& dropout) {
  check_args(dims, dropout, "attention_backward");
  const Geometry geo(dims);
  // rowsum(dP * P) = sum_j dPd_ij Pd_ij = dout_i . out_i, also with dropout (out is built from Pd).
  std::vector<T> delta_BNS(geo.B * geo.N * geo.S);
#pragma omp parallel for collapse(2) schedule(static) if (geo.parallel())
  for (int64_t i = 0; i < geo.S; ++i) {
    for (int64_t bh = 0; bh < geo.B * geo.N; ++bh) {
      const T* dout_row = dout_SBNd + i * geo.B * geo.N * geo.d + bh * geo.d;
      const T* out_row = out_SBNd + i * geo.B * geo.N * geo.d + bh * geo.d;
      double dot = 0.0;
      for (int64_t c = 0; c < geo.d; ++c) dot += static_cast<double>(dout_row[c]) * static_cast<double>(out_row[c]);
      delta_BNS[bh * geo.S + i] = static_cast<T>(dot);
    }
  }
  const BackwardInputs<T> in{dout_SBNd, q_SBNd, k_SBGd, v_SBGd, lse_BNS, delta_BNS.data(), geo, dims.scale, dropout};
  const int64_t n_threads = omp_get_max_threads();
  if (n_threads == 1 || geo.B * geo.G >= 2 * n_threads) {
    backward_by_group(dq_SBNd, dk_SBGd, dv_SBGd, in);
  } else {
    backward_by_block(dq_SBNd, dk_SBGd, dv_SBGd, in);
  }
}

#define MOECORE_ATTENTION_INSTANTIATE(T)                                                                              \
  template void attention_forward<T>(T*, T*, const T*, const T*, const T*, const AttentionDims&, const DropoutSpec&); \
  template void attention_backward<T>(T*, T*, T*, const T*, const T*, const T*, const T*, const T*, const T*,         \
                                      const AttentionDims&, const DropoutSpec&);
MOECORE_ATTENTION_INSTANTIATE(float)
MOECORE_ATTENTION_INSTANTIATE(double)
#undef MOECORE_ATTENTION_INSTANTIATE

}  // namespace moecore::kernels::cpu
