// Naive reference rotary embedding: every element computed straight from the formula in rope.h.
#include <cmath>
#include <stdexcept>
#include <string>

#include "moecore/kernels/cpu/rope.h"

namespace moecore::kernels::ref {
namespace {

void check_rope_args(const int64_t head_dim, const int64_t rot_dim, const double base) {
  if (rot_dim < 0 || rot_dim > head_dim || rot_dim % 2 != 0 || !(base > 0.0)) {
    throw std::invalid_argument("rope: bad rot_dim " + std::to_string(rot_dim) + " or base " + std::to_string(base));
  }
}

// Angle of frequency i (< rot_dim/2) at position p, in fp32 like torch:
// inv_freq = 1.0 / (base ** (arange(0, rot_dim, 2, fp32) / rot_dim)); angle = float(p) * inv_freq.
float angle(const int64_t position, const int64_t i, const int64_t rot_dim, const double base) {
  const float exponent = static_cast<float>(2 * i) / static_cast<float>(rot_dim);
  const float inv_freq = 1.0f / std::pow(static_cast<float>(base), exponent);
  return static_cast<float>(position) * inv_freq;
}

// One head vector at `position` (rope.h): y = x cos + rotate_half(x) sin over the first rot_dim channels.
template <typename T>
void rotate(T* y, const T* x, const int64_t position, const int64_t head_dim, const int64_t rot_dim,
            const double base) {
  const int64_t half = rot_dim / 2;
  for (int64_t c = 0; c < head_dim; ++c) {
    if (c >= rot_dim) {
      y[c] = x[c];
      continue;
    }
    const float a = angle(position, c % half, rot_dim, base);
    const T cos_a = static_cast<T>(std::cos(a)), sin_a = static_cast<T>(std::sin(a));
    const T rotated = c < half ? -x[c + half] : x[c - half];  // rotate_half([x1, x2]) = [-x2, x1]
    y[c] = x[c] * cos_a + rotated * sin_a;
  }
}

// dx += R^T dy: for c < half, dx[c] += dy[c] cos + dy[c+half] sin; for c >= half, dx[c] += dy[c] cos -
// dy[c-half] sin; pass-through channels add the gradient.
template <typename T>
void rotate_back(T* dx, const T* dy, const int64_t position, const int64_t head_dim, const int64_t rot_dim,
                 const double base) {
  const int64_t half = rot_dim / 2;
  for (int64_t c = 0; c < head_dim; ++c) {
    if (c >= rot_dim) {
      dx[c] += dy[c];
      continue;
    }
    const float a = angle(position, c % half, rot_dim, base);
    const T cos_a = static_cast<T>(std::cos(a)), sin_a = static_cast<T>(std::sin(a));
    const T partner = c < half ? dy[c + half] : -dy[c - half];
    dx[c] += dy[c] * cos_a + partner * sin_a;
  }
}

void check_positions(const int64_t* positions_SB, const int64_t n) {
  if (positions_SB == nullptr) throw std::invalid_argument("rope: positions_SB is null");
  for (int64_t r = 0; r < n; ++r) {
    if (positions_SB[r] < 0) throw std::invalid_argument("rope: negative position " + std::to_string(positions_SB[r]));
  }
}

}  // namespace

template <typename T>
void rope_forward(T* out_SBNd, const T* inp_SBNd, const int64_t S, const int64_t B, const int64_t N,
                  const int64_t head_dim, const int64_t rot_dim, const double base, const int64_t position_offset) {
  check_rope_args(head_dim, rot_dim, base);
  for (int64_t s = 0; s < S; ++s) {
    for (int64_t h = 0; h < B * N; ++h) {
      const int64_t at = (s * B * N + h) * head_dim;
      rotate(out_SBNd + at, inp_SBNd + at, s + position_offset, head_dim, rot_dim, base);
    }
  }
}

// y = R x with R block-diagonal rotations, so dx = R^T dy (rotate_back).
template <typename T>
void rope_backward(T* dinp_SBNd, const T* dout_SBNd, const int64_t S, const int64_t B, const int64_t N,
                   const int64_t head_dim, const int64_t rot_dim, const double base, const int64_t position_offset) {
  check_rope_args(head_dim, rot_dim, base);
  for (int64_t s = 0; s < S; ++s) {
    for (int64_t h = 0; h < B * N; ++h) {
      const int64_t at = (s * B * N + h) * head_dim;
      rotate_back(dinp_SBNd + at, dout_SBNd + at, s + position_offset, head_dim, rot_dim, base);
    }
  }
}

template <typename T>
void rope_forward(T* out_SBNd, const T* inp_SBNd, const int64_t S, const int64_t B, const int64_t N,
                  const int64_t head_dim, const int64_t rot_dim, const double base, const int64_t* positions_SB) {
  check_rope_args(head_dim, rot_dim, base);
  check_positions(positions_SB, S * B);
  for (int64_t s = 0; s < S; ++s) {
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t n = 0; n < N; ++n) {
        const int64_t at = ((s * B + b) * N + n) * head_dim;
        rotate(out_SBNd + at, inp_SBNd + at, positions_SB[s * B + b], head_dim, rot_dim, base);
      }
    }
  }
}

template <typename T>
void rope_backward(T* dinp_SBNd, const T* dout_SBNd, const int64_t S, const int64_t B, const int64_t N,
                   const int64_t head_dim, const int64_t rot_dim, const double base, const int64_t* positions_SB) {
  check_rope_args(head_dim, rot_dim, base);
  check_positions(positions_SB, S * B);
  for (int64_t s = 0; s < S; ++s) {
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t n = 0; n < N; ++n) {
        const int64_t at = ((s * B + b) * N + n) * head_dim;
        rotate_back(dinp_SBNd + at, dout_SBNd + at, positions_SB[s * B + b], head_dim, rot_dim, base);
      }
    }
  }
}

#define MOECORE_INSTANTIATE(T)                                                                                      \
  template void rope_forward<T>(T*, const T*, int64_t, int64_t, int64_t, int64_t, int64_t, double, int64_t);        \
  template void rope_backward<T>(T*, const T*, int64_t, int64_t, int64_t, int64_t, int64_t, double, int64_t);       \
  template void rope_forward<T>(T*, const T*, int64_t, int64_t, int64_t, int64_t, int64_t, double, const int64_t*); \
  template void rope_backward<T>(T*, const T*, int64_t, int64_t, int64_t, int64_t, int64_t, double, const int64_t*);
MOECORE_INSTANTIATE(float)
MOECORE_INSTANTIATE(double)
#undef MOECORE_INSTANTIATE

}  // namespace moecore::kernels::ref
