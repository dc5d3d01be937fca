// Rotary position embedding, Megatron's default (non-interleaved, "rotate half") layout; the RopeSpec overloads take
// any frequencies (YaRN's), the cos / sin factor and multi-latent attention's de-interleaved layout
// (rotary_frequencies.h): with mla_interleaved, channel pair (2i, 2i+1) becomes (i, i + rot_dim/2) before rotating.
// For each head vector x[0..head_dim): the first rot_dim channels are rotated, the rest pass through.
//   inv_freq[i] = 1 / base^(2i / rot_dim), i < rot_dim/2 (computed in fp32 as Megatron does);
//   angle[s, c] = s * inv_freq[c mod rot_dim/2];  rotate_half([x1, x2]) = [-x2, x1];
//   y = x * cos(angle) + rotate_half(x) * sin(angle).
// Activations are [S, B, N, head_dim]; the position of row s is s (+ position_offset), or, in the overloads taking
// positions_SB [S, B], positions_SB[s * B + b] for row (s, b) (>= 0): packed sequences restart positions in every
// document, a context-parallel rank's chunks have their positions in the whole sequence.
#pragma once

#include <cstdint>

#include "moecore/kernels/cpu/rotary_frequencies.h"

namespace moecore::kernels {

// The base overloads are RotaryEmbedding's frequencies (rope_spec) through the RopeSpec ones.
#define MOECORE_ROPE_DECL                                                                                     \
  template <typename T>                                                                                       \
  void rope_forward(T* out_SBNd, const T* inp_SBNd, int64_t S, int64_t B, int64_t N, const RopeSpec& spec,    \
                    int64_t position_offset);                                                                 \
  template <typename T>                                                                                       \
  void rope_backward(T* dinp_SBNd, const T* dout_SBNd, int64_t S, int64_t B, int64_t N, const RopeSpec& spec, \
                     int64_t position_offset);                                                                \
  template <typename T>                                                                                       \
  void rope_forward(T* out_SBNd, const T* inp_SBNd, int64_t S, int64_t B, int64_t N, const RopeSpec& spec,    \
                    const int64_t* positions_SB);                                                             \
  template <typename T>                                                                                       \
  void rope_backward(T* dinp_SBNd, const T* dout_SBNd, int64_t S, int64_t B, int64_t N, const RopeSpec& spec, \
                     const int64_t* positions_SB);                                                            \
  template <typename T>                                                                                       \
  void rope_forward(T* out_SBNd, const T* inp_SBNd, int64_t S, int64_t B, int64_t N, int64_t head_dim,        \
                    int64_t rot_dim, double base, int64_t position_offset = 0) {                              \
    rope_forward(out_SBNd, inp_SBNd, S, B, N, rope_spec(head_dim, rot_dim, base), position_offset);           \
  }                                                                                                           \
  template <typename T>                                                                                       \
  void rope_backward(T* dinp_SBNd, const T* dout_SBNd, int64_t S, int64_t B, int64_t N, int64_t head_dim,     \
                     int64_t rot_dim, double base, int64_t position_offset = 0) {                             \
    rope_backward(dinp_SBNd, dout_SBNd, S, B, N, rope_spec(head_dim, rot_dim, base), position_offset);        \
  }                                                                                                           \
  template <typename T>                                                                                       \
  void rope_forward(T* out_SBNd, const T* inp_SBNd, int64_t S, int64_t B, int64_t N, int64_t head_dim,        \
                    int64_t rot_dim, double base, const int64_t* positions_SB) {                              \
    rope_forward(out_SBNd, inp_SBNd, S, B, N, rope_spec(head_dim, rot_dim, base), positions_SB);              \
  }                                                                                                           \
  template <typename T>                                                                                       \
  void rope_backward(T* dinp_SBNd, const T* dout_SBNd, int64_t S, int64_t B, int64_t N, int64_t head_dim,     \
                     int64_t rot_dim, double base, const int64_t* positions_SB) {                             \
    rope_backward(dinp_SBNd, dout_SBNd, S, B, N, rope_spec(head_dim, rot_dim, base), positions_SB);           \
  }

namespace cpu {
MOECORE_ROPE_DECL
}
namespace ref {
MOECORE_ROPE_DECL
}
#undef MOECORE_ROPE_DECL

}  // namespace moecore::kernels
