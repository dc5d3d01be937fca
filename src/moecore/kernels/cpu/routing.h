// The MoE router's pieces of Megatron's moe_utils.py / router.py (megatron/core/transformer/moe): score functions,
// top-k routing (group-limited, expert bias for the selection only, normalisation, scaling factor) and its backward,
// sinkhorn, the capacity mask / token dropping into the dense routing map, the aux-loss scores and their column
// sums, the z-loss. Row-major [n, E] buffers (n tokens, E experts, k = top-k); T is the logits' type (float or
// double): every score is computed in double from the logits and stored as T, rounded to fp32 first when
// `fp32_scores` (Megatron evaluates the score functions in fp32 whatever the router dtype). Gradients ACCUMULATE.
#pragma once

#include <cstdint>

namespace moecore::kernels {

enum class RoutingScore : uint8_t { kSoftmax, kSigmoid, kSqrtSoftplus };
enum class RoutingDropPolicy : uint8_t { kProbs, kPosition };

// Megatron's topk_routing_with_score_function (and TopKRouter.sinkhorn_load_balancing when `sinkhorn`).
struct TopkRoutingSpec {
  RoutingScore score = RoutingScore::kSoftmax;
  bool pre_softmax = false;  // softmax over all E, then top-k (else top-k of the logits, softmax over the k)
  int64_t num_groups = 0;    // group-limited top-k when group_topk > 0
  int64_t group_topk = 0;
  double scaling_factor = 0.0;  // probs *= factor when non-zero (in fp32 with fp32_scores)
  bool sinkhorn = false;        // probs = sigmoid (k = 1, in T) or softmax; selection over select_TE if given
  bool fp32_scores = true;      // scores rounded to fp32 as Megatron (false: in T, e.g. for finite differences)
  // Router replay (Megatron's RouterReplay REPLAY_FORWARD / REPLAY_BACKWARD): idx_TK holds each token's k experts on
  // entry and the selection is skipped; the probabilities are gathered from the scores at them and normalised and
  // scaled as usual. A row whose first entry is negative has no recorded experts: it selects as without replay. Not
  // with sinkhorn (Megatron's sinkhorn selection bypasses the replay).
  bool given_selection = false;
};

#define MOECORE_ROUTING_DECL                                                                                           \
  /* idx_TK: each token's k experts in selection order (largest first, ties to the lower index); probs_TK their        \
   * probabilities. bias_E (nullable, sigmoid / sqrtsoftplus only): added to the scores for the selection only.        \
   * select_TE (nullable, sinkhorn): the values the selection ranks. Overwrites both outputs. */                       \
  template <typename T>                                                                                                \
  void topk_routing_forward(int32_t* idx_TK, T* probs_TK, const T* logits_TE, const float* bias_E, const T* select_TE, \
                            int64_t n, int64_t E, int64_t k, const TopkRoutingSpec& spec);                             \
  /* dlogits_TE += d(sum <probs, dprobs>)/d(logits) where probs_TE = the selection's probs masked by map_TE            \
   * (nullable: every selected expert kept): dropped experts carry no gradient. */                                     \
  template <typename T>                                                                                                \
  void topk_routing_backward(T* dlogits_TE, const T* dprobs_TE, const uint8_t* map_TE, const int32_t* idx_TK,          \
                             const T* logits_TE, int64_t n, int64_t E, int64_t k, const TopkRoutingSpec& spec);        \
  /* Megatron's sinkhorn(): cost = exp(logits) in fp32, row / column scaling until the mean change of the column       \
   * factors is <= tol; out_TE = d1 * cost * d0 (fp32 values, may not alias logits). */                                \
  template <typename T>                                                                                                \
  void sinkhorn(T* out_TE, const T* logits_TE, int64_t n, int64_t E, double tol);                                      \
  /* The dense routing map after Megatron's apply_router_token_dropping: capacity < 0: the selection itself;           \
   * else for every expert the `capacity` tokens with the highest probs (kProbs) or selected first (kPosition) over    \
   * all n tokens, ties to the earlier token; map = selected & mask, or the mask itself when `pad` (padding tokens     \
   * at probability 0). probs_TE = probs_TK where kept, 0 elsewhere; counts_E = column sums of the map. Overwrites.    \
   */                                                                                                                  \
  template <typename T>                                                                                                \
  void routing_map(uint8_t* map_TE, T* probs_TE, int64_t* counts_E, const int32_t* idx_TK, const T* probs_TK,          \
                   int64_t n, int64_t E, int64_t k, int64_t capacity, RoutingDropPolicy policy, bool pad);             \
  /* Megatron's compute_routing_scores_for_aux_loss: softmax, or sigmoid / sqrtsoftplus normalised per token to sum    \
   * 1 (s / (sum s + 1e-20)); idx_TK their plain top-k. Overwrites. */                                                 \
  template <typename T>                                                                                                \
  void aux_scores_forward(T* scores_TE, int32_t* idx_TK, const T* logits_TE, int64_t n, int64_t E, int64_t k,          \
                          RoutingScore score, bool fp32_scores);                                                       \
  /* dlogits_TE += d(sum <scores, dscores>)/d(logits). dscores_RE has R rows, token t reads row t % R (R = n: one      \
   * row per token; R = B: the switch losses' per-sequence gradient). Softmax is differentiated through the            \
   * forward's scores_TE, sigmoid / sqrtsoftplus from the logits. */                                                   \
  template <typename T>                                                                                                \
  void aux_scores_backward(T* dlogits_TE, const T* dscores_RE, int64_t R, const T* scores_TE, const T* logits_TE,      \
                           int64_t n, int64_t E, RoutingScore score);                                                  \
  /* The switch losses' inputs over tokens t = s * B + b: sums_E (scores summed over all tokens, in token order),      \
   * sums_BE (per sequence b), counts_BE (how often sequence b's tokens picked expert e in idx_TK). Overwrites. */     \
  template <typename T>                                                                                                \
  void aux_loss_sums(T* sums_E, T* sums_BE, T* counts_BE, const T* scores_TE, const int32_t* idx_TK, int64_t n,        \
                     int64_t B, int64_t E, int64_t k);                                                                 \
  /* lse_T = logsumexp of each token's logits (in double); returns the sum of lse^2 in token order. */                 \
  template <typename T>                                                                                                \
  double z_loss_forward(T* lse_T, const T* logits_TE, int64_t n, int64_t E);                                           \
  /* dlogits_TE += scale * 2 lse_t / n * softmax(logits_t): the gradient of scale * sum_t lse_t^2 / n. */              \
  template <typename T>                                                                                                \
  void z_loss_backward(T* dlogits_TE, const T* logits_TE, const T* lse_T, int64_t n, int64_t E, double scale);         \
  /* Megatron's switch_load_balancing_loss_func from column sums: factor * sum_j sums_j counts_j with factor =         \
   * num_experts * coeff / (topk * total_tokens^2). */                                                                 \
  template <typename T>                                                                                                \
  double switch_loss(const T* sums_J, const T* counts_J, int64_t J, double factor);                                    \
  /* dsums_J += (dloss * factor) * counts_J (the counts are constants). */                                             \
  template <typename T>                                                                                                \
  void switch_loss_backward(T* dsums_J, const T* counts_J, int64_t J, double factor, double dloss);                    \
  /* Aux-loss-free balancing (Megatron's _update_expert_bias): bias_e += rate * sign(mean(counts) - counts_e), in      \
   * fp32. */                                                                                                          \
  template <typename T>                                                                                                \
  void expert_bias_update(float* bias_E, const T* counts_E, int64_t E, double rate);

namespace cpu {
MOECORE_ROUTING_DECL
}
namespace ref {
MOECORE_ROUTING_DECL
}
#undef MOECORE_ROUTING_DECL

}  // namespace moecore::kernels
