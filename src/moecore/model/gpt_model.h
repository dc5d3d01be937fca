// GPT decoder with explicit forward and backward (no autograd tape), Megatron's architecture and names:
//   embedding.word_embeddings.weight [V, H]          embedding.position_embeddings.weight [P, H] (learned_absolute)
//   decoder.layers.{i}.input_layernorm.{weight,bias}  self_attention.linear_qkv.{weight,bias} [(N+2G)d, H]
//   self_attention.{q,k}_layernorm.{weight,bias} [d]  self_attention.linear_proj.{weight,bias} [H, N d]
//   decoder.layers.{i}.pre_mlp_layernorm.{weight,bias} mlp.linear_fc1.{weight,bias} [F or 2F, H]
//   mlp.linear_fc2.{weight,bias} [H, F]               decoder.final_layernorm.{weight,bias} [H]
//   output_layer.weight [V, H] (only with --untie-embeddings-and-output-weights)
//   mtp.layers.{k}.* (with --mtp-num-layers, on the loss stage: multi_token_prediction.h)
// Buffers (not trained, part of the training state): decoder.layers.{i}.mlp.router.expert_bias [E] fp32 on MoE layers
// with --moe-router-enable-expert-bias. Under --fp8-recipe delayed each decoder-layer linear's weight Param also
// carries the linear's FP8 scaling state (delayed_scaling()).
// The fused qkv rows are grouped as Megatron's: for each query group g, its N/G query heads, then k, then v.
// Activations are [S, B, ...] (sequence-major, as Megatron), token row t = s * B + b.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "moecore/model/buffer.h"
#include "moecore/model/config.h"
#include "moecore/model/delayed_scaling_states.h"
#include "moecore/model/micro_batch_context.h"
#include "moecore/model/model_hooks.h"
#include "moecore/model/norm_overflow.h"
#include "moecore/model/param.h"
#include "moecore/moe/moe_metrics_tracker.h"
#include "moecore/moe/router_trace.h"
#include "moecore/moe/routing_replay.h"
#include "moecore/parallel/parallel_state.h"
#include "moecore/tensor/tensor.h"

namespace moecore {

class KvCache;

// Multi-Token Prediction losses (unscaled, each depth's mean over its unmasked tokens) summed over the training
// forwards since the last GPTModel::take_mtp_stats().
struct MtpStats {
  int64_t num_forwards = 0;
  std::vector<double> loss_sums;  // [depth]
};

// The part of the model one pipeline stage builds (Megatron's pre_process / post_process): decoder layers
// [first_layer, first_layer + num_layers) under their global numbers, with the embedding (pre_process) and the
// final norm, output layer and loss (post_process). The default is the whole model.
struct StageSpec {
  int64_t first_layer = 0;
  int64_t num_layers = -1;  // -1: every layer from first_layer on
  bool pre_process = true;
  bool post_process = true;
};

struct ForwardOptions {
  bool training = true;           // dropout on, activations kept for backward
  uint64_t dropout_seed = 0;      // run seed
  uint64_t dropout_stream = 0;    // distinct per (iteration, micro-batch)
  int chunk = 0;                  // the model chunk (virtual pipeline stage) of this rank to run
  double* loss_tokens = nullptr;  // if set: receives the unmasked tokens this rank's loss covers (its share under CP)
  // Packed sequences (Megatron's --reset-position-ids / --reset-attention-mask), the whole micro-batch [B, S]; null:
  // positions 0..S-1 (rotary embeddings) and one document per sample.
  const int64_t* position_ids_BS = nullptr;
  const int32_t* document_ids_BS = nullptr;
  // Megatron's is_first_microbatch (schedules.py: the first micro-batch of a forward_backward call, per model
  // chunk): under FP8 delayed scaling the chunk's linear layers cast their weights afresh; later micro-batches reuse
  // the FP8 weights of the first (DelayedLinearScaling::weight_for_forward).
  bool is_first_microbatch = true;
  // The backward seed this micro-batch's backward will be given (loss scale / micro-batches). The fused output layer
  // forms the loss's gradients during the forward; with the seed known they are formed already scaled, as
  // Megatron's scaled loss would give them, so that fp16 rounding sees the scaled values (no underflow).
  double backward_seed = 1.0;
  // Megatron's --calculate-per-token-loss: the micro-batch's objective is the sum of its token losses (the backward
  // seeds the sum, not the token mean), the MoE auxiliary losses' gradients are not scaled by CP, and the MTP
  // depths' token losses weigh (main tokens / depth tokens); the caller divides every gradient by the global number
  // of loss tokens after the data-parallel reduction. forward still returns the token mean (for the log).
  bool per_token_loss = false;
  // Router replay (moe/routing_replay.h): the micro-batch's recorded routing of the decoder's MoE routers; null: the
  // routers choose. Not applied to Multi-Token Prediction depths.
  const RoutingReplayBatch* routing_replay = nullptr;
  // Dynamic context parallelism (--hybrid-context-parallel): the group that shares this micro-batch's sequence, in
  // place of the layout's context-parallel group (null: the layout's).
  const parallel::ProcessGroup* context_parallel = nullptr;
};

class GPTModel {
 public:
  // Under tensor / expert parallelism this rank holds its shards (Param::shard); the initial values are the slices
  // of the one-process model with the same seed. Collective calls need every rank of the layout.
  GPTModel(const ModelConfig& config, uint64_t seed,
           const parallel::ParallelState& parallel = parallel::ParallelState::single_process(),
           const StageSpec& stage = StageSpec{});
  // Several model chunks on one rank (Megatron's virtual pipeline stages, in virtual-stage order): each a range of
  // global layers; only the first may have pre_process and only the last post_process. One parameter list holds
  // every chunk's parameters, chunk by chunk.
  GPTModel(const ModelConfig& config, uint64_t seed, const parallel::ParallelState& parallel,
           const std::vector<StageSpec>& chunks);
  ~GPTModel();
  GPTModel(const GPTModel&) = delete;
  GPTModel& operator=(const GPTModel&) = delete;

