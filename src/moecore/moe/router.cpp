// TopKRouter: Megatron's router.py / moe_utils.py semantics with an explicit backward.
// Legend: T tokens (t = s * B + b), H hidden, E experts, K top-k.
//
// Precision, as Megatron's TopKRouter: the logits are computed in the router dtype (router_gating_linear); every score
// function runs in fp32 on the logits rounded to fp32 (topk_routing_with_score_function and
// compute_routing_scores_for_aux_loss in moe_utils.py cast with dtype=torch.float32 / logits.float(), and so does the
// top-k > 1 softmax of sinkhorn_load_balancing). What stays in the router dtype: the top-k over the raw logits
// (softmax without --moe-router-pre-softmax), the z-loss, and sinkhorn's top-1 sigmoid (torch.sigmoid(logits)).
// The probabilities are fp32 numbers. Gradients are computed in double; an fp32 router's logits and their gradients go
// through fp32 GEMMs (the fast backend's sgemm), an fp64 router's through fp64 ones.
//
// The computing is the routing ops' (ops/routing.h: per-token kernels, parallel over tokens); the router orders them,
// sums the token counts over tp-cp / tp-dp-cp and keeps the global-aux and expert-bias bookkeeping. The switch losses
// keep per-column sums, and their gradient is one row per sequence ([B, E]), not [T, E].
#include "moecore/moe/router.h"

#include <algorithm>
#include <span>
#include <stdexcept>

#include "moecore/model/config.h"
#include "moecore/ops/convert.h"
#include "moecore/ops/elementwise.h"
#include "moecore/ops/init.h"
#include "moecore/ops/input_jitter.h"
#include "moecore/ops/linear.h"
#include "moecore/ops/precision.h"
#include "moecore/ops/quantization.h"
#include "moecore/ops/routing.h"
#include "moecore/ops/rows.h"
#include "moecore/parallel/comm_stats.h"

