// Fast rotary embedding: the cos/sin table is built once per call ([S, rot_dim/2], fp32 recipe of rope.h and
// rotary_frequencies.h; with per-row positions one row per position in their range, or one per (s, b) when that
// range is longer), then all (s, b, n) head vectors are rotated in parallel.
#include "moecore/kernels/cpu/rope.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include "moecore/kernels/cpu/vector_isa.h"

namespace moecore::kernels::cpu {
namespace {

void check_spec(const RopeSpec& spec) {
  if (spec.rot_dim() > spec.head_dim) {
    throw std::invalid_argument("rope: rot_dim " + std::to_string(spec.rot_dim()) + " exceeds head_dim " +
                                std::to_string(spec.head_dim));
  }
}

// Positions of rows (s, b): present and >= 0.
void check_positions(const int64_t* positions_SB, const int64_t n) {
  if (positions_SB == nullptr) throw std::invalid_argument("rope: positions_SB is null");
  for (int64_t r = 0; r < n; ++r) {
    if (positions_SB[r] < 0) {
      throw std::invalid_argument("rope: positions_SB[" + std::to_string(r) + "] = " + std::to_string(positions_SB[r]) +
                                  " is negative");
    }
  }
}

// cos/sin of angle[r, i] = position(r) * inv_freq[i] for table rows r < n_rows, times the attention factor,
// everything in fp32 as Megatron computes it ((cos(freqs) * mscale).to(dtype)).
template <typename T>
struct RopeTable {
  std::vector<T> cos_SH;
  std::vector<T> sin_SH;
};

template <typename T, typename PositionOf>
RopeTable<T> make_table(const int64_t S, const RopeSpec& spec, PositionOf position_of) {
  const int64_t half = spec.rot_dim() / 2;
  const float factor = spec.attention_factor;
  RopeTable<T> table{std::vector<T>(static_cast<size_t>(S * half)), std::vector<T>(static_cast<size_t>(S * half))};
#pragma omp parallel for schedule(static) if (S * half > 4096)
  for (int64_t s = 0; s < S; ++s) {
    const float position = static_cast<float>(position_of(s));
    for (int64_t i = 0; i < half; ++i) {
      const float angle = position * spec.inv_freq[static_cast<size_t>(i)];
      table.cos_SH[static_cast<size_t>(s * half + i)] = static_cast<T>(std::cos(angle) * factor);
      table.sin_SH[static_cast<size_t>(s * half + i)] = static_cast<T>(std::sin(angle) * factor);
    }
  }
  return table;
}

// The table for per-row positions: row position - first for every position in [first, last] when that range is no
// longer than the S * B rows, else row s * B + b for row (s, b).
template <typename T>
struct PositionsTable {
  PositionsTable(const int64_t* positions_SB, const int64_t rows, const RopeSpec& spec) : positions(positions_SB) {
    const auto [lo, hi] = std::minmax_element(positions_SB, positions_SB + rows);
    by_position = rows > 0 && *hi - *lo < rows;
    first = rows > 0 ? *lo : 0;
    if (by_position) {
      table = make_table<T>(*hi - *lo + 1, spec, [this](const int64_t r) { return first + r; });
    } else {
      table = make_table<T>(rows, spec, [positions_SB](const int64_t r) { return positions_SB[r]; });
    }
  }
  int64_t row_of(const int64_t sb) const { return by_position ? positions[sb] - first : sb; }

  const int64_t* positions;
  int64_t first = 0;
  bool by_position = false;
  RopeTable<T> table;
};

// One head vector, compiled per vector ISA. Pair i is (x[i], x[i + half]), or (x[2i], x[2i + 1]) in multi-latent
// attention's layout; the output is always in halves.
template <typename T>
MOECORE_VECTOR_CLONES void rope_row(T* y, const T* x, const T* cos_H, const T* sin_H, const int64_t half,
                                    const int64_t rot_dim, const int64_t head_dim, const bool interleaved) {
  if (interleaved) {
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
      const T x1 = x[2 * i], x2 = x[2 * i + 1];
      y[i] = x1 * cos_H[i] - x2 * sin_H[i];
      y[i + half] = x2 * cos_H[i] + x1 * sin_H[i];
    }
  } else {
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
      const T x1 = x[i], x2 = x[i + half];
      y[i] = x1 * cos_H[i] - x2 * sin_H[i];
      y[i + half] = x2 * cos_H[i] + x1 * sin_H[i];
    }
  }
  std::copy(x + rot_dim, x + head_dim, y + rot_dim);
}

// Transpose of the 2x2 rotation [[c, -s], [s, c]] acting on (x1, x2), accumulated into dx.
template <typename T>
MOECORE_VECTOR_CLONES void rope_row_backward(T* dx, const T* dy, const T* cos_H, const T* sin_H, const int64_t half,
                                             const int64_t rot_dim, const int64_t head_dim, const bool interleaved) {
  if (interleaved) {
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
      const T dy1 = dy[i], dy2 = dy[i + half];
      dx[2 * i] += dy1 * cos_H[i] + dy2 * sin_H[i];
      dx[2 * i + 1] += dy2 * cos_H[i] - dy1 * sin_H[i];
    }
  } else {
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
      const T dy1 = dy[i], dy2 = dy[i + half];
      dx[i] += dy1 * cos_H[i] + dy2 * sin_H[i];
      dx[i + half] += dy2 * cos_H[i] - dy1 * sin_H[i];
    }
  }
