// Per-token routing math of Megatron's TopKRouter (megatron/core/transformer/moe/router.py, moe_utils.py): score
// functions and their derivatives, top-k (plain and group-limited), the Sinkhorn normalisation and capacity / token
// dropping. Pure functions over row-major [T, E] buffers (T tokens, E experts, K = top-k).
#pragma once

#include <cstdint>
#include <vector>

#include "moecore/moe/moe_config.h"

namespace moecore::routing {

// torch.nn.functional.softplus (beta 1, threshold 20: x itself above 20) and its derivative.
double softplus(double x);
double softplus_grad(double x);
double sigmoid(double x);
// The elementwise score of sigmoid / sqrtsoftplus routing, and d(score)/d(logit) given the score.
double pointwise_score(RouterScoreFunction fn, double logit);
double pointwise_score_grad(RouterScoreFunction fn, double logit, double score);

// out_E = softmax(in_E) (out may alias in).
void softmax(double* out_E, const double* in_E, int64_t E);

// The score functions in fp32, as Megatron evaluates them whatever the router dtype (topk_routing_with_score_function
// and compute_routing_scores_for_aux_loss in moe_utils.py: torch.softmax(logits, dtype=torch.float32),
// torch.sigmoid(logits.float())): the logits are rounded to fp32 first, the function is evaluated on them and each
// result is rounded to fp32. Values are returned as doubles holding fp32 numbers.
double to_fp32(double value);
void softmax_fp32(double* out_E, const double* logits_E, int64_t E);
double pointwise_score_fp32(RouterScoreFunction fn, double logit);
// values_K /= (sum of values_K + 1e-20) in fp32 arithmetic (Megatron's normalisation of sigmoid / sqrtsoftplus
// scores; the sum accumulates left to right).
void normalize_fp32(double* values_K, int64_t K);
// log(sum_e exp(in_e)).
double logsumexp(const double* in_E, int64_t E);

// Indices of the k largest values_E, largest first; ties go to the lower index. -inf entries are never
// preferred over finite ones. One pass keeping the best k in order (k <= kStreamingTopkMax; larger k sorts), no
// allocation: O(E) for the small k of MoE routing.
constexpr int64_t kStreamingTopkMax = 16;
void topk(int64_t* idx_K, const double* values_E, int64_t E, int64_t k);
// Group-limited top-k (Megatron's group_limited_topk in moe_utils.py): experts viewed as [G, E/G]; a group's score
// is the sum of its top-(k // group_topk) values (floor division, as Megatron: k need not be a multiple of
// group_topk); the group_topk best groups stay (ties to the lower index), the others are masked to -inf; then top-k
// over what remains. Needs group_topk <= k <= group_topk * E / num_groups.
void group_limited_topk(int64_t* idx_K, const double* values_E, int64_t E, int64_t k, int64_t num_groups,
                        int64_t group_topk);

// Megatron's sinkhorn(): cost = exp(logits) in fp32, alternate row / column scaling until the mean absolute change
// of the column factors is <= tol; returns d1 * cost * d0 [T, E] (fp32 values).
std::vector<float> sinkhorn(const double* logits_TE, int64_t T, int64_t E, double tol = 1e-4);

// Expert capacity C = ceil((T * k / E) * capacity_factor), as Megatron's get_capacity(num_tokens = T * k).
int64_t expert_capacity(int64_t T, int64_t k, int64_t E, double capacity_factor);

// Megatron's capacity mask (apply_router_token_dropping in moe_utils.py): for every expert, the C tokens with the
// highest probs_TE (policy probs) or the highest selected_TE, i.e. selected tokens first (policy position), over ALL
// T tokens; ties go to the earlier token. When C >= T every token is in the mask. The routing map is then
// selected & mask (dropping), or the mask itself with --moe-pad-expert-input-to-capacity (every expert gets exactly
// min(C, T) real tokens, the padding ones with probability 0).
// From the sparse selection: selected_TK holds the k experts of each token, probs_TK their probabilities (only the
// selected entries of probs_TE can be non-zero). O(T k log T) for the sort plus the [T, E] mask itself.
void capacity_mask(uint8_t* mask_TE, const int32_t* selected_TK, const double* probs_TK, int64_t T, int64_t E,
                   int64_t k, int64_t capacity, TokenDropPolicy policy);

// Naive references of the functions above (a full sort per call, dense [T, E] scans), for tests.
namespace ref {
void topk(int64_t* idx_K, const double* values_E, int64_t E, int64_t k);
void group_limited_topk(int64_t* idx_K, const double* values_E, int64_t E, int64_t k, int64_t num_groups,
                        int64_t group_topk);
void capacity_mask(uint8_t* mask_TE, const uint8_t* selected_TE, const double* probs_TE, int64_t T, int64_t E,
                   int64_t capacity, TokenDropPolicy policy);
}  // namespace ref

}  // namespace moecore::routing
