// Megatron's load-balancing losses (megatron/core/transformer/moe/moe_utils.py) with their gradients, and the
// aux-loss-free expert-bias update. Buffers are row-major [T, E]; gradients ACCUMULATE (+=).
//
// Two forms. The dense one (aux_scores, aux_loss, seq_aux_loss, switch_loss, aux_scores_backward) follows Megatron's
// tensors literally: [T, E] scores, map and score gradients. The router uses the row / column-sum form (aux_scores_row,
// switch_loss_from_sums, aux_scores_backward_row): the switch loss only needs each column's score sum and token
// count, and its gradient with respect to a score is the same for every token of a column, so nothing [T, E] beyond
// the scores themselves is built. Tests hold the two forms equal.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "moecore/moe/moe_config.h"

namespace moecore::load_balancing {

// Scores the aux losses use, over all experts: softmax, or sigmoid / sqrtsoftplus normalised per token to sum 1
// (s / (sum s + 1e-20)), in fp32 whatever the router dtype (Megatron's compute_routing_scores_for_aux_loss). Also the
// plain top-k map of those scores (map_TE, 0/1).
void aux_scores(double* scores_TE, uint8_t* map_TE, const double* logits_TE, int64_t T, int64_t E, int64_t k,
                RouterScoreFunction fn);
// dlogits_TE += d(scores)/d(logits)^T dscores_TE, for the scores of aux_scores() (differentiated exactly, in double).
void aux_scores_backward(double* dlogits_TE, const double* dscores_TE, const double* logits_TE, int64_t T, int64_t E,
                         RouterScoreFunction fn);

// switch_load_balancing_loss_func: coeff * num_experts / (k * total_tokens^2) * sum_e (sum_t scores_te) * count_e,
// where column e of scores_TE belongs to "expert" e of tokens_per_expert (E columns). The counts are constants.
// dscores_TE (nullable) += d(loss)/d(scores).
double switch_loss(const double* scores_TE, const double* tokens_per_expert_E, int64_t T, int64_t E,
                   double total_tokens, int64_t k, int64_t num_experts, double coeff, double* dscores_TE);

// Sums token counts over the `ranks` ranks that hold the other tokens of the same sequences (tp-cp under
// tensor / context parallelism); empty in one process.
using CountReduction = std::function<void(std::vector<double>& counts)>;

// aux_loss: counts = column sums of map_TE over the T local tokens (reduced over the ranks), total T * ranks.
double aux_loss(const double* scores_TE, const uint8_t* map_TE, int64_t T, int64_t E, int64_t k, double coeff,
                double* dscores_TE, const CountReduction& reduce = {}, int64_t ranks = 1);
// seq_aux_loss over tokens [S, B] (t = s * B + b): the aux loss of each sequence b (T = S * ranks: the ranks hold
// shards of the same sequences), averaged over B.
double seq_aux_loss(const double* scores_TE, const uint8_t* map_TE, int64_t S, int64_t B, int64_t E, int64_t k,
                    double coeff, double* dscores_TE, const CountReduction& reduce = {}, int64_t ranks = 1);

// One token's aux scores (as aux_scores: fp32 values) and their plain top-k idx_K (largest first).
void aux_scores_row(double* scores_E, int64_t* idx_K, const double* logits_E, int64_t E, int64_t k,
                    RouterScoreFunction fn);
// switch_loss from the column sums of the scores (score_sums_J) and the counts: the same value, and dscores_J
// (nullable) += the gradient of each score of column j (factor * counts_j, the same for every token).
double switch_loss_from_sums(const double* score_sums_J, const double* counts_J, int64_t J, double total_tokens,
                             int64_t k, int64_t num_experts, double coeff, double* dscores_J);
// One token of aux_scores_backward: dlogits_E += d(scores)/d(logits)^T dscores_E. Softmax scores are differentiated
// through the forward's fp32 scores (scores_E, what autograd's softmax backward uses); sigmoid / sqrtsoftplus
// scores are recomputed from the logits in double (scores_E unused). scratch_E: E doubles.
void aux_scores_backward_row(double* dlogits_E, const double* dscores_E, const double* logits_E, const float* scores_E,
                             int64_t E, RouterScoreFunction fn, double* scratch_E);

// z-loss = coeff * mean_t logsumexp(logits_t)^2; dlogits_TE (nullable) += grad_scale * d(z)/d(logits).
double z_loss(const double* logits_TE, int64_t T, int64_t E, double coeff, double grad_scale, double* dlogits_TE);

// Aux-loss-free balancing: bias_e += rate * sign(mean(counts) - counts_e) in fp32, as Megatron.
void update_expert_bias(std::span<float> expert_bias_E, const std::vector<double>& tokens_per_expert_E,
                        double update_rate);

}  // namespace moecore::load_balancing