#pragma omp simd
  for (int64_t c = rot_dim; c < head_dim; ++c) dx[c] += dy[c];
}

}  // namespace

template <typename T>
void rope_forward(T* out_SBNd, const T* inp_SBNd, const int64_t S, const int64_t B, const int64_t N,
                  const RopeSpec& spec, const int64_t position_offset) {
  check_spec(spec);
  const int64_t half = spec.rot_dim() / 2, head_dim = spec.head_dim;
  const RopeTable<T> table = make_table<T>(S, spec, [position_offset](const int64_t s) { return s + position_offset; });
  const int64_t heads_per_pos = B * N;
#pragma omp parallel for schedule(static) if (S * heads_per_pos * head_dim > 16384)
  for (int64_t row = 0; row < S * heads_per_pos; ++row) {
    const T* cos_H = table.cos_SH.data() + (row / heads_per_pos) * half;
    const T* sin_H = table.sin_SH.data() + (row / heads_per_pos) * half;
    rope_row(out_SBNd + row * head_dim, inp_SBNd + row * head_dim, cos_H, sin_H, half, 2 * half, head_dim,
             spec.mla_interleaved);
  }
}

template <typename T>
void rope_backward(T* dinp_SBNd, const T* dout_SBNd, const int64_t S, const int64_t B, const int64_t N,
                   const RopeSpec& spec, const int64_t position_offset) {
  check_spec(spec);
  const int64_t half = spec.rot_dim() / 2, head_dim = spec.head_dim;
  const RopeTable<T> table = make_table<T>(S, spec, [position_offset](const int64_t s) { return s + position_offset; });
  const int64_t heads_per_pos = B * N;
#pragma omp parallel for schedule(static) if (S * heads_per_pos * head_dim > 16384)
  for (int64_t row = 0; row < S * heads_per_pos; ++row) {
    const T* cos_H = table.cos_SH.data() + (row / heads_per_pos) * half;
    const T* sin_H = table.sin_SH.data() + (row / heads_per_pos) * half;
    rope_row_backward(dinp_SBNd + row * head_dim, dout_SBNd + row * head_dim, cos_H, sin_H, half, 2 * half, head_dim,
                      spec.mla_interleaved);
  }
}

template <typename T>
void rope_forward(T* out_SBNd, const T* inp_SBNd, const int64_t S, const int64_t B, const int64_t N,
                  const RopeSpec& spec, const int64_t* positions_SB) {
  check_spec(spec);
  check_positions(positions_SB, S * B);
  const int64_t half = spec.rot_dim() / 2, head_dim = spec.head_dim;
  const PositionsTable<T> table(positions_SB, S * B, spec);
#pragma omp parallel for schedule(static) if (S * B * N * head_dim > 16384)
  for (int64_t row = 0; row < S * B * N; ++row) {
    const int64_t at = table.row_of(row / N) * half;
    rope_row(out_SBNd + row * head_dim, inp_SBNd + row * head_dim, table.table.cos_SH.data() + at,
             table.table.sin_SH.data() + at, half, 2 * half, head_dim, spec.mla_interleaved);
  }
}

template <typename T>
void rope_backward(T* dinp_SBNd, const T* dout_SBNd, const int64_t S, const int64_t B, const int64_t N,
                   const RopeSpec& spec, const int64_t* positions_SB) {
  check_spec(spec);
  check_positions(positions_SB, S * B);
  const int64_t half = spec.rot_dim() / 2, head_dim = spec.head_dim;
  const PositionsTable<T> table(positions_SB, S * B, spec);
#pragma omp parallel for schedule(static) if (S * B * N * head_dim > 16384)
  for (int64_t row = 0; row < S * B * N; ++row) {
    const int64_t at = table.row_of(row / N) * half;
    rope_row_backward(dinp_SBNd + row * head_dim, dout_SBNd + row * head_dim, table.table.cos_SH.data() + at,
                      table.table.sin_SH.data() + at, half, 2 * half, head_dim, spec.mla_interleaved);
  }
}

#define MOECORE_INSTANTIATE(T)                                                                             \
  template void rope_forward<T>(T*, const T*, int64_t, int64_t, int64_t, const RopeSpec&, int64_t);        \
  template void rope_backward<T>(T*, const T*, int64_t, int64_t, int64_t, const RopeSpec&, int64_t);       \
  template void rope_forward<T>(T*, const T*, int64_t, int64_t, int64_t, const RopeSpec&, const int64_t*); \
  template void rope_backward<T>(T*, const T*, int64_t, int64_t, int64_t, const RopeSpec&, const int64_t*);
MOECORE_INSTANTIATE(float)
MOECORE_INSTANTIATE(double)
#undef MOECORE_INSTANTIATE

}  // namespace moecore::kernels::cpu