namespace moecore {
namespace {

// The first counter of each local row of a [rows, W] tensor: its one-process row's elements (row-major), so every
// layout draws the one-process jitter factors and forced-balance logits.
std::vector<int64_t> row_counters(const TokenRows& rows, const int64_t W) {
  std::vector<int64_t> first_R;
  first_R.reserve(static_cast<size_t>(rows.count()));
  for (const TokenRows::Run& run : rows.runs()) {
    for (int64_t t = 0; t < run.count; ++t) first_R.push_back((run.global + t) * W);
  }
  return first_R;
}

// Megatron's input jitter of this micro-batch: factors Uniform(1 - eps, 1 + eps) (all 1 without jitter).
ops::InputJitterSpec jitter_spec(const MoEConfig& config, const RouterActivations& saved) {
  return {std::max(config.input_jitter_eps, 0.0), saved.jitter_seed, saved.jitter_key};
}

// Stream of the random logits of --moe-router-force-load-balancing, distinct from the jitter stream.
constexpr uint64_t kForceBalanceSalt = 0x9e3779b97f4a7c15ULL;

bool uses_sinkhorn(const MoEConfig& config) {
  const auto& types = config.load_balancing_types;
  return std::find(types.begin(), types.end(), LoadBalancingType::kSinkhorn) != types.end();
}

// Sums token counts over `group` (fp32 is exact for counts below 2^24); a no-op on a group of one.
void sum_counts(std::vector<double>& counts, const parallel::ProcessGroup& group) {
  if (group.size() == 1) return;
  std::vector<float> buffer(counts.begin(), counts.end());
  {
    const parallel::CommTimer timer(parallel::CommKind::kOther);
    group.all_reduce(std::span<float>(buffer), parallel::ReduceOp::kSum);
  }
  for (size_t i = 0; i < counts.size(); ++i) counts[i] = static_cast<double>(buffer[i]);
}

// A tensor of `dtype` holding src's values (src itself when it already is of that dtype).
Tensor as_dtype(const Tensor& src, const DType dtype) {
  if (src.dtype() == dtype) return src;
  Tensor out = Tensor::uninitialized(src.shape(), dtype, MemCategory::kActivations);
  ops::convert(out, src);
  return out;
}

// A [n] fp64 tensor over a vector's values (a view: the vector must outlive it).
Tensor view_of(std::vector<double>& values) {
  return Tensor::from_blob(values.data(), {static_cast<int64_t>(values.size())});
}

ops::RoutingScore routing_score(const RouterScoreFunction fn) {
  switch (fn) {
    case RouterScoreFunction::kSigmoid: return ops::RoutingScore::kSigmoid;
    case RouterScoreFunction::kSqrtSoftplus: return ops::RoutingScore::kSqrtSoftplus;
    default: return ops::RoutingScore::kSoftmax;
  }
}

}  // namespace

TopKRouter::TopKRouter(const MoEConfig& config, const int64_t hidden, const bool add_bias, const std::string& prefix,
                       ParamStore& params, const parallel::ParallelState& parallel, const int module,
                       BufferStore* buffers)
    : config_(config),
      hidden_(hidden),
      add_bias_(add_bias),
      prefix_(prefix),
      tp_cp_(parallel.tp_cp),
      tp_dp_cp_(parallel.tp_dp_cp) {
  const int64_t E = config.num_experts;
  if (E <= 0) throw ConfigError("router: --num-experts must be positive, got " + std::to_string(E));
  if (config.topk < 1 || config.topk > E) {
    throw ConfigError("router: --moe-router-topk " + std::to_string(config.topk) + " must be in [1, " +
                      std::to_string(E) + "]");
  }
  if (config.group_topk > 0 &&
      (config.num_groups <= 0 || E % config.num_groups != 0 || config.group_topk > config.num_groups ||
       config.topk < config.group_topk || config.topk > config.group_topk * (E / config.num_groups))) {
    throw ConfigError("router: --moe-router-num-groups " + std::to_string(config.num_groups) +
                      " / --moe-router-group-topk " + std::to_string(config.group_topk) +
                      " need num_groups dividing the experts, group_topk <= num_groups and group_topk <= topk <= "
                      "the experts of group_topk groups");
  }
  // Replicated over TP while each TP rank routes only its sequence shard: gradients are summed over TP.
  auto add = [&](const std::string& name, const std::vector<int64_t>& shape) -> Param& {
    Param p = make_param(prefix_ + name, shape, InitKind::kNormal);
    p.grad_sum_over_tp = true;
    p.module = module;
    return params.push_back(std::move(p));
  };
  weight_ = &add("mlp.router.weight", {E, hidden});
  // Megatron initialises the router bias with init_method too.
  if (add_bias_) bias_ = &add("mlp.router.bias", {E});
  if (config.enable_expert_bias) {
    has_expert_bias_ = true;
    expert_bias_ =
        &(buffers != nullptr ? *buffers : own_buffers_).push_back(make_buffer(prefix_ + "mlp.router.expert_bias", {E}));
    local_tokens_per_expert_.assign(static_cast<size_t>(E), 0.0);
  }
  global_aux_counts_.assign(static_cast<size_t>(E), 0.0);
}

RouterOutput TopKRouter::forward(const Tensor& x_TH, const int64_t S, const int64_t B, const bool training,
                                 const uint64_t seed, const uint64_t jitter_key, RouterActivations& saved,
                                 const TokenRows& rows, const Tensor* replay_TK) {
  // The router computes in --moe-router-dtype (fp32 or fp64) under --bf16 / --fp16 too.
  const ops::ScopedActivationDType router_precision(DType::kF32);
  // Megatron keeps the router out of FP8 / FP4 (a plain torch linear outside TE's modules).
  const ops::ScopedLinearQuantization router_unquantized(nullptr);
  const int64_t T = S * B;
  saved = RouterActivations{};
  saved.S = S;
  saved.B = B;
  saved.training = training;
  saved.jitter_seed = seed;
  saved.jitter_key = jitter_key;
  saved.rows = rows.count() == 0 ? TokenRows::contiguous(0, T) : rows;
  if (saved.rows.count() != T) throw std::invalid_argument("router: token rows do not match the input");
  if (replay_TK != nullptr) {
    if (replay_TK->dtype() != DType::kI32 || replay_TK->numel() != T * config_.topk) {
      throw std::invalid_argument("router: the replayed selection must be kI32 [" + std::to_string(T) + ", " +
                                  std::to_string(config_.topk) + "]");
    }
    saved.replay_TK = *replay_TK;
  }

  if (!x_TH.defined() || !ops::activation_storage(x_TH.dtype()) || x_TH.numel() != T * hidden_) {
    throw std::invalid_argument("router: the input must be fp32 [" + std::to_string(T) + ", " +
                                std::to_string(hidden_) + "], got " + (x_TH.defined() ? x_TH.shape_str() : "none"));
  }
  jittered_input(saved, x_TH);
  compute_logits(saved);
  const Tensor probs_TK = route_tokens(saved, training);

  RouterOutput out;
  apply_capacity(out, saved, probs_TK);
  out.load_balancing_losses.assign(config_.load_balancing_types.size(), 0.0);
  if (training) {
    attach_losses(out, saved);
    record_expert_bias_counts(out);
  }
  return out;
}

RouterOutput TopKRouter::recompute(const Tensor& x_TH, RouterActivations& saved) const {
  const ops::ScopedActivationDType router_precision(DType::kF32);
  const ops::ScopedLinearQuantization router_unquantized(nullptr);
  const int64_t T = saved.S * saved.B, E = config_.num_experts;
  if (!x_TH.defined() || !ops::activation_storage(x_TH.dtype()) || x_TH.numel() != T * hidden_) {
    throw std::invalid_argument("router recompute: the input must be fp32 [" + std::to_string(T) + ", " +
                                std::to_string(hidden_) + "]");
  }
  jittered_input(saved, x_TH);
  compute_logits(saved);
  const Tensor probs_TK = route_tokens(saved, saved.training);
  RouterOutput out;
  apply_capacity(out, saved, probs_TK);
  out.load_balancing_losses.assign(config_.load_balancing_types.size(), 0.0);
  if (!saved.training) return out;
  const Tensor logits64_TE = as_dtype(saved.logits_TE, DType::kF64);
  if (aux_losses_on(config_)) {
    saved.aux_scores_TE = Tensor({T, E}, DType::kF64, MemCategory::kActivations);
    Tensor aux_TK({T, config_.topk}, DType::kI32, MemCategory::kActivations);
    ops::aux_scores_forward(saved.aux_scores_TE, aux_TK, logits64_TE, routing_score(config_.score_function), true);
  }
  if (config_.z_loss_coeff > 0) {
    saved.lse_T = Tensor({T}, DType::kF64, MemCategory::kActivations);
    ops::z_loss_forward(saved.lse_T, logits64_TE, 1.0 / static_cast<double>(tp_cp_.size()));
  }
  return out;
}

void TopKRouter::drop_for_recompute(RouterActivations& saved) {
  saved.input_TH = saved.logits_TE = saved.selected_TK = saved.aux_scores_TE = saved.lse_T = Tensor();
}

// Megatron's TopKRouter.apply_input_jitter: input * Uniform(1 - eps, 1 + eps), in training and in evaluation.
void TopKRouter::jittered_input(RouterActivations& saved, const Tensor& x_TH) const {
  const int64_t T = saved.S * saved.B, H = hidden_;
  saved.input_TH = Tensor({T, H}, DType::kF32, MemCategory::kActivations);
  if (config_.input_jitter_eps <= 0) {
    ops::convert(saved.input_TH, x_TH);  // a 16-bit input cast to fp32, exactly
    return;
  }
  ops::input_jitter_forward(saved.input_TH, x_TH, row_counters(saved.rows, H), H, jitter_spec(config_, saved));
}

// logits = x W^T (+ b) in the router dtype (fp32: one fp32 GEMM with the bias, as Megatron's router_gating_linear;
// fp64: in double); --moe-router-force-load-balancing replaces them with N(0, 1) draws (straight-through: backward
// treats them as the logits, as Megatron's RandomSTE).
void TopKRouter::compute_logits(RouterActivations& saved) const {
  const int64_t T = saved.S * saved.B, E = config_.num_experts;
  const bool fp32 = config_.router_dtype == RouterDType::kFP32;
  saved.logits_TE = Tensor::uninitialized({T, E}, fp32 ? DType::kF32 : DType::kF64, MemCategory::kActivations);
  Tensor& logits = saved.logits_TE;
  if (config_.force_load_balancing) {
    ops::normal_fill(logits, row_counters(saved.rows, E), E, saved.jitter_seed, saved.jitter_key ^ kForceBalanceSalt,
                     1.0);
    return;
  }
  if (fp32) {
    ops::linear_forward(logits, saved.input_TH, weight_->value, bias_ != nullptr ? &bias_->value : nullptr);
    return;
  }
  ops::linear_forward(logits, as_dtype(saved.input_TH, DType::kF64), as_dtype(weight_->value, DType::kF64));
  if (bias_ != nullptr) ops::add_bias_rows(logits, as_dtype(bias_->value, DType::kF64));
}

ops::TopkRoutingSpec TopKRouter::routing_spec() const {
  ops::TopkRoutingSpec spec;
  spec.score = routing_score(config_.score_function);
  spec.pre_softmax = config_.pre_softmax;
  if (config_.group_topk > 0) {
    spec.num_groups = config_.num_groups;
    spec.group_topk = config_.group_topk;
  }
  spec.scaling_factor = config_.topk_scaling_factor.value_or(0.0);
  spec.sinkhorn = uses_sinkhorn(config_);
  spec.fp32_scores = true;
  return spec;
}

// Megatron's topk_routing_with_score_function, or sinkhorn_load_balancing (training selects over the sinkhorn of the
// logits, which couples all tokens).
Tensor TopKRouter::route_tokens(RouterActivations& saved, const bool training) const {
  const int64_t T = saved.S * saved.B, E = config_.num_experts, k = config_.topk;
  ops::TopkRoutingSpec spec = routing_spec();
  Tensor balanced_TE;
  if (spec.sinkhorn && training) {
    balanced_TE = Tensor({T, E}, saved.logits_TE.dtype(), MemCategory::kActivations);
    ops::sinkhorn(balanced_TE, saved.logits_TE);
  }
  saved.selected_TK = Tensor::uninitialized({T, k}, DType::kI32, MemCategory::kActivations);
  if (saved.replay_TK.defined()) {
    spec.given_selection = true;
    std::copy_n(saved.replay_TK.data<int32_t>(), T * k, saved.selected_TK.data<int32_t>());
  }
  Tensor probs_TK = Tensor::uninitialized({T, k}, saved.logits_TE.dtype(), MemCategory::kActivations);
  const Tensor* bias_E = has_expert_bias_ ? &expert_bias_->value : nullptr;
  ops::topk_routing_forward(saved.selected_TK, probs_TK, saved.logits_TE, bias_E,
                            balanced_TE.defined() ? &balanced_TE : nullptr, spec);
  return probs_TK;
}

// Megatron's apply_router_token_dropping: keep at most C tokens per expert, or with --moe-pad-expert-input-to-capacity
// route exactly min(C, T) tokens to every expert (the capacity mask itself; padding tokens have probability 0).
void TopKRouter::apply_capacity(RouterOutput& out, const RouterActivations& saved, const Tensor& probs_TK) const {
  const int64_t T = saved.S * saved.B, E = config_.num_experts, k = config_.topk;
  if (config_.capacity_factor.has_value()) out.capacity = ops::expert_capacity(T, k, E, *config_.capacity_factor);
  const ops::RoutingDropPolicy policy = config_.drop_policy == TokenDropPolicy::kProbs
                                            ? ops::RoutingDropPolicy::kProbs
                                            : ops::RoutingDropPolicy::kPosition;
  out.routing_map_TE = Tensor({T, E}, DType::kU8, MemCategory::kActivations);
  out.tokens_per_expert_E.resize(static_cast<size_t>(E));
  Tensor counts_E = Tensor::from_blob(out.tokens_per_expert_E.data(), {E});
  Tensor probs_TE = Tensor::uninitialized({T, E}, probs_TK.dtype(), MemCategory::kActivations);
  ops::routing_map(out.routing_map_TE, probs_TE, counts_E, saved.selected_TK, probs_TK, out.capacity, policy,
                   config_.pad_expert_input_to_capacity);
  out.probs_TE = as_dtype(probs_TE, DType::kF32);
}

// The auxiliary losses (each only when its coefficient is non-zero, as Megatron) on the aux scores and their own
// plain top-k map, and the z-loss on the logits. Megatron's switch loss is
// factor * sum_j (sum_t scores_tj) counts_j over the columns j of the scores (experts; (sequence, expert) pairs for
// seq_aux_loss), so only the column sums and counts are needed, and its gradient with respect to scores_tj is
// factor * counts_j for every token: kept per column in saved.aux_grad_BE.
void TopKRouter::attach_losses(RouterOutput& out, RouterActivations& saved) {
  const int64_t S = saved.S, B = saved.B, T = S * B, E = config_.num_experts, k = config_.topk;
  const int64_t tp_cp = tp_cp_.size();
  // The scores run in fp32 on the logits, whatever the router dtype: the fp64 form of fp32 logits is exact.
  const Tensor logits64_TE = as_dtype(saved.logits_TE, DType::kF64);
  if (aux_losses_on(config_)) {
    saved.aux_scores_TE = Tensor::uninitialized({T, E}, DType::kF64, MemCategory::kActivations);
    Tensor aux_TK = Tensor::uninitialized({T, k}, DType::kI32, MemCategory::kActivations);
    ops::aux_scores_forward(saved.aux_scores_TE, aux_TK, logits64_TE, routing_score(config_.score_function), true);
    // Column sums over all tokens (aux, global aux) and per sequence (seq aux), accumulated in token order.
    Tensor sums_E({E}, DType::kF64), sums_BE({B, E}, DType::kF64), counts_BE_t({B, E}, DType::kF64);
    ops::aux_loss_sums(sums_E, sums_BE, counts_BE_t, saved.aux_scores_TE, aux_TK, B);
    const std::span<const double> counts_BE = counts_BE_t.span<double>();
    std::vector<double> counts_E(static_cast<size_t>(E), 0.0);
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t e = 0; e < E; ++e) counts_E[e] += counts_BE[b * E + e];
    }
    saved.aux_grad_BE = Tensor::zeros({B, E}, DType::kF64);
    Tensor grad_E({E}, DType::kF64);
    const auto& types = config_.load_balancing_types;
    for (size_t i = 0; i < types.size(); ++i) {
      if (std::find(types.begin(), types.begin() + static_cast<std::ptrdiff_t>(i), types[i]) !=
          types.begin() + static_cast<std::ptrdiff_t>(i)) {
        continue;  // a repeated type counts once, as Megatron's get_aux_loss_coeff
      }
      const double coeff = aux_loss_coeff(config_, types[i]);
      if (coeff == 0.0) continue;
      // Counts are summed over the ranks holding the other tokens of the same sequences (tp-cp; tp-dp-cp for the
      // global loss), scores stay local: each rank's loss is its tokens' share of the one-process loss.
      double loss = 0.0;
      grad_E.zero_();
      if (types[i] == LoadBalancingType::kAuxLoss) {
        std::vector<double> counts = counts_E;
        sum_counts(counts, tp_cp_);
        const ops::SwitchLossSpec spec{static_cast<double>(T * tp_cp), k, E, coeff};
        loss = ops::switch_loss(sums_E, view_of(counts), spec);
        ops::switch_loss_backward(grad_E, view_of(counts), spec, 1.0);
        ops::add_bias_rows(saved.aux_grad_BE, grad_E);
      } else if (types[i] == LoadBalancingType::kSeqAuxLoss) {
        // Megatron views [S*B, E] as [S, B*E]: "experts" are (sequence, expert) pairs over S tokens, divided by B.
        std::vector<double> counts(counts_BE.begin(), counts_BE.end());
        sum_counts(counts, tp_cp_);
        const ops::SwitchLossSpec spec{static_cast<double>(S * tp_cp), k, E, coeff / static_cast<double>(B)};
        loss = ops::switch_loss(sums_BE, view_of(counts), spec);
        ops::switch_loss_backward(saved.aux_grad_BE, view_of(counts), spec, 1.0);
      } else if (types[i] == LoadBalancingType::kGlobalAuxLoss) {
        loss = global_aux_loss(sums_E, counts_E, T, coeff, grad_E);
        ops::add_bias_rows(saved.aux_grad_BE, grad_E);
      } else {
        continue;
      }
      out.load_balancing_losses[i] = loss / coeff;
    }
  }
  if (config_.z_loss_coeff > 0) {
    // Megatron divides the coefficient by |TP x CP|: the ranks' losses add up to the mean over all tokens.
    saved.lse_T = Tensor({T}, DType::kF64, MemCategory::kActivations);
    out.z_loss = ops::z_loss_forward(saved.lse_T, logits64_TE, 1.0 / static_cast<double>(tp_cp));
  }
}

