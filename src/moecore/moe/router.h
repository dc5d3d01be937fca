// TopKRouter with Megatron's semantics (megatron/core/transformer/moe/router.py): gate weight [E, H],
// logits in --moe-router-dtype (fp32 or fp64), score function, top-k (optionally group-limited, with expert
// bias for selection only), scaling factor, capacity / token dropping, and the auxiliary losses
// (aux_loss, seq_aux_loss, global_aux_loss, sinkhorn, z-loss) whose gradients flow into the router
// weight and input in backward without changing the lm loss.
//
// Tokens are [S, B] sequence-major (token t = s * B + b), as everywhere in the model.
// Parameters (names under the layer prefix, e.g. "decoder.layers.3."):
//   mlp.router.weight        [E, H]  fp32, init N(0, init_method_std), weight decay yes
//   mlp.router.bias          [E]     only with --add-bias-linear, init N(0, init_method_std) as Megatron
// Buffer (not trainable; part of the training state): mlp.router.expert_bias [E] fp32
// (--moe-router-enable-expert-bias), Megatron's TopKRouter buffer of the same name.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "moecore/model/buffer.h"
#include "moecore/model/param.h"
#include "moecore/model/token_rows.h"
#include "moecore/moe/moe_config.h"
#include "moecore/ops/routing.h"
#include "moecore/parallel/parallel_state.h"
#include "moecore/tensor/tensor.h"

namespace moecore {

// The routing decision for one micro-batch.
struct RouterOutput {
  Tensor probs_TE;                           // fp32 [T, E]: the weight of each selected (and kept) expert, 0 elsewhere
  Tensor routing_map_TE;                     // kU8 [T, E]: 1 where token t goes to expert e (after capacity dropping)
  std::vector<int64_t> tokens_per_expert_E;  // column sums of routing_map (with padding: the capacity C each)
  int64_t capacity = -1;                     // C when a capacity factor is set, else -1
  // Loss values for logging, each divided by its coefficient as Megatron logs them (0 when off).
  std::vector<double> load_balancing_losses;  // one per configured type, in --moe-router-load-balancing-type order
  double z_loss = 0.0;
};

// What backward needs from forward (one micro-batch). The routing decision itself (map, probs) is the RouterOutput
// the caller keeps and passes back to backward.
struct RouterActivations {
  int64_t S = 0, B = 0;
  Tensor input_TH;        // router input after jitter, fp32
  Tensor logits_TE;       // [T, E] in the router dtype (fp32 or fp64)
  Tensor selected_TK;     // kI32 [T, K]: the top-k selection before capacity dropping / padding, in selection order
  Tensor aux_scores_TE;   // fp64 [T, E]: the aux losses' scores (fp32 values); undefined when no aux loss is on
  Tensor aux_grad_BE;     // fp64 [B, E]: d(sum of aux losses)/d(aux score of token t, expert e), row t % B; undefined
                          // when no aux loss is on (the switch losses' gradient depends on the column)
  Tensor lse_T;           // fp64 [T]: logsumexp of each token's logits when the z-loss is on
  bool training = false;  // forward ran in training mode (aux / z losses attached)
  uint64_t jitter_seed = 0, jitter_key = 0;  // regenerate the input jitter factors in backward
  TokenRows rows;                            // the local tokens' one-process rows (RNG keys)
  // Router replay (routing_replay.h): the recorded selection kI32 [T, K] the forward routed by; kept through
  // drop_for_recompute, so a recompute routes by it again (Megatron's REPLAY_BACKWARD).
  Tensor replay_TK;
};

class TopKRouter {
 public:
  // Registers parameters into `params` under `prefix` (e.g. "decoder.layers.3."). hidden = H. The weight and
  // bias are replicated over TP with Param::grad_sum_over_tp (each TP rank routes its own sequence shard) and
  // Param::module = module. Statistics are reduced over parallel.tp_cp (aux, seq-aux, z losses) and
  // parallel.tp_dp_cp (global aux loss, expert-bias counts). With expert bias the buffer mlp.router.expert_bias
  // (replicated, zeros) is registered into `buffers` (the model's list); null: a list the router keeps itself
  // (a router used on its own).
  TopKRouter(const MoEConfig& config, int64_t hidden, bool add_bias, const std::string& prefix, ParamStore& params,
             const parallel::ParallelState& parallel = parallel::ParallelState::single_process(), int module = -1,
             BufferStore* buffers = nullptr);
  // The router points into its own buffer list (without `buffers`): it neither copies nor moves.
  TopKRouter(const TopKRouter&) = delete;
  TopKRouter& operator=(const TopKRouter&) = delete;

