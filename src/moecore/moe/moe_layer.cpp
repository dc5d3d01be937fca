#include "moecore/moe/moe_layer.h"

#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include "moecore/moe/routing_padding.h"
#include "moecore/ops/convert.h"
#include "moecore/ops/elementwise.h"
#include "moecore/ops/precision.h"
#include "moecore/util/trace.h"

namespace moecore {

MoELayer::MoELayer(const ModelConfig& config, const std::string& prefix, ParamStore& params,
                   const parallel::ParallelState& parallel, const int module, BufferStore* buffers)
    : config_(config),
      router_(std::make_unique<TopKRouter>(config.moe, config.hidden_size, config.add_bias_linear, prefix, params,
                                           parallel, module, buffers)),
      dispatcher_(make_token_dispatcher(config.moe.dispatcher_type, config.moe.num_experts, parallel)),
      experts_(make_experts(config.moe, config, prefix, params, parallel, module)) {
  if (config.moe.shared_expert_intermediate_size > 0) {
    // Megatron's SharedExpertMLP asserts add_bias_linear == False (shared_experts.py).
    if (config.add_bias_linear) {
      throw ConfigError(
          "--moe-shared-expert-intermediate-size requires --disable-bias-linear: shared experts have no bias (as "
          "Megatron)");
    }
    shared_ = std::make_unique<SharedExpertMLP>(config.moe, config, prefix, params, parallel, module);
    overlap_shared_ = config.moe.shared_expert_overlap;
  }
  if (config.moe.latent_size > 0) {
    // Megatron's TELinear(parallel_mode="duplicated"): fc1 initialised with init_method, fc2 with
    // output_layer_init_method; under TP each rank sees its sequence shard of the tokens (Param::grad_sum_over_tp).
    latent_ = true;
    const int64_t H = config.hidden_size, L = config.moe.latent_size;
    const bool partial = parallel.tp.size() > 1;
    LinearOptions down;
    down.bias = config.add_bias_linear;
    down.module = module;
    LinearOptions up = down;
    up.init = InitKind::kScaledNormal;
    const TensorParallel replicated;
    fc1_latent_ = ColumnParallelLinear(prefix + "mlp.fc1_latent_proj", H, L, replicated, down, params);
    fc2_latent_ = ColumnParallelLinear(prefix + "mlp.fc2_latent_proj", L, H, replicated, up, params);
    for (const ColumnParallelLinear* linear : {&fc1_latent_, &fc2_latent_}) {
      linear->weight().grad_sum_over_tp = partial;
      if (linear->bias() != nullptr) linear->bias()->grad_sum_over_tp = partial;
    }
  }
}

namespace {

Tensor activation_tensor(std::vector<int64_t> shape) {
  return Tensor(std::move(shape), ops::activation_storage_dtype(), MemCategory::kActivations);
}

}  // namespace

// --moe-router-padding-for-quantization: the dispatcher moves the padded map (built into `padded`); the router's
// statistics and backward keep the unpadded one (routing_padding.h).
const RouterOutput& MoELayer::dispatched_routing(const RouterOutput& routing, const int64_t T,
                                                 RouterOutput& padded) const {
  if (config_.moe.router_padding_multiple <= 0) return routing;
  padded = padded_routing(routing, T, config_.moe.num_experts, config_.moe.router_padding_multiple);
  return padded;
}

Tensor MoELayer::routed_input(const Tensor& x_TH, MoELayerActivations& saved) const {
  if (!latent_) return x_TH;
  const trace::Scope scope("fc1_latent_proj", "moe");
  return fc1_latent_.forward(x_TH, saved.latent_down, InputKeepers::kShared);
}

Tensor MoELayer::routed_output(Tensor combined_TX, MoELayerActivations& saved) const {
  if (!latent_) return combined_TX;
  const trace::Scope scope("fc2_latent_proj", "moe");
  // fc2_latent_proj reads (and keeps) the combined output in the activation dtype, as Megatron's combine returns it.
  if (combined_TX.dtype() != ops::activation_storage_dtype()) {
    Tensor rounded_TX = ops::uninitialized_activation(combined_TX.shape());
    ops::convert(rounded_TX, combined_TX);
    combined_TX = std::move(rounded_TX);
  }
  Tensor y_TH = fc2_latent_.forward(combined_TX, saved.latent_up, InputKeepers::kLinearOnly);
  if (y_TH.dtype() == DType::kF32) return y_TH;
  Tensor out_TH({y_TH.dim(0), y_TH.dim(1)}, DType::kF32, MemCategory::kActivations);
  ops::convert(out_TH, y_TH);
  return out_TH;
}

Tensor MoELayer::forward(const Tensor& x_TH, const int64_t S, const int64_t B, const TokenRows& rows,
                         const bool training, const uint64_t seed, const uint64_t key, MoELayerActivations& saved,
                         const RoutingReplayBatch* replay) const {
  const int64_t T = S * B, H = config_.hidden_size;
  if (!x_TH.defined() || !ops::activation_storage(x_TH.dtype()) || x_TH.numel() != T * H) {
    throw std::invalid_argument("MoE layer: x_TH must be fp32 / 16-bit [S*B, H] = [" + std::to_string(T) + ", " +
                                std::to_string(H) + "], got " + (x_TH.defined() ? x_TH.shape_str() : "none"));
  }
  const Tensor x = x_TH.view({T, H});
  {
    const trace::Scope scope("router forward", "moe");
    Tensor replay_TK;
    if (replay != nullptr && replay_router_ >= 0) replay_TK = replay->local_selection(replay_router_, rows, T);
    saved.routing =
        router_->forward(x, S, B, training, seed, key, saved.router, rows, replay_TK.defined() ? &replay_TK : nullptr);
  }
  if (recorder_ != nullptr && replay_router_ >= 0) recorder_->record(replay_router_, saved.router.selected_TK);
  if (training && tracer_ != nullptr && tracer_->active()) {
    tracer_->record(trace_site_, saved.routing.routing_map_TE, config_.moe.topk, x, saved.router.logits_TE,
                    {router_->weight(), router_->expert_bias(), to_string(config_.moe.score_function)});
  }
  RouterOutput padded;
  const RouterOutput& dispatched = dispatched_routing(saved.routing, T, padded);
  const Tensor z_TX = routed_input(x, saved);  // X: H, or the latent width
  Tensor x_RH, shared_TH;
  if (overlap_shared_) {
    // Megatron's --moe-shared-expert-overlap: the shared experts run after the router, while the dispatch
    // all-to-all is in flight; their output joins the routed one after combine, as without overlap.
    shared_TH = activation_tensor({T, H});
    const std::function<void()> shared_forward = [&] {
      const trace::Scope shared_scope("shared experts forward", "moe");
      shared_->forward(shared_TH, x, saved.shared);
    };
    const trace::Scope scope("dispatch", "moe");
    x_RH = dispatcher_->dispatch_overlapped(z_TX, dispatched, saved.dispatch, &shared_forward);
  } else {
    const trace::Scope scope("dispatch", "moe");
    x_RH = dispatcher_->dispatch(z_TX, dispatched, saved.dispatch);
  }
  Tensor y_RH;
  {
    const trace::Scope scope("experts forward", "moe");
    y_RH = experts_->forward(x_RH, saved.dispatch.probs_R, saved.dispatch.tokens_per_expert_E, saved.experts);
  }
  x_RH = Tensor();
  // fp32: the allgather dispatcher adds its fp32 sum over the group unrounded (token_dispatcher_allgather.cpp).
  Tensor combined_TX({T, z_TX.dim(1)}, DType::kF32, MemCategory::kActivations);
  {
    const trace::Scope scope("combine", "moe");
    dispatcher_->combine(combined_TX, y_RH, saved.dispatch);
  }
  y_RH = Tensor();
  Tensor out_TH = routed_output(std::move(combined_TX), saved);
  if (overlap_shared_) {
    ops::add_(out_TH, shared_TH);
  } else if (shared_) {
    const trace::Scope scope("shared experts forward", "moe");
    shared_->forward(out_TH, x, saved.shared);
  }
  return out_TH;
}

Tensor MoELayer::backward(const Tensor& dout_TH, const Tensor& x_TH, const double aux_grad_scale,
                          const MoELayerActivations& saved) const {
  const DispatchState& state = saved.dispatch;
  // Local tokens over all experts; R rows of this rank's local experts (what the experts received); X the routed
  // width (H, or the latent size).
  const int64_t T = saved.router.S * saved.router.B, H = config_.hidden_size, E = config_.moe.num_experts;
  const int64_t X = latent_ ? config_.moe.latent_size : H;
  // (x_RH itself may be gone: under FP8 / FP4 the experts keep it quantized.)
  int64_t R = 0;
  for (const int64_t rows : saved.experts.tokens_per_expert_E) R += rows;
  if (!dout_TH.defined() || !ops::activation_storage(dout_TH.dtype()) || dout_TH.numel() != T * H || !x_TH.defined() ||
      x_TH.numel() != T * H) {
    throw std::invalid_argument("MoE layer: dout_TH and x_TH must be fp32 / 16-bit [" + std::to_string(T) + ", " +
                                std::to_string(H) + "]");
  }
  const Tensor dout = dout_TH.view({T, H}), x = x_TH.view({T, H});
  // fp32: the router adds its gradient unrounded (router.cpp), as the fp32 main path does.
  Tensor dx_TH({T, H}, DType::kF32, MemCategory::kActivations);
  Tensor dcombined_TX = dout;
  if (latent_) {
    const trace::Scope scope("fc2_latent_proj backward", "moe");
    dcombined_TX = activation_tensor({T, X});
    fc2_latent_.backward(dcombined_TX, dout, saved.latent_up);
  }
  Tensor dy_RH = activation_tensor({R, X});
  Tensor shared_dx_TH;
  if (overlap_shared_) {
    // The shared experts' backward runs while the output gradients travel to the experts; their input gradient
    // joins the routed one at the end, so the sum's order matches the layer without overlap but for the gate.
    shared_dx_TH = activation_tensor({T, H});
    const std::function<void()> shared_backward = [&] {
      const trace::Scope shared_scope("shared experts backward", "moe");
      shared_->backward(shared_dx_TH, dout, x, saved.shared);
    };
    const trace::Scope scope("combine backward", "moe");
    dispatcher_->combine_backward(dy_RH, dcombined_TX, state, &shared_backward);
  } else {
    const trace::Scope scope("combine backward", "moe");
    dispatcher_->combine_backward(dy_RH, dcombined_TX, state);
  }
  dcombined_TX = Tensor();
  Tensor dx_RH = activation_tensor({R, X});
  Tensor dprobs_R({R}, DType::kF32, MemCategory::kActivations);  // probability gradients stay fp32
  // --delay-wgrad-compute: the experts' weight gradients run while their data gradients travel back.
  std::function<void()> weight_grads;
  {
    const trace::Scope scope("experts backward", "moe");
    experts_->backward(dx_RH, dprobs_R, dy_RH, saved.experts,
                       config_.moe.delay_wgrad_compute ? &weight_grads : nullptr);
  }
  dy_RH = Tensor();
  Tensor dprobs_TE({T, E}, DType::kF32, MemCategory::kActivations);
  Tensor dz_TL = latent_ ? activation_tensor({T, X}) : Tensor();
  {
    const trace::Scope scope("dispatch backward", "moe");
    const std::function<void()> delayed_weight_grads = [&] {
      const trace::Scope wgrad_scope("experts weight gradients", "moe");
      weight_grads();
    };
    Tensor& dz_TX = latent_ ? dz_TL : dx_TH;
    dispatcher_->dispatch_backward_with_probs(dz_TX, dprobs_TE, dx_RH, dprobs_R, state,
                                              weight_grads ? &delayed_weight_grads : nullptr);
  }
  dx_RH = Tensor();
  if (latent_) {
    // The dispatcher overwrites its output; fc1_latent_proj's backward accumulates.
    const trace::Scope scope("fc1_latent_proj backward", "moe");
    dx_TH = Tensor::zeros({T, H}, DType::kF32, MemCategory::kActivations);
    fc1_latent_.backward(dx_TH, dz_TL, saved.latent_down);
    dz_TL = Tensor();
  }
  {
    const trace::Scope scope("router backward", "moe");
    router_->backward(&dx_TH, dprobs_TE, aux_grad_scale, saved.router, saved.routing);
  }
  if (overlap_shared_) {
    ops::add_(dx_TH, shared_dx_TH);
  } else if (shared_) {
    const trace::Scope scope("shared experts backward", "moe");
    shared_->backward(dx_TH, dout, x, saved.shared);
  }
  return dx_TH;
}

void MoELayer::drop_for_recompute(MoELayerActivations& saved) {
  TopKRouter::drop_for_recompute(saved.router);
  saved.routing.probs_TE = saved.routing.routing_map_TE = Tensor();
  saved.dispatch = DispatchState{};
  saved.experts = ExpertActivations{};
  saved.shared = SharedExpertActivations{};
  saved.latent_down = saved.latent_up = LinearActivations{};
}

Tensor MoELayer::recompute(const Tensor& x_TH, MoELayerActivations& saved, const bool with_output) const {
  const int64_t T = saved.router.S * saved.router.B, H = config_.hidden_size;
  const Tensor x = x_TH.view({T, H});
  {
    const trace::Scope scope("router recompute", "moe");
    RouterOutput routing = router_->recompute(x, saved.router);
    routing.load_balancing_losses = std::move(saved.routing.load_balancing_losses);
    routing.z_loss = saved.routing.z_loss;
    saved.routing = std::move(routing);
  }
  RouterOutput padded;
  const RouterOutput& dispatched = dispatched_routing(saved.routing, T, padded);
  const Tensor z_TX = routed_input(x, saved);
  Tensor x_RH;
  {
    const trace::Scope scope("dispatch recompute", "moe");
    x_RH = dispatcher_->dispatch(z_TX, dispatched, saved.dispatch);
  }
  Tensor y_RH;
  {
    const trace::Scope scope("experts recompute", "moe");
    y_RH = experts_->forward(x_RH, saved.dispatch.probs_R, saved.dispatch.tokens_per_expert_E, saved.experts);
  }
  x_RH = Tensor();
  // Without the output only what backward reads is rebuilt: with LatentMoE that includes fc2_latent_proj's input,
  // the combined output.
  if (!with_output && !latent_) {
    if (shared_) recompute_shared(x_TH, saved);
    return Tensor();
  }
  // fp32: the allgather dispatcher adds its fp32 sum over the group unrounded (token_dispatcher_allgather.cpp).
  Tensor combined_TX({T, z_TX.dim(1)}, DType::kF32, MemCategory::kActivations);
  {
    const trace::Scope scope("combine", "moe");
    dispatcher_->combine(combined_TX, y_RH, saved.dispatch);
  }
  y_RH = Tensor();
  Tensor out_TH = routed_output(std::move(combined_TX), saved);
  if (!with_output) {
    if (shared_) recompute_shared(x_TH, saved);
    return Tensor();
  }
  if (shared_) {
    const trace::Scope scope("shared experts recompute", "moe");
    shared_->forward(out_TH, x, saved.shared);
  }
  return out_TH;
}

void MoELayer::recompute_shared(const Tensor& x_TH, MoELayerActivations& saved) const {
  const int64_t T = saved.router.S * saved.router.B, H = config_.hidden_size;
  const trace::Scope scope("shared experts recompute", "moe");
  Tensor unused_TH = Tensor::zeros({T, H}, DType::kF32, MemCategory::kActivations);
  shared_->forward(unused_TH, x_TH.view({T, H}), saved.shared);
}

void MoELayer::finish_global_batch() { router_->finish_global_batch(); }

}  // namespace moecore