  const ModelConfig& config() const { return config_; }
  const parallel::ParallelState& parallel() const { return parallel_; }
  // Hooks called around each module's forward and backward (the DDP engine); null: none. Not owned.
  void set_hooks(ModelHooks* hooks) { hooks_ = hooks; }
  // The MoE layers' training forwards record their routing into `tracer` (moe/router_trace.h; not owned; null: none).
  void set_router_tracer(RouterTracer* tracer);
  // The decoder's MoE routers report every forward's top-k selection to `recorder` (moe/routing_replay.h; not owned;
  // null: none), as router replay's RECORD action.
  void set_routing_recorder(RoutingRecorder* recorder);
  ParamStore& params() { return params_; }
  const ParamStore& params() const { return params_; }
  Param& param(const std::string& name);  // throws std::out_of_range naming it
  const Param& param(const std::string& name) const;
  // The buffers of this rank's modules, in registration order (layer by layer).
  BufferStore& named_buffers() { return buffers_; }
  const BufferStore& named_buffers() const { return buffers_; }
  Buffer& buffer(const std::string& name);  // throws std::out_of_range naming it
  const Buffer& buffer(const std::string& name) const;
  int64_t num_parameters() const;
  void zero_grad();

  const StageSpec& stage(int chunk = 0) const { return chunks_.at(static_cast<size_t>(chunk)); }
  int num_chunks() const { return static_cast<int>(chunks_.size()); }

  // Without pre_process: the hidden states [this rank's rows of S*B tokens, H] the chunk's next forward starts from
  // (the previous stage's output; Megatron's set_input_tensor).
  void set_input_tensor(Tensor hidden_TH, int chunk = 0) {
    inputs_TH_.at(static_cast<size_t>(chunk)) = std::move(hidden_TH);
  }

  // Runs model chunk options.chunk. tokens_BS, labels_BS [B, S] (the whole micro-batch on every TP rank);
  // loss_mask_BS may be null (all ones); tokens are read with pre_process, labels and mask with post_process.
  // Returns the mean loss over unmasked tokens (post_process; else 0, and ctx->output_TH holds this stage's output);
  // keeps what backward needs in `ctx` when training.
  // logits_SBV, if non-null, receives a copy of the logits [S, B, V] (this rank's vocabulary columns under TP).
  double forward(std::unique_ptr<MicroBatchContext>& ctx, const int32_t* tokens_BS, const int32_t* labels_BS,
                 const float* loss_mask_BS, int64_t B, int64_t S, const ForwardOptions& options,
                 Tensor* logits_SBV = nullptr);
  // Backward of the chunk ctx came from. Accumulates into every Param::grad the gradient of (loss * loss_scale);
  // releases ctx. Without post_process the
  // gradient comes from output_grad_TH (d loss / d this stage's output, already scaled). Returns d(input hidden
  // states) without pre_process (to send to the previous stage), else an undefined tensor.
  Tensor backward(std::unique_ptr<MicroBatchContext> ctx, double loss_scale, const Tensor* output_grad_TH = nullptr);

