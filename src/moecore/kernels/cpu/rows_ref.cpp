// Naive references of rows.h: one element at a time, serial, in the order of the definitions.
#include <cmath>
#include <cstdint>

#include "moecore/kernels/cpu/rows.h"

namespace moecore::kernels::ref {

template <typename T>
void split_qkv(T* q_TNd, T* k_TGd, T* v_TGd, const T* qkv_TQ, const int64_t n_tokens, const int64_t N, const int64_t G,
               const int64_t d) {
  const int64_t per_group = N / G, Q = (N + 2 * G) * d;
  for (int64_t t = 0; t < n_tokens; ++t) {
    for (int64_t g = 0; g < G; ++g) {
      const int64_t base = t * Q + g * (per_group + 2) * d;
      for (int64_t j = 0; j < per_group; ++j) {
        for (int64_t c = 0; c < d; ++c) q_TNd[(t * N + g * per_group + j) * d + c] = qkv_TQ[base + j * d + c];
      }
      for (int64_t c = 0; c < d; ++c) {
        k_TGd[(t * G + g) * d + c] = qkv_TQ[base + per_group * d + c];
        v_TGd[(t * G + g) * d + c] = qkv_TQ[base + (per_group + 1) * d + c];
      }
    }
  }
}

template <typename T>
void copy_columns(T* dst, const int64_t dst_width, const int64_t dst_col, const T* src, const int64_t src_width,
                  const int64_t src_col, const int64_t R, const int64_t width, const bool accumulate) {
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t c = 0; c < width; ++c) {
      T& out = dst[r * dst_width + dst_col + c];
      out = (accumulate ? out : T(0)) + src[r * src_width + src_col + c];
    }
  }
}

template <typename T>
void merge_qkv(T* qkv_TQ, const T* q_TNd, const T* k_TGd, const T* v_TGd, const int64_t n_tokens, const int64_t N,
               const int64_t G, const int64_t d) {
  const int64_t per_group = N / G, Q = (N + 2 * G) * d;
  for (int64_t t = 0; t < n_tokens; ++t) {
    for (int64_t g = 0; g < G; ++g) {
      const int64_t base = t * Q + g * (per_group + 2) * d;
      for (int64_t j = 0; j < per_group; ++j) {
        for (int64_t c = 0; c < d; ++c) qkv_TQ[base + j * d + c] = q_TNd[(t * N + g * per_group + j) * d + c];
      }
      for (int64_t c = 0; c < d; ++c) {
        qkv_TQ[base + per_group * d + c] = k_TGd[(t * G + g) * d + c];
        qkv_TQ[base + (per_group + 1) * d + c] = v_TGd[(t * G + g) * d + c];
      }
    }
  }
}

template <typename T>
void add_bias_rows(T* y_RW, const T* bias_W, const int64_t R, const int64_t W) {
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t w = 0; w < W; ++w) y_RW[r * W + w] += bias_W[w];
  }
}

template <typename T>
void bias_grad_rows(T* dbias_W, const T* dy_RW, const int64_t R, const int64_t W) {
  for (int64_t w = 0; w < W; ++w) {
    double sum = 0.0;
    for (int64_t r = 0; r < R; ++r) sum += static_cast<double>(dy_RW[r * W + w]);
    dbias_W[w] += static_cast<T>(sum);
  }
}

template <typename T>
void scale_rows(T* out_RW, const T* x_RW, const T* s_R, const int64_t R, const int64_t W) {
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t w = 0; w < W; ++w) out_RW[r * W + w] = x_RW[r * W + w] * s_R[r];
  }
}

template <typename T>
void scale_rows_backward(T* dx_RW, T* ds_R, const T* dout_RW, const T* x_RW, const T* s_R, const int64_t R,
                         const int64_t W) {
  for (int64_t r = 0; r < R; ++r) {
    double ds = 0.0;
    for (int64_t w = 0; w < W; ++w) {
      ds += static_cast<double>(dout_RW[r * W + w]) * static_cast<double>(x_RW[r * W + w]);
      if (dx_RW != nullptr) dx_RW[r * W + w] += dout_RW[r * W + w] * s_R[r];
    }
    if (ds_R != nullptr) ds_R[r] = static_cast<T>(ds);
  }
}

template <typename T>
void add_outer(T* y_RW, const T* s_R, const T* b_W, const int64_t R, const int64_t W) {
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t w = 0; w < W; ++w) y_RW[r * W + w] += s_R[r] * b_W[w];
  }
}

template <typename T>
void add_outer_backward(T* ds_R, T* db_W, const T* dy_RW, const T* s_R, const T* b_W, const int64_t R,
                        const int64_t W) {
  for (int64_t r = 0; r < R && ds_R != nullptr; ++r) {
    double ds = 0.0;
    for (int64_t w = 0; w < W; ++w) ds += static_cast<double>(dy_RW[r * W + w]) * static_cast<double>(b_W[w]);
    ds_R[r] += static_cast<T>(ds);
  }
  for (int64_t w = 0; w < W && db_W != nullptr; ++w) {
    for (int64_t r = 0; r < R; ++r) db_W[w] += s_R[r] * dy_RW[r * W + w];
  }
}

template <typename T>
void row_dot(T* out_R, const T* x_RW, const T* w_W, const int64_t R, const int64_t W) {
  for (int64_t r = 0; r < R; ++r) {
    double sum = 0.0;
    for (int64_t w = 0; w < W; ++w) sum += static_cast<double>(x_RW[r * W + w]) * static_cast<double>(w_W[w]);
    out_R[r] = static_cast<T>(sum);
  }
}

template <typename T>
void sigmoid_forward(T* out, const T* x, const int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<T>(1.0 / (1.0 + std::exp(-static_cast<double>(x[i]))));
}

template <typename T>
void sigmoid_backward(T* dx, const T* dout, const T* y, const int64_t n) {
  for (int64_t i = 0; i < n; ++i) dx[i] += dout[i] * y[i] * (T(1) - y[i]);
}

template <typename T>
void gather_rows(T* out_RW, const T* in_NW, const int64_t* index_R, const int64_t R, const int64_t /*N*/,
                 const int64_t W) {
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t w = 0; w < W; ++w) out_RW[r * W + w] = index_R[r] < 0 ? T(0) : in_NW[index_R[r] * W + w];
  }
}

template <typename T>
void scatter_add_rows(T* out_NW, const T* in_RW, const int64_t* index_R, const int64_t R, const int64_t /*N*/,
                      const int64_t W) {
  for (int64_t r = 0; r < R; ++r) {
    if (index_R[r] < 0) continue;
    for (int64_t w = 0; w < W; ++w) out_NW[index_R[r] * W + w] += in_RW[r * W + w];
  }
}

template <typename T>
void add_position_embedding(T* x_TH, const T* pos_PH, const int64_t n_tokens, const int64_t B, const int64_t H,
                            const int64_t row_offset) {
  for (int64_t t = 0; t < n_tokens; ++t) {
    for (int64_t h = 0; h < H; ++h) x_TH[t * H + h] += pos_PH[((row_offset + t) / B) * H + h];
  }
}

template <typename T>
void position_embedding_backward(T* dpos_PH, const T* dx_TH, const int64_t n_tokens, const int64_t B, const int64_t H,
                                 const int64_t row_offset) {
  for (int64_t t = 0; t < n_tokens; ++t) {
    for (int64_t h = 0; h < H; ++h) dpos_PH[((row_offset + t) / B) * H + h] += dx_TH[t * H + h];
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

}  // namespace moecore::kernels::ref
