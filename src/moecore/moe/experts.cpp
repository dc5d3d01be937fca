// Routed experts: parameter registration (one MLP per local expert), the entry points shared by GroupedMLP and
// SequentialMLP, and the factory. Each expert computes y = fc2(act(fc1(x)) * p) + p b2, or
// y = fc2(act(fc1(x * p))) + b2 with --moe-apply-probs-on-input (Megatron's placement of the router probability).
#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>

#include "moecore/moe/experts_internal.h"
#include "moecore/ops/linear.h"
#include "moecore/ops/precision.h"
#include "moecore/ops/quantization.h"
#include "moecore/ops/rows.h"

namespace moecore {

void ExpertMLP::drop_activation(ExpertActivations & /*saved*/) const {
  throw std::logic_error("moe_act recompute needs the grouped experts (--moe-grouped-gemm)");
}

void ExpertMLP::recompute_activation(ExpertActivations & /*saved*/) const {
  throw std::logic_error("moe_act recompute needs the grouped experts (--moe-grouped-gemm)");
}

namespace experts_detail {

std::vector<int64_t> expert_offsets(const std::vector<int64_t> &tokens_per_expert_E, const int64_t E) {
  if (static_cast<int64_t>(tokens_per_expert_E.size()) != E) {
    throw std::invalid_argument("experts: tokens_per_expert has " + std::to_string(tokens_per_expert_E.size()) +
                                " entries, expected " + std::to_string(E) + " local experts");
  }
  std::vector<int64_t> offsets_E1(static_cast<size_t>(E + 1), 0);
  for (int64_t e = 0; e < E; ++e) {
    if (tokens_per_expert_E[e] < 0) {
      throw std::invalid_argument("experts: negative token count " + std::to_string(tokens_per_expert_E[e]) +
                                  " for expert " + std::to_string(e));
    }
    offsets_E1[e + 1] = offsets_E1[e] + tokens_per_expert_E[e];
  }
  return offsets_E1;
}

ExpertMLPBase::ExpertMLPBase(const MoEConfig &moe, const ModelConfig &model, const std::string &prefix,
                             ParamStore &params, const parallel::ParallelState &parallel, const int module)
    : E_(moe.num_experts),
      H_(moe.latent_size > 0 ? moe.latent_size : model.hidden_size),
      F_(moe.ffn_hidden_size),
      activation_(model.activation),
      probs_on_input_(moe.apply_probs_on_input),
      memory_efficient_permutation_(moe.memory_efficient_permutation) {
  if (E_ <= 0) throw ConfigError("experts: --num-experts must be positive, got " + std::to_string(E_));
  if (F_ <= 0) throw ConfigError("experts: --moe-ffn-hidden-size must be positive, got " + std::to_string(F_));
  if (H_ <= 0) {
    throw ConfigError("experts: --hidden-size (--moe-latent-size with LatentMoE) must be positive, got " +
                      std::to_string(H_));
  }
  const int ep = parallel.ep_size(), etp = parallel.etp_size();
  if (E_ % ep != 0) {
    throw ConfigError("experts: --num-experts " + std::to_string(E_) +
                      " is not divisible by --expert-model-parallel-size " + std::to_string(ep));
  }
  if (model.add_bias_linear && etp > 1) {
    throw ConfigError(
        std::string("experts: bias in MoE layers (--add-bias-linear) needs --expert-tensor-parallel-size 1, got ") +
        std::to_string(etp));
  }
  if (F_ % etp != 0) {
    throw ConfigError("experts: --moe-ffn-hidden-size " + std::to_string(F_) +
                      " is not divisible by --expert-tensor-parallel-size " + std::to_string(etp));
  }
  MLPOptions options;
  options.ffn_hidden_size = F_;
  options.activation = activation_;
  options.bias = model.add_bias_linear;
  options.probs_on_input = probs_on_input_;
  options.linear.explicit_expert_comm = true;  // the token dispatcher reduces over expert-TP
  options.linear.is_expert = true;
  options.linear.module = module;
  const TensorParallel etp_group(parallel.etp, false);
  E_ /= ep;
  F_ /= etp;
  F1_ = ops::activation_input_width(activation_, F_);
  const int64_t first = static_cast<int64_t>(parallel.ep_rank()) * E_;
  for (int64_t e = first; e < first + E_; ++e) {
    experts_.emplace_back(prefix + "mlp.experts.local_experts." + std::to_string(e) + ".", H_, options, etp_group,
                          params);
  }
}

namespace {

// Throws std::invalid_argument unless t is an fp32 / bf16 / fp16 tensor of `shape`'s elements.
void check_rows(const char *name, const Tensor &t, const std::vector<int64_t> &shape) {
  int64_t n = 1;
  for (const int64_t d : shape) n *= d;
  if (!t.defined() || !ops::activation_storage(t.dtype()) || t.numel() != n) {
    std::string want;
    for (const int64_t d : shape) want += (want.empty() ? "" : ", ") + std::to_string(d);
    throw std::invalid_argument(std::string("experts: ") + name + " must be fp32 / 16-bit [" + want + "], got " +
                                (t.defined() ? t.shape_str() : std::string("none")));
  }
}

}  // namespace

Tensor ExpertMLPBase::forward(const Tensor &x_RH, const Tensor &probs_R,
                              const std::vector<int64_t> &tokens_per_expert_E, ExpertActivations &saved) {
  const std::vector<int64_t> offsets_E1 = expert_offsets(tokens_per_expert_E, E_);
  const int64_t R = offsets_E1.back();
  check_rows("x_RH", x_RH, {R, H_});
  check_rows("probs_R", probs_R, {R});
  saved = ExpertActivations{};
  saved.tokens_per_expert_E = tokens_per_expert_E;
  saved.x_RH = x_RH.view({R, H_});
  saved.probs_R = probs_R.view({R});
  if (!memory_efficient_permutation_) {
    saved.output_probs_R = saved.probs_R;
    std::vector<float> ones_R(static_cast<size_t>(R), 1.0f);
    saved.probs_R = Tensor::from_blob(ones_R.data(), {R}).clone(MemCategory::kActivations);
  }
  Tensor y(std::vector<int64_t>{R, H_}, ops::activation_storage_dtype(), MemCategory::kActivations);
  run_forward(offsets_E1, y, saved);
  if (!memory_efficient_permutation_) y = apply_output_probs(y, saved);
  // FP8 delayed scaling: TE's GroupedLinear casts every expert's weight, and Megatron's SequentialMLP runs every
  // expert, with tokens or not, so an expert without rows still records its weights' amaxes (a forward of no rows).
  const quant::QuantizedLinearConfig *quantization = ops::linear_quantization();
  if (quantization == nullptr || quantization->recipe != quant::Recipe::kDelayed) return y;
  for (int64_t e = 0; e < E_; ++e) {
    if (offsets_E1[e + 1] != offsets_E1[e]) continue;
    const MLP &expert = experts_[static_cast<size_t>(e)];
    for (const Param *w : {&expert.fc1().weight(), &expert.fc2().weight()}) {
      const int64_t out = w->value.dim(0), in = w->value.numel() / out;
      Tensor none_out = Tensor::zeros({0, out}), none_in = Tensor::zeros({0, in});
      ops::linear_forward(none_out, none_in, w->value, nullptr, w->delayed_scaling.get());
    }
  }
  return y;
}

void ExpertMLPBase::backward(Tensor &dx_RH, Tensor &dprobs_R, const Tensor &dy_RH, const ExpertActivations &saved,
                             std::function<void()> *deferred_weight_grads) {
  if (deferred_weight_grads != nullptr && !defers_weight_grads()) {
    throw std::logic_error("deferred weight gradients need the grouped experts (--moe-grouped-gemm)");
  }
  const std::vector<int64_t> offsets_E1 = expert_offsets(saved.tokens_per_expert_E, E_);
  const int64_t R = offsets_E1.back();
  check_rows("dx_RH", dx_RH, {R, H_});
  check_rows("dprobs_R", dprobs_R, {R});
  check_rows("dy_RH", dy_RH, {R, H_});
  Tensor dx = dx_RH.view({R, H_});
  Tensor dprobs = dprobs_R.view({R});
  if (memory_efficient_permutation_) {
    run_backward(offsets_E1, dx, dprobs, dy_RH.view({R, H_}), saved, deferred_weight_grads);
    return;
  }
  // y = p y_mlp: dp = <dy, y_mlp>, d(y_mlp) = p dy; the MLPs' own probabilities are ones. A deferred weight
  // gradient holds dy_mlp (its dy) by value.
  Tensor dy_mlp({R, H_}, ops::activation_storage_dtype(), MemCategory::kActivations);
  ops::scale_rows_backward(&dy_mlp, &dprobs, dy_RH.view({R, H_}), saved.y_RH, saved.output_probs_R);
  Tensor dones({R}, DType::kF32, MemCategory::kActivations);
  run_backward(offsets_E1, dx, dones, dy_mlp, saved, deferred_weight_grads);
}

Tensor ExpertMLPBase::apply_output_probs(const Tensor &y_RH, ExpertActivations &saved) const {
  saved.y_RH = y_RH;
  Tensor scaled(y_RH.shape(), ops::activation_storage_dtype(), MemCategory::kActivations);
  ops::scale_rows(scaled, y_RH, saved.output_probs_R);
  return scaled;
}

}  // namespace experts_detail

std::unique_ptr<ExpertMLP> make_experts(const MoEConfig &moe, const ModelConfig &model, const std::string &prefix,
                                        ParamStore &params, const parallel::ParallelState &parallel, const int module) {
  if (moe.grouped_gemm) return experts_detail::make_grouped_mlp(moe, model, prefix, params, parallel, module);
  return experts_detail::make_sequential_mlp(moe, model, prefix, params, parallel, module);
}

}  // namespace moecore