  // MoE: statistics of the training forwards since the last call (then reset), and the once-per-global-batch
  // router updates (expert-bias sign rule, global aux-loss reset). No-ops for a dense model.
  MoEStats take_moe_stats();
  // --mtp-num-layers: the depths' losses of the training forwards since the last call (then reset); empty on a stage
  // without the loss.
  MtpStats take_mtp_stats();
  void finish_global_batch();
  // The first norm (in model order) of this rank whose statistics overflowed in a forward since the last call (then
  // reset): its output was zeros, which the loss does not show (model/norm_overflow.h). Training, evaluation and
  // generation check it after their forwards.
  std::optional<NormOverflow> take_norm_overflow();
  // The router's expert-bias buffer decoder.layers.{layer}.mlp.router.expert_bias [E] (global layer index; exports,
  // tests); null for a dense layer, a layer outside this stage, or without --moe-router-enable-expert-bias.
  Buffer* expert_bias(int64_t layer);
  const Buffer* expert_bias(int64_t layer) const;

  // FP8 delayed scaling (--fp8-recipe delayed): the scaling states of this rank's linear layers, in parameter order;
  // empty under other recipes. A training forward / backward reduces and updates them (delayed_scaling_states.h).
  DelayedScalingStates& delayed_scaling() { return delayed_scaling_; }
  const DelayedScalingStates& delayed_scaling() const { return delayed_scaling_; }

  // Logits for the last position of each sequence (generation, one process only): tokens_BS [B, S] -> [B, V].
  Tensor last_logits(const int32_t* tokens_BS, int64_t B, int64_t S);
  // Incremental decoding (generation, one process, model/kv_cache.h): the new tokens of one sequence run as
  // positions cache.length(), cache.length() + 1, ... attending every cached position up to their own, and join the
  // cache. Returns the logits [1, V] of the last new token: those last_logits gives over the whole sequence.
  Tensor decode_logits(KvCache& cache, std::span<const int32_t> new_tokens);

 private:
  Tensor embed(MicroBatchContext& ctx, const ForwardOptions& options) const;
  void embed_backward(const Tensor& dx_TH, const MicroBatchContext& ctx) const;
  double output_and_loss(MicroBatchContext& ctx, const Tensor& hidden_TH, bool with_labels, Tensor* logits_SBV) const;
  Tensor output_and_loss_backward(MicroBatchContext& ctx, double loss_scale) const;
  // The micro-batch as the MTP block reads it (the whole [B, S] arrays in forward; backward needs none of them).
  MtpBatch mtp_batch(const MicroBatchContext& ctx, const int32_t* tokens_BS = nullptr,
                     const int32_t* labels_BS = nullptr, const float* loss_mask_BS = nullptr) const;
  double aux_loss_scale(const MicroBatchContext& ctx, double loss_scale) const;
  MtpForwardOptions mtp_options(const MicroBatchContext& ctx, double backward_seed) const;
  // Full recomputation: what a checkpoint keeps of its input (all of it, or this TP rank's rows with
  // --distribute-saved-activations), and the forward of the chunk's layers [begin, end) again from it, into ctx.
  Tensor checkpoint_input(const Tensor& input_TH) const;
  void recompute_checkpoint(MicroBatchContext& ctx, int64_t begin, int64_t end);
  void mtp_forward(MicroBatchContext& ctx, const ForwardOptions& options, const int32_t* tokens_BS,
                   const int32_t* labels_BS, const float* loss_mask_BS);

  struct Modules;
  ModelConfig config_;
  parallel::ParallelState parallel_;
  std::vector<StageSpec> chunks_;
  std::vector<size_t> chunk_first_module_;  // index of each chunk's first layer in the layer list; + one past the end
  std::vector<Tensor> inputs_TH_;           // per chunk
  ModelHooks* hooks_ = nullptr;
  ParamStore params_;
  BufferStore buffers_;
  std::unique_ptr<Modules> modules_;
  MoEMetricsTracker moe_metrics_;  // the MoE layers' statistics of the training forwards
  MtpStats mtp_stats_;
  NormOverflowLog norm_overflows_;
  DelayedScalingStates delayed_scaling_;
};

}  // namespace moecore