// Megatron's _apply_global_aux_loss: counts accumulated over the micro-batches of the global batch (summed over
// tp-dp-cp), averaged over the micro-batches so far.
double TopKRouter::global_aux_loss(const Tensor& score_sums_E, const std::vector<double>& local_counts_E,
                                   const int64_t T, const double coeff, Tensor& dscores_E) {
  const int64_t E = config_.num_experts;
  std::vector<double> counts_E = local_counts_E;
  sum_counts(counts_E, tp_dp_cp_);
  for (int64_t e = 0; e < E; ++e) global_aux_counts_[e] += counts_E[e];
  global_aux_steps_ += 1;
  std::vector<double> averaged_E(global_aux_counts_);
  for (double& c : averaged_E) c /= static_cast<double>(global_aux_steps_);
  const ops::SwitchLossSpec spec{static_cast<double>(T * tp_dp_cp_.size()), config_.topk, E, coeff};
  const double loss = ops::switch_loss(score_sums_E, view_of(averaged_E), spec);
  ops::switch_loss_backward(dscores_E, view_of(averaged_E), spec, 1.0);
  return loss;
}

// Aux-loss-free balancing (Megatron's _apply_expert_bias): the final routing map's column sums, padding included.
void TopKRouter::record_expert_bias_counts(const RouterOutput& out) {
  if (!has_expert_bias_) return;
  for (size_t e = 0; e < local_tokens_per_expert_.size(); ++e) {
    local_tokens_per_expert_[e] += static_cast<double>(out.tokens_per_expert_E[e]);
  }
}

