#include "moecore/moe/moe_layer.h"

#include <cstring>

#include "moecore/moe/routing_padding.h"
#include "moecore/ops/elementwise.h"
#include "moecore/util/trace.h"

namespace moecore {

MoELayer::MoELayer(const ModelConfig& config, const std::string& prefix, std::vector<Param>& params,
                   const parallel::ParallelState& parallel, const int module, std::vector<Buffer>* buffers)
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
}

void MoELayer::bind(std::vector<Param>& params, std::vector<Buffer>* buffers) {
  router_->bind(params, buffers);
  experts_->bind(params);
  if (shared_) shared_->bind(params);
}

void MoELayer::forward(float* out_TH, const float* x_TH, const int64_t S, const int64_t B, const TokenRows& rows,
                       const bool training, const uint64_t seed, const uint64_t key, MoELayerActivations& saved) const {
  const int64_t T = S * B, H = config_.hidden_size;
  {
    const trace::Scope scope("router forward", "moe");
    saved.routing = router_->forward(Tensor::from_blob(x_TH, {T, H}), S, B, training, seed, key, saved.router, rows);
  }
  // --moe-router-padding-for-quantization: the dispatcher moves the padded map; the router's statistics and
  // backward keep the unpadded one (routing_padding.h).
  RouterOutput padded;
  if (config_.moe.router_padding_multiple > 0) {
    padded = padded_routing(saved.routing, T, config_.moe.num_experts, config_.moe.router_padding_multiple);
  }
  const RouterOutput& dispatched = config_.moe.router_padding_multiple > 0 ? padded : saved.routing;
  Tensor x_RH, shared_TH;
  if (overlap_shared_) {
    // Megatron's --moe-shared-expert-overlap: the shared experts run after the router, while the dispatch
    // all-to-all is in flight; their output joins the routed one after combine, as without overlap.
    shared_TH = Tensor(std::vector<int64_t>{T, H}, DType::kF32, MemCategory::kActivations);
    const trace::Scope scope("dispatch", "moe");
    x_RH = dispatcher_->dispatch_overlapped(x_TH, T, H, dispatched, saved.dispatch, [&] {
      const trace::Scope shared_scope("shared experts forward", "moe");
      shared_->forward(shared_TH.data<float>(), x_TH, T, saved.shared);
    });
  } else {
    const trace::Scope scope("dispatch", "moe");
    x_RH = dispatcher_->dispatch(x_TH, T, H, dispatched, saved.dispatch);
  }
  const int64_t R = x_RH.dim(0);
  Tensor y_RH(std::vector<int64_t>{R, H}, DType::kF32, MemCategory::kActivations);
  {
    const trace::Scope scope("experts forward", "moe");
    experts_->forward(y_RH.data<float>(), x_RH.data<float>(), saved.dispatch.probs_R.data(),
                      saved.dispatch.tokens_per_expert_E, saved.experts);
  }
  std::memset(out_TH, 0, sizeof(float) * static_cast<size_t>(T * H));
  {
    const trace::Scope scope("combine", "moe");
    dispatcher_->combine(out_TH, y_RH.data<float>(), saved.dispatch);
  }
  if (overlap_shared_) {
    Tensor out = Tensor::from_blob(out_TH, {T, H});
    ops::add_(out, shared_TH);
  } else if (shared_) {
    const trace::Scope scope("shared experts forward", "moe");
    shared_->forward(out_TH, x_TH, T, saved.shared);
  }
}

void MoELayer::backward(float* dx_TH, const float* dout_TH, const float* x_TH, const double aux_grad_scale,
                        const MoELayerActivations& saved) const {
  const DispatchState& state = saved.dispatch;
  // Local tokens over all experts; R rows of this rank's local experts (what the experts received).
  const int64_t T = saved.router.S * saved.router.B, H = config_.hidden_size, E = config_.moe.num_experts;
  const int64_t R = saved.experts.x_RH.dim(0);
  Tensor dy_RH(std::vector<int64_t>{R, H}, DType::kF32, MemCategory::kActivations);
  Tensor shared_dx_TH;
  if (overlap_shared_) {
    // The shared experts' backward runs while the output gradients travel to the experts; their input gradient
    // joins the routed one at the end, so the sum's order matches the layer without overlap but for the gate.
    shared_dx_TH = Tensor(std::vector<int64_t>{T, H}, DType::kF32, MemCategory::kActivations);
    const trace::Scope scope("combine backward", "moe");
    dispatcher_->combine_backward_overlapped(dy_RH.data<float>(), dout_TH, state, [&] {
      const trace::Scope shared_scope("shared experts backward", "moe");
      shared_->backward(shared_dx_TH.data<float>(), dout_TH, x_TH, T, saved.shared);
    });
  } else {
    const trace::Scope scope("combine backward", "moe");
    dispatcher_->combine_backward(dy_RH.data<float>(), dout_TH, state);
  }
  Tensor dx_RH(std::vector<int64_t>{R, H}, DType::kF32, MemCategory::kActivations);
  std::vector<float> dprobs_R(static_cast<size_t>(R));
  {
    const trace::Scope scope("experts backward", "moe");
    experts_->backward(dx_RH.data<float>(), dprobs_R.data(), dy_RH.data<float>(), saved.experts);
  }
  dy_RH = Tensor();
  {
    const trace::Scope scope("dispatch backward", "moe");
    dispatcher_->dispatch_backward(dx_TH, dx_RH.data<float>(), state);
  }
  dx_RH = Tensor();
  Tensor dprobs_TE(std::vector<int64_t>{T, E}, DType::kF32, MemCategory::kActivations);
  {
    const trace::Scope scope("router backward", "moe");
    dispatcher_->probs_backward(dprobs_TE.data<float>(), dprobs_R.data(), state);
    Tensor dx = Tensor::from_blob(dx_TH, {T, H});
    router_->backward(&dx, dprobs_TE, aux_grad_scale, saved.router, saved.routing);
  }
  if (overlap_shared_) {
    Tensor dx = Tensor::from_blob(dx_TH, {T, H});
    ops::add_(dx, shared_dx_TH);
  } else if (shared_) {
    const trace::Scope scope("shared experts backward", "moe");
    shared_->backward(dx_TH, dout_TH, x_TH, T, saved.shared);
  }
}

void MoELayer::finish_global_batch() { router_->finish_global_batch(); }

}  // namespace moecore
