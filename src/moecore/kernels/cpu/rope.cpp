// Fast rotary embedding: the cos/sin table is built once per call ([S, rot_dim/2], fp32 recipe of rope.h),
// then all (s, b, n) head vectors are rotated in parallel.
#include "moecore/kernels/cpu/rope.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include "moecore/kernels/cpu/vector_isa.h"

namespace moecore::kernels::cpu {
namespace {

void check_rope_args(const int64_t head_dim, const int64_t rot_dim, const double base) {
  if (rot_dim < 0 || rot_dim > head_dim || rot_dim % 2 != 0) {
    throw std::invalid_argument("rope: rot_dim " + std::to_string(rot_dim) +
                                " must be even and in [0, head_dim=" + std::to_string(head_dim) + "]");
  }
  if (!(base > 0.0)) throw std::invalid_argument("rope: base " + std::to_string(base) + " must be positive");
}

// cos/sin of angle[s, i] = (s + offset) * inv_freq[i], everything in fp32 as Megatron computes it.
template <typename T>
struct RopeTable {
  std::vector<T> cos_SH;
  std::vector<T> sin_SH;
};

template <typename T>
RopeTable<T> make_table(const int64_t S, const int64_t half, const double base, const int64_t position_offset) {
  std::vector<float> inv_freq_H(static_cast<size_t>(half));
  for (int64_t i = 0; i < half; ++i) {
    const float exponent = static_cast<float>(2 * i) / static_cast<float>(2 * half);
    inv_freq_H[static_cast<size_t>(i)] = 1.0f / std::pow(static_cast<float>(base), exponent);
  }
  RopeTable<T> table{std::vector<T>(static_cast<size_t>(S * half)), std::vector<T>(static_cast<size_t>(S * half))};
#pragma omp parallel for schedule(static) if (S * half > 4096)
  for (int64_t s = 0; s < S; ++s) {
    const float position = static_cast<float>(s + position_offset);
    for (int64_t i = 0; i < half; ++i) {
      const float angle = position * inv_freq_H[static_cast<size_t>(i)];
      table.cos_SH[static_cast<size_t>(s * half + i)] = static_cast<T>(std::cos(angle));
      table.sin_SH[static_cast<size_t>(s * half + i)] = static_cast<T>(std::sin(angle));
    }
  }
  return table;
}

// One head vector, compiled per vector ISA.
template <typename T>
MOECORE_VECTOR_CLONES void rope_row(T* y, const T* x, const T* cos_H, const T* sin_H, const int64_t half,
                                    const int64_t rot_dim, const int64_t head_dim) {
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    const T x1 = x[i], x2 = x[i + half];
    y[i] = x1 * cos_H[i] - x2 * sin_H[i];
    y[i + half] = x2 * cos_H[i] + x1 * sin_H[i];
  }
  std::copy(x + rot_dim, x + head_dim, y + rot_dim);
}

// Transpose of the 2x2 rotation [[c, -s], [s, c]] acting on (x1, x2), accumulated into dx.
template <typename T>
MOECORE_VECTOR_CLONES void rope_row_backward(T* dx, const T* dy, const T* cos_H, const T* sin_H, const int64_t half,
                                             const int64_t rot_dim, const int64_t head_dim) {
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    const T dy1 = dy[i], dy2 = dy[i + half];
    dx[i] += dy1 * cos_H[i] + dy2 * sin_H[i];
    dx[i + half] += dy2 * cos_H[i] - dy1 * sin_H[i];
  }
#pragma omp simd
  for (int64_t c = rot_dim; c < head_dim; ++c) dx[c] += dy[c];
}

}  // namespace

template <typename T>
void rope_forward(T* out_SBNd, const T* inp_SBNd, const int64_t S, const int64_t B, const int64_t N,
                  const int64_t head_dim, const int64_t rot_dim, const double base, const int64_t position_offset) {
  check_rope_args(head_dim, rot_dim, base);
  const int64_t half = rot_dim / 2;
  const RopeTable<T> table = make_table<T>(S, half, base, position_offset);
  const int64_t heads_per_pos = B * N;
#pragma omp parallel for schedule(static) if (S * heads_per_pos * head_dim > 16384)
  for (int64_t row = 0; row < S * heads_per_pos; ++row) {
    const T* cos_H = table.cos_SH.data() + (row / heads_per_pos) * half;
    const T* sin_H = table.sin_SH.data() + (row / heads_per_pos) * half;
    rope_row(out_SBNd + row * head_dim, inp_SBNd + row * head_dim, cos_H, sin_H, half, rot_dim, head_dim);
  }
}

template <typename T>
void rope_backward(T* dinp_SBNd, const T* dout_SBNd, const int64_t S, const int64_t B, const int64_t N,
                   const int64_t head_dim, const int64_t rot_dim, const double base, const int64_t position_offset) {
  check_rope_args(head_dim, rot_dim, base);
  const int64_t half = rot_dim / 2;
  const RopeTable<T> table = make_table<T>(S, half, base, position_offset);
  const int64_t heads_per_pos = B * N;
#pragma omp parallel for schedule(static) if (S * heads_per_pos * head_dim > 16384)
  for (int64_t row = 0; row < S * heads_per_pos; ++row) {
    const T* cos_H = table.cos_SH.data() + (row / heads_per_pos) * half;
    const T* sin_H = table.sin_SH.data() + (row / heads_per_pos) * half;
    rope_row_backward(dinp_SBNd + row * head_dim, dout_SBNd + row * head_dim, cos_H, sin_H, half, rot_dim, head_dim);
  }
}

#define MOECORE_INSTANTIATE(T)                                                                               \
  template void rope_forward<T>(T*, const T*, int64_t, int64_t, int64_t, int64_t, int64_t, double, int64_t); \
  template void rope_backward<T>(T*, const T*, int64_t, int64_t, int64_t, int64_t, int64_t, double, int64_t);
MOECORE_INSTANTIATE(float)
MOECORE_INSTANTIATE(double)
#undef MOECORE_INSTANTIATE

}  // namespace moecore::kernels::cpu
