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
// log(sum_e exp(in_e)).
double logsumexp(const double* in_E, int64_t E);

// Indices of the k largest values_E, largest first; ties go to the lower index. -inf entries are never
// preferred over finite ones.
void topk(int64_t* idx_K, const double* values_E, int64_t E, int64_t k);
// Group-limited top-k: experts viewed as [G, E/G]; a group's score is the sum of its top-(k / group_topk)
// values; the group_topk best groups stay, the others are masked to -inf; then top-k over what remains.
void group_limited_topk(int64_t* idx_K, const double* values_E, int64_t E, int64_t k, int64_t num_groups,
                        int64_t group_topk);

// Megatron's sinkhorn(): cost = exp(logits) in fp32, alternate row / column scaling until the mean absolute change
// of the column factors is <= tol; returns d1 * cost * d0 [T, E] (fp32 values).
std::vector<float> sinkhorn(const double* logits_TE, int64_t T, int64_t E, double tol = 1e-4);

// Expert capacity C = ceil((T * k / E) * capacity_factor), as Megatron's get_capacity(num_tokens = T * k).
int64_t expert_capacity(int64_t T, int64_t k, int64_t E, double capacity_factor);

// keep_TE: for every expert, the (at most) C selected tokens it keeps: the C highest probs_TE (policy probs) or the
// C earliest tokens (policy position); ties go to the earlier token. When C >= T every selected token is kept.
void capacity_keep_mask(uint8_t* keep_TE, const uint8_t* selected_TE, const double* probs_TE, int64_t T, int64_t E,
                        int64_t capacity, TokenDropPolicy policy);

}  // namespace moecore::routing
