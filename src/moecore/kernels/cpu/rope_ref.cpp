// Naive reference rotary embedding: every element computed straight from the formula in rope.h.
#include <cmath>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "moecore/kernels/cpu/rope.h"

namespace moecore::kernels::ref {
namespace {

// cos and sin of frequency i at position p, in fp32 like torch: angle = float(p) * inv_freq[i];
// (cos(angle) * factor, sin(angle) * factor).
template <typename T>
std::pair<T, T> cos_sin(const RopeSpec& spec, const int64_t position, const int64_t i) {
  const float angle = static_cast<float>(position) * spec.inv_freq[static_cast<size_t>(i)];
  return {static_cast<T>(std::cos(angle) * spec.attention_factor),
          static_cast<T>(std::sin(angle) * spec.attention_factor)};
}

// The rotated channels in halves order: multi-latent attention's layout takes channel 2i to i and 2i+1 to
// i + rot_dim/2 (torch.cat((t[..., 0::2], t[..., 1::2]))).
int64_t source_channel(const RopeSpec& spec, const int64_t c) {
  const int64_t half = spec.rot_dim() / 2;
  if (!spec.mla_interleaved || c >= spec.rot_dim()) return c;
  return c < half ? 2 * c : 2 * (c - half) + 1;
}

// One head vector at `position` (rope.h): y = x cos + rotate_half(x) sin over the first rot_dim channels.
template <typename T>
void rotate(T* y, const T* x_in, const int64_t position, const RopeSpec& spec) {
  const int64_t half = spec.rot_dim() / 2, head_dim = spec.head_dim;
  std::vector<T> x(static_cast<size_t>(head_dim));
  for (int64_t c = 0; c < head_dim; ++c) x[static_cast<size_t>(c)] = x_in[source_channel(spec, c)];
  for (int64_t c = 0; c < head_dim; ++c) {
    if (c >= spec.rot_dim()) {
      y[c] = x[static_cast<size_t>(c)];
      continue;
    }
    const auto [cos_a, sin_a] = cos_sin<T>(spec, position, c % half);
    const T rotated = c < half ? -x[static_cast<size_t>(c + half)] : x[static_cast<size_t>(c - half)];
    y[c] = x[static_cast<size_t>(c)] * cos_a + rotated * sin_a;
  }
}

// dx += R^T dy: for c < half, g[c] = dy[c] cos + dy[c+half] sin; for c >= half, g[c] = dy[c] cos - dy[c-half] sin;
// pass-through channels pass the gradient; g goes back to the channel each rotated channel came from.
template <typename T>
void rotate_back(T* dx, const T* dy, const int64_t position, const RopeSpec& spec) {
  const int64_t half = spec.rot_dim() / 2, head_dim = spec.head_dim;
  for (int64_t c = 0; c < head_dim; ++c) {
    if (c >= spec.rot_dim()) {
      dx[c] += dy[c];
      continue;
    }
    const auto [cos_a, sin_a] = cos_sin<T>(spec, position, c % half);
    const T partner = c < half ? dy[c + half] : -dy[c - half];
    dx[source_channel(spec, c)] += dy[c] * cos_a + partner * sin_a;
  }
}

void check_positions(const int64_t* positions_SB, const int64_t n) {
  if (positions_SB == nullptr) throw std::invalid_argument("rope: positions_SB is null");
  for (int64_t r = 0; r < n; ++r) {
    if (positions_SB[r] < 0) throw std::invalid_argument("rope: negative position " + std::to_string(positions_SB[r]));
  }
}

void check_spec(const RopeSpec& spec) {
  if (spec.rot_dim() > spec.head_dim) throw std::invalid_argument("rope: rot_dim exceeds head_dim");
}

}  // namespace

template <typename T>
void rope_forward(T* out_SBNd, const T* inp_SBNd, const int64_t S, const int64_t B, const int64_t N,
                  const RopeSpec& spec, const int64_t position_offset) {
  check_spec(spec);
  for (int64_t s = 0; s < S; ++s) {
    for (int64_t h = 0; h < B * N; ++h) {
      const int64_t at = (s * B * N + h) * spec.head_dim;
      rotate(out_SBNd + at, inp_SBNd + at, s + position_offset, spec);
    }
  }
}

// y = R x with R block-diagonal rotations, so dx = R^T dy (rotate_back).
template <typename T>
void rope_backward(T* dinp_SBNd, const T* dout_SBNd, const int64_t S, const int64_t B, const int64_t N,
                   const RopeSpec& spec, const int64_t position_offset) {
  check_spec(spec);
  for (int64_t s = 0; s < S; ++s) {
    for (int64_t h = 0; h < B * N; ++h) {
      const int64_t at = (s * B * N + h) * spec.head_dim;
      rotate_back(dinp_SBNd + at, dout_SBNd + at, s + position_offset, spec);
    }
  }
}

template <typename T>
void rope_forward(T* out_SBNd, const T* inp_SBNd, const int64_t S, const int64_t B, const int64_t N,
                  const RopeSpec& spec, const int64_t* positions_SB) {
  check_spec(spec);
  check_positions(positions_SB, S * B);
  for (int64_t s = 0; s < S; ++s) {
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t n = 0; n < N; ++n) {
        const int64_t at = ((s * B + b) * N + n) * spec.head_dim;
        rotate(out_SBNd + at, inp_SBNd + at, positions_SB[s * B + b], spec);
      }
    }
  }
}

template <typename T>
void rope_backward(T* dinp_SBNd, const T* dout_SBNd, const int64_t S, const int64_t B, const int64_t N,
                   const RopeSpec& spec, const int64_t* positions_SB) {
  check_spec(spec);
  check_positions(positions_SB, S * B);
  for (int64_t s = 0; s < S; ++s) {
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t n = 0; n < N; ++n) {
        const int64_t at = ((s * B + b) * N + n) * spec.head_dim;
        rotate_back(dinp_SBNd + at, dout_SBNd + at, positions_SB[s * B + b], spec);
      }
    }
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

}  // namespace moecore::kernels::ref