  // x_TH [S*B, H] -> routing. The input jitter (--moe-input-jitter-eps) applies in training AND evaluation, as
  // Megatron's TopKRouter.forward; it is drawn from the counter RNG keyed by (seed, jitter_key), so an evaluation
  // forward is reproducible given its key. training: aux / z losses attached, expert-bias and global-aux token counts
  // accumulated, sinkhorn selection. x_TH holds S * B token rows of the micro-batch; `rows` says where they sit in
  // the one-process micro-batch (default: rows 0..S*B-1): the jitter and forced-balance draws are keyed by the
  // one-process element index, so every layout draws the same numbers. Collective over tp-cp (and tp-dp-cp with
  // global_aux_loss) when aux losses are on. Logged losses are this rank's share (sum over tp-cp for the total).
  // replay_TK (kI32 [S*B, topk], nullable): router replay's selection for these rows, taken instead of the top-k of
  // the scores; the probabilities are gathered from the live scores at it (routing_replay.h).
  RouterOutput forward(const Tensor& x_TH, int64_t S, int64_t B, bool training, uint64_t seed, uint64_t jitter_key,
                       RouterActivations& saved, const TokenRows& rows = TokenRows(),
                       const Tensor* replay_TK = nullptr);

  // Recomputation (--recompute-modules moe, full recompute): the routing of `saved`'s training forward again from the
  // same input, after drop_for_recompute(saved), with the tensors backward needs, and without the forward's side
  // effects (no expert-bias or global-aux counts; the aux losses' gradient is the one the forward formed). The
  // returned losses are zeros: the forward logged them.
  RouterOutput recompute(const Tensor& x_TH, RouterActivations& saved) const;
  // Frees what recompute() rebuilds; keeps the sizes, RNG keys and the aux losses' gradient.
  static void drop_for_recompute(RouterActivations& saved);

  // dprobs_TE: fp32 [T, E], d(objective)/d(probs_TE) from the experts (zero where not routed). aux_grad_scale: the
  // factor the auxiliary and z losses carry into the objective's gradient (Megatron: loss_scale * cp /
  // num_microbatches; here 1 / num_microbatches). `routing` is what forward returned with `saved`. Accumulates into
  // dx_TH (nullable) and the router parameters' gradients.
  void backward(Tensor* dx_TH, const Tensor& dprobs_TE, double aux_grad_scale, const RouterActivations& saved,
                const RouterOutput& routing);

  // Once per global batch (after the optimizer step): the expert-bias sign rule, then counts reset; and the
  // global_aux_loss accumulation reset. No-ops when those features are off. With expert bias: collective over
  // tp-dp-cp (the counts are summed before the sign rule).
  void finish_global_batch();

  // The gate weight [E, H] (mlp.router.weight's values).
  const Tensor& weight() const { return weight_->value; }
  // The expert-bias buffer's values [E] (empty without --moe-router-enable-expert-bias).
  std::span<const float> expert_bias() const;
  std::span<float> expert_bias();
  void set_expert_bias(std::span<const float> bias_E);  // copies E values

 private:
  MoEConfig config_;
  int64_t hidden_ = 0;
  bool add_bias_ = false;
  std::string prefix_;
  Param* weight_ = nullptr;
  Param* bias_ = nullptr;
  parallel::ProcessGroup tp_cp_;
  parallel::ProcessGroup tp_dp_cp_;
  bool has_expert_bias_ = false;
  BufferStore own_buffers_;                      // the buffer list of a router constructed without one
  Buffer* expert_bias_ = nullptr;                // [E] fp32
  std::vector<double> local_tokens_per_expert_;  // expert-bias counts since the last update
  std::vector<double> global_aux_counts_;        // global_aux_loss counts accumulated over micro-batches
  int64_t global_aux_steps_ = 0;                 // micro-batches accumulated (Megatron's ga_steps)

  // The steps of forward, one job each.
  void jittered_input(RouterActivations& saved, const Tensor& x_TH) const;
  void compute_logits(RouterActivations& saved) const;
  // Top-k selection (saved.selected_TK) and its probabilities probs_TK in the router dtype.
  Tensor route_tokens(RouterActivations& saved, bool training) const;
  // The dense routing map, probs and tokens per expert, after capacity dropping / padding.
  void apply_capacity(RouterOutput& out, const RouterActivations& saved, const Tensor& probs_TK) const;
  // Aux / seq-aux / global-aux losses and the z-loss (training): logged values in `out`, gradients in `saved`.
  void attach_losses(RouterOutput& out, RouterActivations& saved);
  // Updates the global-aux accumulation with this micro-batch's local counts; dscores_E += the loss's gradient.
  double global_aux_loss(const Tensor& score_sums_E, const std::vector<double>& local_counts_E, int64_t T, double coeff,
                         Tensor& dscores_E);
  void record_expert_bias_counts(const RouterOutput& out);
  // d(objective)/d(logits) [T, E] fp64: the probabilities' backward (dropped experts carry no gradient), the aux
  // losses through their scores and the z-loss.
  Tensor logits_backward(const Tensor& dprobs_TE, double aux_grad_scale, const RouterActivations& saved,
                         const RouterOutput& routing) const;
  ops::TopkRoutingSpec routing_spec() const;
};

}  // namespace moecore