Tensor TopKRouter::logits_backward(const Tensor& dprobs_TE, const double aux_grad_scale, const RouterActivations& saved,
                                   const RouterOutput& routing) const {
  const int64_t T = saved.S * saved.B, E = config_.num_experts;
  // Gradients in double whatever the router dtype (the fp64 form of fp32 logits is exact).
  const Tensor logits64_TE = as_dtype(saved.logits_TE, DType::kF64);
  Tensor dlogits_TE = Tensor::zeros({T, E}, DType::kF64);
  const Tensor dprobs64_TE = as_dtype(dprobs_TE.view({T, E}), DType::kF64);
  ops::topk_routing_backward(dlogits_TE, dprobs64_TE, &routing.routing_map_TE, saved.selected_TK, logits64_TE,
                             routing_spec());
  if (saved.aux_grad_BE.defined()) {
    // d(objective)/d(aux score) = aux_grad_scale * d(aux losses)/d(score) (MoEAuxLossAutoScaler).
    Tensor aux_grad_BE = saved.aux_grad_BE.clone();
    ops::scale_(aux_grad_BE, aux_grad_scale);
    ops::aux_scores_backward(dlogits_TE, aux_grad_BE, saved.aux_scores_TE, logits64_TE,
                             routing_score(config_.score_function));
  }
  if (saved.training && config_.z_loss_coeff > 0) {
    const double z_coeff = config_.z_loss_coeff / static_cast<double>(tp_cp_.size());
    ops::z_loss_backward(dlogits_TE, logits64_TE, saved.lse_T, aux_grad_scale * z_coeff);
  }
  return dlogits_TE;
}

