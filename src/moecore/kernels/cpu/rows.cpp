// Row-wise kernels (OpenMP over rows; SIMD within a row). Every row's result is computed the same way whatever the
// thread count, so results are reproducible bit for bit.
#include "moecore/kernels/cpu/rows.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "moecore/kernels/cpu/rows_by_destination.h"

namespace moecore::kernels::cpu {
namespace {
constexpr int64_t kParallelMin = 16384;
}  // namespace

template <typename T>
void split_qkv(T* q_TNd, T* k_TGd, T* v_TGd, const T* qkv_TQ, const int64_t n_tokens, const int64_t N, const int64_t G,
               const int64_t d) {
  const int64_t per_group = N / G, Q = (N + 2 * G) * d;
#pragma omp parallel for schedule(static) if (n_tokens * Q > kParallelMin)
  for (int64_t t = 0; t < n_tokens; ++t) {
    const T* src = qkv_TQ + t * Q;
    for (int64_t g = 0; g < G; ++g) {
      const T* group = src + g * (per_group + 2) * d;
      std::memcpy(q_TNd + (t * N + g * per_group) * d, group, sizeof(T) * static_cast<size_t>(per_group * d));
      std::memcpy(k_TGd + (t * G + g) * d, group + per_group * d, sizeof(T) * static_cast<size_t>(d));
      std::memcpy(v_TGd + (t * G + g) * d, group + (per_group + 1) * d, sizeof(T) * static_cast<size_t>(d));
    }
  }
}

template <typename T>
void copy_columns(T* dst, const int64_t dst_width, const int64_t dst_col, const T* src, const int64_t src_width,
                  const int64_t src_col, const int64_t R, const int64_t width, const bool accumulate) {
#pragma omp parallel for schedule(static) if (R * width > kParallelMin)
  for (int64_t r = 0; r < R; ++r) {
    T* out = dst + r * dst_width + dst_col;
    const T* in = src + r * src_width + src_col;
    if (accumulate) {
      for (int64_t c = 0; c < width; ++c) out[c] += in[c];
    } else {
      std::memcpy(out, in, sizeof(T) * static_cast<size_t>(width));
    }
  }
}

template <typename T>
void merge_qkv(T* qkv_TQ, const T* q_TNd, const T* k_TGd, const T* v_TGd, const int64_t n_tokens, const int64_t N,
               const int64_t G, const int64_t d) {
  const int64_t per_group = N / G, Q = (N + 2 * G) * d;
#pragma omp parallel for schedule(static) if (n_tokens * Q > kParallelMin)
  for (int64_t t = 0; t < n_tokens; ++t) {
    T* dst = qkv_TQ + t * Q;
    for (int64_t g = 0; g < G; ++g) {
      T* group = dst + g * (per_group + 2) * d;
      std::memcpy(group, q_TNd + (t * N + g * per_group) * d, sizeof(T) * static_cast<size_t>(per_group * d));
      std::memcpy(group + per_group * d, k_TGd + (t * G + g) * d, sizeof(T) * static_cast<size_t>(d));
      std::memcpy(group + (per_group + 1) * d, v_TGd + (t * G + g) * d, sizeof(T) * static_cast<size_t>(d));
    }
  }
}

template <typename T>
void add_bias_rows(T* y_RW, const T* bias_W, const int64_t R, const int64_t W) {
#pragma omp parallel for schedule(static) if (R * W > kParallelMin)
  for (int64_t r = 0; r < R; ++r) {
    T* y = y_RW + r * W;
#pragma omp simd
    for (int64_t w = 0; w < W; ++w) y[w] += bias_W[w];
  }
}

template <typename T>
void bias_grad_rows(T* dbias_W, const T* dy_RW, const int64_t R, const int64_t W) {
#pragma omp parallel for schedule(static) if (R * W > kParallelMin)
  for (int64_t w = 0; w < W; ++w) {
    double sum = 0.0;
    for (int64_t r = 0; r < R; ++r) sum += static_cast<double>(dy_RW[r * W + w]);
    dbias_W[w] += static_cast<T>(sum);
  }
}

template <typename T>
void scale_rows(T* out_RW, const T* x_RW, const T* s_R, const int64_t R, const int64_t W) {
#pragma omp parallel for schedule(static) if (R * W > kParallelMin)
  for (int64_t r = 0; r < R; ++r) {
    const T s = s_R[r];
#pragma omp simd
    for (int64_t w = 0; w < W; ++w) out_RW[r * W + w] = x_RW[r * W + w] * s;
  }
}

template <typename T>
void scale_rows_backward(T* dx_RW, T* ds_R, const T* dout_RW, const T* x_RW, const T* s_R, const int64_t R,
                         const int64_t W) {
#pragma omp parallel for schedule(static) if (R * W > kParallelMin)
  for (int64_t r = 0; r < R; ++r) {
    const T* dout = dout_RW + r * W;
    if (ds_R != nullptr) {
      const T* x = x_RW + r * W;
      double ds = 0.0;
      for (int64_t w = 0; w < W; ++w) ds += static_cast<double>(dout[w]) * static_cast<double>(x[w]);
      ds_R[r] = static_cast<T>(ds);
    }
    if (dx_RW != nullptr) {
      T* dx = dx_RW + r * W;
      const T s = s_R[r];
#pragma omp simd
      for (int64_t w = 0; w < W; ++w) dx[w] += dout[w] * s;
    }
  }
}

template <typename T>
void add_outer(T* y_RW, const T* s_R, const T* b_W, const int64_t R, const int64_t W) {
#pragma omp parallel for schedule(static) if (R * W > kParallelMin)
  for (int64_t r = 0; r < R; ++r) {
    const T s = s_R[r];
#pragma omp simd
    for (int64_t w = 0; w < W; ++w) y_RW[r * W + w] += s * b_W[w];
  }
}

template <typename T>
void add_outer_backward(T* ds_R, T* db_W, const T* dy_RW, const T* s_R, const T* b_W, const int64_t R,
                        const int64_t W) {
  if (ds_R != nullptr) {
#pragma omp parallel for schedule(static) if (R * W > kParallelMin)
    for (int64_t r = 0; r < R; ++r) {
      double ds = 0.0;
      for (int64_t w = 0; w < W; ++w) ds += static_cast<double>(dy_RW[r * W + w]) * static_cast<double>(b_W[w]);
      ds_R[r] += static_cast<T>(ds);
    }
  }
  if (db_W != nullptr) {
#pragma omp parallel for schedule(static) if (R * W > kParallelMin)
    for (int64_t w = 0; w < W; ++w) {
      for (int64_t r = 0; r < R; ++r) db_W[w] += s_R[r] * dy_RW[r * W + w];
    }
  }
}

template <typename T>
void row_dot(T* out_R, const T* x_RW, const T* w_W, const int64_t R, const int64_t W) {
#pragma omp parallel for schedule(static) if (R * W > kParallelMin)
  for (int64_t r = 0; r < R; ++r) {
    double sum = 0.0;
    for (int64_t w = 0; w < W; ++w) sum += static_cast<double>(x_RW[r * W + w]) * static_cast<double>(w_W[w]);
    out_R[r] = static_cast<T>(sum);
  }
}

template <typename T>
void sigmoid_forward(T* out, const T* x, const int64_t n) {
#pragma omp parallel for simd schedule(static) if (n > kParallelMin)
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<T>(1.0 / (1.0 + std::exp(-static_cast<double>(x[i]))));
}

template <typename T>
void sigmoid_backward(T* dx, const T* dout, const T* y, const int64_t n) {
#pragma omp parallel for simd schedule(static) if (n > kParallelMin)
  for (int64_t i = 0; i < n; ++i) dx[i] += dout[i] * y[i] * (T(1) - y[i]);
}

template <typename T>
void gather_rows(T* out_RW, const T* in_NW, const int64_t* index_R, const int64_t R, const int64_t /*N*/,
                 const int64_t W) {
#pragma omp parallel for schedule(static) if (R * W > kParallelMin)
  for (int64_t r = 0; r < R; ++r) {
    T* out = out_RW + r * W;
    if (index_R[r] < 0) {
      std::fill_n(out, W, T(0));
    } else {
      std::memcpy(out, in_NW + index_R[r] * W, sizeof(T) * static_cast<size_t>(W));
    }
  }
}

template <typename T>
void scatter_add_rows(T* out_NW, const T* in_RW, const int64_t* index_R, const int64_t R, const int64_t N,
                      const int64_t W) {
  if (R * W <= kParallelMin) {  // one thread: the rows in ascending r, without the pass over all N destinations
    for (int64_t r = 0; r < R; ++r) {
      if (index_R[r] < 0) continue;
      T* out = out_NW + index_R[r] * W;
      const T* row = in_RW + r * W;
#pragma omp simd
      for (int64_t w = 0; w < W; ++w) out[w] += row[w];
    }
    return;
  }
  const detail::RowsByDestination by_destination = detail::rows_by_destination(index_R, R, N);
  const std::vector<int64_t>& begin_N1 = by_destination.begin_N1;
  const std::vector<int64_t>& rows = by_destination.rows;
#pragma omp parallel for schedule(static) if (N * W > kParallelMin)
  for (int64_t n = 0; n < N; ++n) {
    T* out = out_NW + n * W;
    for (int64_t i = begin_N1[n]; i < begin_N1[n + 1]; ++i) {
      const T* row = in_RW + rows[static_cast<size_t>(i)] * W;
#pragma omp simd
      for (int64_t w = 0; w < W; ++w) out[w] += row[w];
    }
  }
}

template <typename T>
void add_position_embedding(T* x_TH, const T* pos_PH, const int64_t n_tokens, const int64_t B, const int64_t H,
                            const int64_t row_offset) {
#pragma omp parallel for schedule(static) if (n_tokens * H > kParallelMin)
  for (int64_t t = 0; t < n_tokens; ++t) {
    const T* pos = pos_PH + ((row_offset + t) / B) * H;
#pragma omp simd
    for (int64_t h = 0; h < H; ++h) x_TH[t * H + h] += pos[h];
  }
}

template <typename T>
void position_embedding_backward(T* dpos_PH, const T* dx_TH, const int64_t n_tokens, const int64_t B, const int64_t H,
                                 const int64_t row_offset) {
  // Positions own disjoint rows of dpos: parallel over positions, tokens of one position in order.
  const int64_t s_begin = row_offset / B, s_end = (row_offset + n_tokens + B - 1) / B;
#pragma omp parallel for schedule(static) if (n_tokens * H > kParallelMin)
  for (int64_t s = s_begin; s < s_end; ++s) {
    const int64_t t_begin = std::max<int64_t>(s * B - row_offset, 0);
    const int64_t t_end = std::min<int64_t>((s + 1) * B - row_offset, n_tokens);
    for (int64_t t = t_begin; t < t_end; ++t) {
#pragma omp simd
      for (int64_t h = 0; h < H; ++h) dpos_PH[s * H + h] += dx_TH[t * H + h];
    }
  }
}

#define MOECORE_INSTANTIATE(T)                                                                             \
  template void split_qkv<T>(T*, T*, T*, const T*, int64_t, int64_t, int64_t, int64_t);                    \
  template void merge_qkv<T>(T*, const T*, const T*, const T*, int64_t, int64_t, int64_t, int64_t);        \
  template void copy_columns<T>(T*, int64_t, int64_t, const T*, int64_t, int64_t, int64_t, int64_t, bool); \
  template void add_bias_rows<T>(T*, const T*, int64_t, int64_t);                                          \
  template void bias_grad_rows<T>(T*, const T*, int64_t, int64_t);                                         \
  template void scale_rows<T>(T*, const T*, const T*, int64_t, int64_t);                                   \
  template void scale_rows_backward<T>(T*, T*, const T*, const T*, const T*, int64_t, int64_t);            \
  template void add_outer<T>(T*, const T*, const T*, int64_t, int64_t);                                    \
  template void add_outer_backward<T>(T*, T*, const T*, const T*, const T*, int64_t, int64_t);             \
  template void row_dot<T>(T*, const T*, const T*, int64_t, int64_t);                                      \
  template void sigmoid_forward<T>(T*, const T*, int64_t);                                                 \
  template void sigmoid_backward<T>(T*, const T*, const T*, int64_t);                                      \
  template void gather_rows<T>(T*, const T*, const int64_t*, int64_t, int64_t, int64_t);                   \
  template void scatter_add_rows<T>(T*, const T*, const int64_t*, int64_t, int64_t, int64_t);              \
  template void add_position_embedding<T>(T*, const T*, int64_t, int64_t, int64_t, int64_t);               \
  template void position_embedding_backward<T>(T*, const T*, int64_t, int64_t, int64_t, int64_t);
MOECORE_INSTANTIATE(float)
MOECORE_INSTANTIATE(double)
#undef MOECORE_INSTANTIATE

// The row moves on 16-bit bits (rows.h).
template void split_qkv<uint16_t>(uint16_t*, uint16_t*, uint16_t*, const uint16_t*, int64_t, int64_t, int64_t, int64_t);
template void merge_qkv<uint16_t>(uint16_t*, const uint16_t*, const uint16_t*, const uint16_t*, int64_t, int64_t,
                                  int64_t, int64_t);
template void gather_rows<uint16_t>(uint16_t*, const uint16_t*, const int64_t*, int64_t, int64_t, int64_t);

}  // namespace moecore::kernels::cpu
