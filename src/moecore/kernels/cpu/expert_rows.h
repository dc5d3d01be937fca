// The MoE dispatchers' permute index step (Megatron's moe_utils.permute: routing_map.T.nonzero() gives each expert's
// tokens in ascending order, probs.T.masked_select(routing_map.T) their probabilities) on a [T, E] byte routing map,
// for the experts [e_begin, e_end). Expert x = e - e_begin owns rows [offsets, offsets + rows_X[x]) of the outputs,
// back to back in expert order; after its routed tokens come padding rows (token -1, probability 0) up to rows_X[x]
// (pad-to-capacity).
#pragma once

#include <cstdint>

namespace moecore::kernels {

#define MOECORE_EXPERT_ROWS_DECL                                                                                     \
  /* routed_X[x] = the number of tokens the map routes to expert e_begin + x (overwrites X = e_end - e_begin). */    \
  void expert_routed_counts(int64_t* routed_X, const uint8_t* map_TE, int64_t T, int64_t E, int64_t e_begin,         \
                            int64_t e_end);                                                                          \
  /* token_R, probs_R: R = sum rows_X entries (overwrites all R). Needs routed_X[x] <= rows_X[x] for every x. */     \
  template <typename T>                                                                                              \
  void expert_major_rows(int64_t* token_R, T* probs_R, const uint8_t* map_TE, const T* probs_TE, int64_t num_tokens, \
                         int64_t E, int64_t e_begin, int64_t e_end, const int64_t* rows_X);

namespace cpu {
MOECORE_EXPERT_ROWS_DECL
}
namespace ref {
MOECORE_EXPERT_ROWS_DECL
}
#undef MOECORE_EXPERT_ROWS_DECL

}  // namespace moecore::kernels