void TopKRouter::backward(Tensor* dx_TH, const Tensor& dprobs_TE, const double aux_grad_scale,
                          const RouterActivations& saved, const RouterOutput& routing) {
  const ops::ScopedActivationDType router_precision(DType::kF32);
  const ops::ScopedLinearQuantization router_unquantized(nullptr);
  const int64_t T = saved.S * saved.B, H = hidden_, E = config_.num_experts;
  if (dx_TH != nullptr && (!ops::activation_storage(dx_TH->dtype()) || dx_TH->numel() != T * H)) {
    throw std::invalid_argument("router backward: dx must be fp32 [" + std::to_string(T) + ", " + std::to_string(H) +
                                "], got " + dx_TH->shape_str());
  }
  if (dprobs_TE.dtype() != DType::kF32 || dprobs_TE.numel() != T * E) {
    throw std::invalid_argument("router backward: dprobs must be fp32 [" + std::to_string(T) + ", " +
                                std::to_string(E) + "], got " + dprobs_TE.shape_str());
  }
  const Tensor dlogits_TE = logits_backward(dprobs_TE, aux_grad_scale, saved, routing);

  // dW += dlogits^T x, db += sum_t dlogits, dx += (dlogits W) * jitter, in the router dtype.
  const bool fp32 = config_.router_dtype == RouterDType::kFP32;
  const bool jitter = config_.input_jitter_eps > 0;
  Tensor dx_jittered;  // dlogits W before the jitter factors
  if (dx_TH != nullptr && (jitter || !fp32)) {
    dx_jittered = Tensor::zeros({T, H}, fp32 ? DType::kF32 : DType::kF64, MemCategory::kActivations);
  }
  Tensor dx_direct = dx_TH != nullptr && !dx_jittered.defined() ? dx_TH->view({T, H}) : Tensor();
  Tensor* dx = dx_jittered.defined() ? &dx_jittered : (dx_direct.defined() ? &dx_direct : nullptr);
  // The bias gradient sums the gradient the GEMMs see (fp32: the rounded one), in double, token order.
  const Tensor dlogits_router = as_dtype(dlogits_TE, fp32 ? DType::kF32 : DType::kF64);
  if (fp32) {
    ops::linear_backward(dx, &weight_->grad, nullptr, dlogits_router, &saved.input_TH, weight_->value);
    if (bias_ != nullptr) ops::bias_grad_rows(bias_->grad, dlogits_router);
  } else {
    Tensor dw_EH = Tensor::zeros({E, H}, DType::kF64);
    const Tensor x_TH = as_dtype(saved.input_TH, DType::kF64);
    ops::linear_backward(dx, &dw_EH, nullptr, dlogits_router, &x_TH, as_dtype(weight_->value, DType::kF64));
    ops::add_(weight_->grad, as_dtype(dw_EH, DType::kF32));
    if (bias_ != nullptr) {
      Tensor db_E = Tensor::zeros({E}, DType::kF64);
      ops::bias_grad_rows(db_E, dlogits_router);
      ops::add_(bias_->grad, as_dtype(db_E, DType::kF32));
    }
  }
  if (!dx_jittered.defined()) return;
  const std::vector<int64_t> first_R = row_counters(saved.rows, H);
  Tensor dx_out = dx_TH->view({T, H});
  if (fp32) {  // jittered: dx += (dlogits W) * factor, the product rounded to fp32 once
    ops::input_jitter_backward(dx_out, dx_jittered, first_R, H, jitter_spec(config_, saved));
    return;
  }
  // fp64 router: dx += the fp64 (dlogits W) * factor rounded to fp32 once.
  if (jitter) ops::input_jitter_forward(dx_jittered, dx_jittered, first_R, H, jitter_spec(config_, saved));
  ops::add_(dx_out, as_dtype(dx_jittered, DType::kF32));
}

