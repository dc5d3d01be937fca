// The MoE router's pieces of Megatron's moe_utils.py on tensors (semantics: kernels/cpu/routing.h): score functions,
// top-k routing and its backward, sinkhorn, the capacity mask into the routing map, the aux-loss scores and sums, the
// switch and z losses, the expert-bias update. logits_TE [n, E] is fp32 or fp64 (the router dtype); the float
// tensors of one call share its dtype; expert indices are kI32 [n, k], the routing map kU8 [n, E], token counts
// kI64 [E]. Gradients ACCUMULATE.
#pragma once

#include <cstdint>

#include "moecore/kernels/cpu/routing.h"
#include "moecore/tensor/tensor.h"

namespace moecore::ops {

using kernels::RoutingDropPolicy;
using kernels::RoutingScore;
using kernels::TopkRoutingSpec;

// idx_TK, probs_TK [n, k] (overwritten) from logits_TE; bias_E (fp32 [E], nullable) steers the selection only;
// select_TE (nullable, sinkhorn) is what the selection ranks. With spec.given_selection idx_TK is an input (router
// replay; std::invalid_argument for an expert outside [0, E) or named twice in a row) and only probs_TK is written,
// but for rows whose first expert is negative (not recorded), which select from the scores as without it.
void topk_routing_forward(Tensor& idx_TK, Tensor& probs_TK, const Tensor& logits_TE, const Tensor* bias_E,
                          const Tensor* select_TE, const TopkRoutingSpec& spec);
// dlogits_TE += d/d logits of <probs_TE, dprobs_TE>, probs_TE the selection's probs where map_TE (nullable: all
// selected experts kept) is set.
void topk_routing_backward(Tensor& dlogits_TE, const Tensor& dprobs_TE, const Tensor* map_TE, const Tensor& idx_TK,
                           const Tensor& logits_TE, const TopkRoutingSpec& spec);
// Megatron's sinkhorn() of the logits (fp32 values), overwriting out_TE.
void sinkhorn(Tensor& out_TE, const Tensor& logits_TE, double tol = 1e-4);
// Megatron's get_capacity(num_tokens = n * k): ceil((n * k / E) * capacity_factor).
int64_t expert_capacity(int64_t n, int64_t k, int64_t E, double capacity_factor);
// map_TE (kU8), probs_TE, counts_E (kI64) from the selection (overwritten); capacity < 0: no capacity.
void routing_map(Tensor& map_TE, Tensor& probs_TE, Tensor& counts_E, const Tensor& idx_TK, const Tensor& probs_TK,
                 int64_t capacity, RoutingDropPolicy policy, bool pad);
// Megatron's compute_routing_scores_for_aux_loss: scores_TE and their top-k idx_TK [n, k] (overwritten).
void aux_scores_forward(Tensor& scores_TE, Tensor& idx_TK, const Tensor& logits_TE, RoutingScore score,
                        bool fp32_scores);
// dlogits_TE += the scores' backward of dscores_RE [R, E] (token t reads row t % R).
void aux_scores_backward(Tensor& dlogits_TE, const Tensor& dscores_RE, const Tensor& scores_TE, const Tensor& logits_TE,
                         RoutingScore score);
// Column sums of the aux scores over all tokens (sums_E) and per sequence (sums_BE, tokens t = s * B + b), and the
// top-k counts per sequence (counts_BE); overwritten.
void aux_loss_sums(Tensor& sums_E, Tensor& sums_BE, Tensor& counts_BE, const Tensor& scores_TE, const Tensor& idx_TK,
                   int64_t B);
// Megatron's switch_load_balancing_loss_func from column sums and counts (J columns).
struct SwitchLossSpec {
  double total_tokens = 1.0;
  int64_t topk = 1;
  int64_t num_experts = 1;
  double coeff = 1.0;
};
double switch_loss(const Tensor& sums_J, const Tensor& counts_J, const SwitchLossSpec& spec);
// dsums_J += dloss * d(switch_loss)/d(sums).
void switch_loss_backward(Tensor& dsums_J, const Tensor& counts_J, const SwitchLossSpec& spec, double dloss);
// lse_T = logsumexp of each token's logits (overwritten); returns coeff * sum_t lse_t^2 / n (Megatron's z_loss_func).
double z_loss_forward(Tensor& lse_T, const Tensor& logits_TE, double coeff);
// dlogits_TE += d/d logits of coeff_scale * sum_t lse_t^2 / n.
void z_loss_backward(Tensor& dlogits_TE, const Tensor& logits_TE, const Tensor& lse_T, double coeff_scale);
// bias_E (fp32) += rate * sign(mean(counts) - counts_e); counts_E fp32 or fp64.
void expert_bias_update(Tensor& bias_E, const Tensor& counts_E, double rate);

}  // namespace moecore::ops
