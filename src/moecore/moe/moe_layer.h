// The MoE layer: Router -> TokenDispatcher -> Experts -> combine, plus shared experts. It replaces the dense
// MLP of the layers --moe-layer-freq marks; the pre-MLP norm, dropout and residual stay in the transformer layer.
// LatentMoE (--moe-latent-size L, Megatron's MoELayer): the router and shared experts read the full x_TH; the routed
// path is  z_TL = fc1_latent_proj(x_TH)  -> dispatch -> experts [L -> F -> L] -> combine ->  fc2_latent_proj -> [T, H],
// so the dispatcher moves L instead of H features per token. The projections (mlp.fc1_latent_proj [L, H],
// mlp.fc2_latent_proj [H, L], + bias with --add-bias-linear) are replicated over TP ("duplicated" TELinear); each TP
// rank projects its sequence shard, so their gradients are summed over TP.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "moecore/model/buffer.h"
#include "moecore/model/config.h"
#include "moecore/model/parallel_linear.h"
#include "moecore/model/param.h"
#include "moecore/moe/experts.h"
#include "moecore/moe/router.h"
#include "moecore/moe/router_trace.h"
#include "moecore/moe/routing_replay.h"
#include "moecore/moe/token_dispatcher.h"
#include "moecore/parallel/parallel_state.h"

namespace moecore {

struct MoELayerActivations {
  RouterActivations router;
  RouterOutput routing;
  DispatchState dispatch;
  ExpertActivations experts;
  SharedExpertActivations shared;
  // LatentMoE: fc1_latent_proj's (its input is the layer's) and fc2_latent_proj's (its input the combined output).
  LinearActivations latent_down, latent_up;
};

class MoELayer {
 public:
  // Registers the router, expert and shared-expert parameters under `prefix` (e.g. "decoder.layers.3."), with
  // Param::module = `module` (the layer index). Under expert parallelism only this rank's experts (global names
  // local_experts.{e}) are registered, each sharded over expert-TP; shared experts are sharded over TP.
  // The router's buffers go into `buffers` (null: the router keeps them; see TopKRouter).
  MoELayer(const ModelConfig& config, const std::string& prefix, ParamStore& params,
           const parallel::ParallelState& parallel, int module, BufferStore* buffers = nullptr);

  // Returns out_TH = moe(x_TH) on this rank's tokens: x_TH fp32 [S*B, H] holds the micro-batch's one-process rows
  // `rows` (counter-RNG keys; empty: rows 0..S*B-1). Under TP every TP rank holds a different sequence shard (the
  // sequence-parallel region), so router statistics are reduced over tp-cp and shared experts gather the sequence over
  // TP. The routing decision is kept in `saved.routing`. Collective over the layout's groups. replay (nullable): the
  // micro-batch's recorded routing, which this layer's router follows when it has a replay index.
  Tensor forward(const Tensor& x_TH, int64_t S, int64_t B, const TokenRows& rows, bool training, uint64_t seed,
                 uint64_t key, MoELayerActivations& saved, const RoutingReplayBatch* replay = nullptr) const;
  // Returns dx_TH (d objective / d x_TH) and accumulates every parameter gradient; aux_grad_scale as
  // TopKRouter::backward.
  Tensor backward(const Tensor& dout_TH, const Tensor& x_TH, double aux_grad_scale,
                  const MoELayerActivations& saved) const;
  // Recomputation (Megatron's --recompute-modules moe / shared_experts / moe_act, and full recompute). The layer's
  // input x_TH is kept by the caller.
  //   whole layer: drop_for_recompute frees every tensor of `saved` but the router's RNG keys and aux-loss gradient
  //     (and the routing's logged counts and losses); recompute() rebuilds them from x_TH without the forward's side
  //     effects (the router's expert-bias and global-aux counts); the layer's output too with `with_output` (full
  //     recompute: the next layer's input), else no combine. Collective as forward.
  //   shared experts: the same for saved.shared alone.
  //   expert activation: the experts' fc2 input (ExpertMLP::drop_activation / recompute_activation).
  static void drop_for_recompute(MoELayerActivations& saved);
  Tensor recompute(const Tensor& x_TH, MoELayerActivations& saved, bool with_output) const;
  void recompute_shared(const Tensor& x_TH, MoELayerActivations& saved) const;
  void drop_expert_activation(MoELayerActivations& saved) const { experts_->drop_activation(saved.experts); }
  void recompute_expert_activation(MoELayerActivations& saved) const { experts_->recompute_activation(saved.experts); }
  bool has_shared_experts() const { return shared_ != nullptr; }

  // Once per global batch, after the optimizer step: expert-bias update and global aux-loss reset.
  void finish_global_batch();

  // Training forwards record their routing into `tracer` (not owned; null: none) as router `site`.
  void set_router_tracer(RouterTracer* tracer, const RouterTraceSite& site) {
    tracer_ = tracer;
    trace_site_ = site;
  }

  // Router replay and recording (routing_replay.h): this router's number among the decoder's MoE routers (-1: not
  // replayed or recorded, e.g. an MTP depth's), and the recorder its forwards report to (not owned; null: none).
  void set_replay_router(const int64_t index) { replay_router_ = index; }
  void set_routing_recorder(RoutingRecorder* recorder) { recorder_ = recorder; }

  const TopKRouter& router() const { return *router_; }
  TopKRouter& router() { return *router_; }

 private:
  // The routing the dispatcher moves: `routing`, or its padding into `padded` (--moe-router-padding-for-quantization).
  const RouterOutput& dispatched_routing(const RouterOutput& routing, int64_t T, RouterOutput& padded) const;
  // The routed experts' input (z_TL with LatentMoE, else x itself) and their combined output projected back to
  // [T, H] fp32 (the fp32 sum of out_TX without LatentMoE).
  Tensor routed_input(const Tensor& x_TH, MoELayerActivations& saved) const;
  Tensor routed_output(Tensor combined_TX, MoELayerActivations& saved) const;

  ModelConfig config_;
  std::unique_ptr<TopKRouter> router_;
  std::unique_ptr<TokenDispatcher> dispatcher_;
  std::unique_ptr<ExpertMLP> experts_;
  std::unique_ptr<SharedExpertMLP> shared_;  // null without shared experts
  bool latent_ = false;                      // --moe-latent-size
  ColumnParallelLinear fc1_latent_, fc2_latent_;
  bool overlap_shared_ = false;     // --moe-shared-expert-overlap
  RouterTracer* tracer_ = nullptr;  // --moe-routing-trace-path
  RouterTraceSite trace_site_;
  int64_t replay_router_ = -1;
  RoutingRecorder* recorder_ = nullptr;  // moecore generate --record-routing
};

}  // namespace moecore