void TopKRouter::finish_global_batch() {
  if (has_expert_bias_) {
    sum_counts(local_tokens_per_expert_, tp_dp_cp_);
    ops::expert_bias_update(expert_bias_->value, view_of(local_tokens_per_expert_), config_.bias_update_rate);
    std::fill(local_tokens_per_expert_.begin(), local_tokens_per_expert_.end(), 0.0);
  }
  std::fill(global_aux_counts_.begin(), global_aux_counts_.end(), 0.0);
  global_aux_steps_ = 0;
}

std::span<const float> TopKRouter::expert_bias() const {
  if (!has_expert_bias_) return {};
  return expert_bias_->value.span<float>();
}

std::span<float> TopKRouter::expert_bias() {
  if (!has_expert_bias_) return {};
  return expert_bias_->value.span<float>();
}

void TopKRouter::set_expert_bias(const std::span<const float> bias_E) {
  const std::span<float> dst = expert_bias();
  if (bias_E.size() != dst.size()) {
    throw std::invalid_argument("expert bias of " + std::to_string(bias_E.size()) + " values for " +
                                std::to_string(dst.size()) +
                                " (expert bias enabled: " + (has_expert_bias_ ? "yes" : "no") + ")");
  }
  std::copy(bias_E.begin(), bias_E.end(), dst.begin());
}

}  // namespace moecore
