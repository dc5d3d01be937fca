// The frequencies of a rotary position embedding, computed in fp32 as Megatron does:
//   RotaryEmbedding (rotary_pos_embedding.py): inv_freq[i] = 1 / base^(2i / dim), i < dim / 2;
//   YarnRotaryEmbedding (yarn_rotary_pos_embedding.py): inv_freq = inv_freq_inter * ramp + inv_freq_extra * (1 - ramp)
//   with inv_freq_extra the RotaryEmbedding frequencies, inv_freq_inter = inv_freq_extra / scaling_factor, and
//   ramp[i] = clamp((i - low) / (high - low), 0, 1), where low / high are the dimensions that make beta_fast /
//   beta_slow rotations over original_max_position_embeddings positions,
//   dim(r) = dim ln(L_orig / (2 pi r)) / (2 ln base), low = max(floor(dim(beta_fast)), 0),
//   high = min(ceil(dim(beta_slow)), dim - 1) (floor / ceil only when rounding to integers; high += 0.001 when equal).
// get_mscale(s, m) = 1 if s <= 1 else 0.1 m ln(s) + 1; the concentration factor multiplying cos and sin is
// get_mscale(s, mscale) / get_mscale(s, mscale_all_dim).
#pragma once

#include <cstdint>
#include <vector>

namespace moecore::kernels {

// One rotary embedding as the rope kernels apply it (rope.h).
struct RopeSpec {
  int64_t head_dim = 0;           // channels of each head vector; the first rot_dim() are rotated
  std::vector<float> inv_freq;    // rot_dim / 2 frequencies
  float attention_factor = 1.0f;  // multiplies cos and sin (YaRN's concentration factor; Megatron's mscale)
  // Megatron's multi-latent attention layout (rope_utils.py, mla_rotary_interleaved): the rotated channels are
  // de-interleaved first, [x0, x2, x4, ..., x1, x3, ...], then rotated as halves, and stay in that order.
  bool mla_interleaved = false;

  int64_t rot_dim() const { return 2 * static_cast<int64_t>(inv_freq.size()); }
};

struct YarnParams {
  double scaling_factor = 1.0;
  int64_t original_max_position_embeddings = 4096;
  double beta_fast = 32.0;
  double beta_slow = 1.0;
  bool round_to_int = true;
};

// RotaryEmbedding's frequencies over rot_dim channels (even, > 0); base > 0.
std::vector<float> rope_inv_freq(int64_t rot_dim, double base);
// RotaryEmbedding over the first rot_dim (even, in [0, head_dim]) channels of head_dim-wide heads; base > 0.
RopeSpec rope_spec(int64_t head_dim, int64_t rot_dim, double base);
// YarnRotaryEmbedding's frequencies over dim channels (even, > 0); base > 1.
std::vector<float> yarn_inv_freq(int64_t dim, double base, const YarnParams& yarn);
// The correction range [low, high] of YaRN's ramp (before the equal-ends adjustment).
struct YarnRange {
  double low = 0, high = 0;
};
YarnRange yarn_correction_range(int64_t dim, double base, const YarnParams& yarn);
double yarn_get_mscale(double scale, double mscale);
double yarn_concentration_factor(double scaling_factor, double mscale, double mscale_all_dim);

}  // namespace moecore::kernels
