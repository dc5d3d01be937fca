// TopKRouter: Megatron's router.py / moe_utils.py semantics with an explicit backward.
// Legend: T tokens (t = s * B + b), H hidden, E experts, K top-k.
//
// Precision, as Megatron's TopKRouter: the logits are computed in the router dtype (router_gating_linear); every score
// function runs in fp32 on the logits rounded to fp32 (topk_routing_with_score_function and
// compute_routing_scores_for_aux_loss in moe_utils.py cast with dtype=torch.float32 / logits.float(), and so does the
// top-k > 1 softmax of sinkhorn_load_balancing). What stays in the router dtype: the top-k over the raw logits
// (softmax without --moe-router-pre-softmax), the z-loss, and sinkhorn's top-1 sigmoid (torch.sigmoid(logits)).
// The probabilities are fp32 numbers. Gradients are computed in double.
#include "moecore/moe/router.h"

#include <algorithm>
#include <span>
#include <stdexcept>

#include "moecore/model/config.h"
#include "moecore/moe/load_balancing.h"
#include "moecore/moe/routing_math.h"
#include "moecore/ops/linear.h"
#include "moecore/parallel/comm_stats.h"
#include "moecore/tensor/rng.h"

namespace moecore {
namespace {

using routing::to_fp32;

// Stream of the random logits of --moe-router-force-load-balancing, distinct from the jitter stream.
constexpr uint64_t kForceBalanceSalt = 0x9e3779b97f4a7c15ULL;

// Megatron's get_aux_loss_coeff: the coefficient of the first entry of that type, 0 when absent.
double coeff_of(const MoEConfig& config, const LoadBalancingType type) {
  const auto& types = config.load_balancing_types;
  const auto it = std::find(types.begin(), types.end(), type);
  const auto index = static_cast<size_t>(it - types.begin());
  return it == types.end() || index >= config.aux_loss_coeffs.size() ? 0.0 : config.aux_loss_coeffs[index];
}

bool aux_losses_on(const MoEConfig& config) {
  return coeff_of(config, LoadBalancingType::kAuxLoss) > 0 || coeff_of(config, LoadBalancingType::kSeqAuxLoss) > 0 ||
         coeff_of(config, LoadBalancingType::kGlobalAuxLoss) > 0;
}

bool uses_sinkhorn(const MoEConfig& config) {
  const auto& types = config.load_balancing_types;
  return std::find(types.begin(), types.end(), LoadBalancingType::kSinkhorn) != types.end();
}

// --moe-router-topk-scaling-factor; Megatron applies it when truthy (`if scaling_factor:`), never on sinkhorn routing.
bool scales_probs(const MoEConfig& config) {
  return config.topk_scaling_factor.value_or(0.0) != 0.0 && !uses_sinkhorn(config);
}

// Uniform(1 - eps, 1 + eps) in fp32, as torch's rsample on fp32 bounds.
float jitter_factor(const CounterRng& rng, const uint64_t index, const double eps) {
  const float low = static_cast<float>(1.0 - eps), high = static_cast<float>(1.0 + eps);
  return low + (high - low) * rng.uniform(index);
}

std::vector<double> to_double(const float* values, const int64_t n) { return {values, values + n}; }

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

// Megatron's TopKRouter.sinkhorn_load_balancing: training selects the top-k of sinkhorn(fp32 logits), evaluation the
// top-k of the activation; probs = activation * map, not renormalised and not scaled.
void sinkhorn_routing(std::vector<uint8_t>& selected_TE, std::vector<double>& probs_TE,
                      const std::vector<double>& logits_TE, const int64_t T, const int64_t E, const int64_t k,
                      const bool training, const bool fp32_logits) {
  const std::vector<float> balanced_TE = training ? routing::sinkhorn(logits_TE.data(), T, E) : std::vector<float>{};
  std::vector<double> act_E(static_cast<size_t>(E)), route_E(static_cast<size_t>(E));
  std::vector<int64_t> idx_K(static_cast<size_t>(k));
  for (int64_t t = 0; t < T; ++t) {
    const double* l_E = logits_TE.data() + t * E;
    if (k == 1) {  // torch.sigmoid(logits): in the logits' dtype
      for (int64_t e = 0; e < E; ++e) {
        const double s = routing::sigmoid(l_E[e]);
        act_E[e] = fp32_logits ? to_fp32(s) : s;
      }
    } else {  // torch.softmax(logits, dtype=torch.float32)
      routing::softmax_fp32(act_E.data(), l_E, E);
    }
    if (training) {
      for (int64_t e = 0; e < E; ++e) route_E[e] = balanced_TE[static_cast<size_t>(t * E + e)];
      routing::topk(idx_K.data(), route_E.data(), E, k);
    } else {
      routing::topk(idx_K.data(), act_E.data(), E, k);
    }
    for (const int64_t e : idx_K) {
      selected_TE[t * E + e] = 1;
      probs_TE[t * E + e] = act_E[e];
    }
  }
}

// Megatron's topk_routing_with_score_function (moe_utils.py, unfused path) on every token. --moe-router-pre-softmax
// only matters for softmax scores (Megatron ignores it for sigmoid / sqrtsoftplus).
void score_function_routing(std::vector<uint8_t>& selected_TE, std::vector<double>& probs_TE,
                            const std::vector<double>& logits_TE, const int64_t T, const MoEConfig& config,
                            const std::span<const float> expert_bias_E) {
  const int64_t E = config.num_experts, k = config.topk;
  std::vector<int64_t> idx_K(static_cast<size_t>(k));
  std::vector<double> scores_E(static_cast<size_t>(E)), route_E(static_cast<size_t>(E)), p_K(static_cast<size_t>(k));
  auto select = [&](const double* values_E) {
    if (config.group_topk > 0) {
      routing::group_limited_topk(idx_K.data(), values_E, E, k, config.num_groups, config.group_topk);
    } else {
      routing::topk(idx_K.data(), values_E, E, k);
    }
  };
  const float scale = static_cast<float>(config.topk_scaling_factor.value_or(0.0));
  for (int64_t t = 0; t < T; ++t) {
    const double* l_E = logits_TE.data() + t * E;
    if (config.score_function == RouterScoreFunction::kSoftmax && config.pre_softmax) {
      routing::softmax_fp32(scores_E.data(), l_E, E);
      select(scores_E.data());
      for (int64_t i = 0; i < k; ++i) p_K[i] = scores_E[idx_K[i]];
    } else if (config.score_function == RouterScoreFunction::kSoftmax) {
      select(l_E);  // top-k of the logits in the router dtype, softmax over the selected in fp32
      for (int64_t i = 0; i < k; ++i) p_K[i] = l_E[idx_K[i]];
      routing::softmax_fp32(p_K.data(), p_K.data(), k);
    } else {
      for (int64_t e = 0; e < E; ++e) scores_E[e] = routing::pointwise_score_fp32(config.score_function, l_E[e]);
      if (!expert_bias_E.empty()) {  // the bias steers the selection only (fp32 sum)
        for (int64_t e = 0; e < E; ++e) route_E[e] = to_fp32(scores_E[e] + expert_bias_E[static_cast<size_t>(e)]);
        select(route_E.data());
      } else {
        select(scores_E.data());
      }
      for (int64_t i = 0; i < k; ++i) p_K[i] = scores_E[idx_K[i]];
      if (k > 1) routing::normalize_fp32(p_K.data(), k);
    }
    for (int64_t i = 0; i < k; ++i) {
      selected_TE[t * E + idx_K[i]] = 1;
      probs_TE[t * E + idx_K[i]] = scale != 0.0f ? static_cast<double>(static_cast<float>(p_K[i]) * scale) : p_K[i];
    }
  }
}

}  // namespace

TopKRouter::TopKRouter(const MoEConfig& config, const int64_t hidden, const bool add_bias, const std::string& prefix,
                       std::vector<Param>& params, const parallel::ParallelState& parallel, const int module,
                       std::vector<Buffer>* buffers)
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
  auto add = [&](const std::string& name, const std::vector<int64_t>& shape) {
    Param p = make_param(prefix_ + name, shape, InitKind::kNormal);
    p.grad_sum_over_tp = true;
    p.module = module;
    params.push_back(std::move(p));
  };
  add("mlp.router.weight", {E, hidden});
  // Megatron initialises the router bias with init_method too.
  if (add_bias_) add("mlp.router.bias", {E});
  if (config.enable_expert_bias) {
    has_expert_bias_ = true;
    (buffers != nullptr ? *buffers : own_buffers_).push_back(make_buffer(prefix_ + "mlp.router.expert_bias", {E}));
    local_tokens_per_expert_.assign(static_cast<size_t>(E), 0.0);
  }
  global_aux_counts_.assign(static_cast<size_t>(E), 0.0);
}

void TopKRouter::bind(std::vector<Param>& params, std::vector<Buffer>* buffers) {
  if (has_expert_bias_) {
    expert_bias_ = find_buffer(buffers != nullptr ? *buffers : own_buffers_, prefix_ + "mlp.router.expert_bias");
  }
  weight_ = bias_ = nullptr;
  for (Param& p : params) {
    if (p.name == prefix_ + "mlp.router.weight") weight_ = &p;
    if (p.name == prefix_ + "mlp.router.bias") bias_ = &p;
  }
  if (weight_ == nullptr || (add_bias_ && bias_ == nullptr)) {
    throw std::logic_error("router parameters under " + prefix_ + "mlp.router were not registered");
  }
}

RouterOutput TopKRouter::forward(const float* x_TH, const int64_t S, const int64_t B, const bool training,
                                 const uint64_t seed, const uint64_t jitter_key, RouterActivations& saved,
                                 const int64_t token_offset) {
  if (weight_ == nullptr) throw std::logic_error("TopKRouter::forward before bind()");
  const int64_t T = S * B, E = config_.num_experts;
  saved = RouterActivations{};
  saved.S = S;
  saved.B = B;
  saved.training = training;
  saved.jitter_seed = seed;
  saved.jitter_key = jitter_key;
  saved.token_offset = token_offset;

  saved.input_TH = Tensor({T, hidden_}, DType::kF32, MemCategory::kActivations);
  jittered_input(saved.input_TH.data<float>(), x_TH, T, saved);
  compute_logits(saved.logits_TE, saved.input_TH.data<float>(), T, saved);
  std::vector<double> probs_TE;
  select_experts(saved.selected_TE, probs_TE, saved.logits_TE, T, training);

  RouterOutput out;
  apply_capacity(out, probs_TE, saved.selected_TE, T);
  out.load_balancing_losses.assign(config_.load_balancing_types.size(), 0.0);
  if (training) {
    attach_losses(out, saved);
    record_expert_bias_counts(out);
  }
  out.probs_TE = Tensor({T, E}, DType::kF32, MemCategory::kActivations);
  float* probs_out = out.probs_TE.data<float>();
  for (int64_t i = 0; i < T * E; ++i) probs_out[i] = static_cast<float>(probs_TE[i]);
  return out;
}

// Megatron's TopKRouter.apply_input_jitter: input * Uniform(1 - eps, 1 + eps), in training and in evaluation.
void TopKRouter::jittered_input(float* input_TH, const float* x_TH, const int64_t T,
                                const RouterActivations& saved) const {
  const int64_t H = hidden_;
  if (config_.input_jitter_eps <= 0) {
    std::copy(x_TH, x_TH + T * H, input_TH);
    return;
  }
  const CounterRng rng(saved.jitter_seed, saved.jitter_key);
  for (int64_t i = 0; i < T * H; ++i) {
    input_TH[i] =
        x_TH[i] * jitter_factor(rng, static_cast<uint64_t>(saved.token_offset * H + i), config_.input_jitter_eps);
  }
}

// logits = x W^T (+ b) in the router dtype; --moe-router-force-load-balancing replaces them with N(0, 1) draws
// (straight-through: backward treats them as the logits, as Megatron's RandomSTE).
void TopKRouter::compute_logits(std::vector<double>& logits_TE, const float* input_TH, const int64_t T,
                                const RouterActivations& saved) const {
  const int64_t H = hidden_, E = config_.num_experts;
  const bool fp32 = config_.router_dtype == RouterDType::kFP32;
  logits_TE.assign(static_cast<size_t>(T * E), 0.0);
  const std::vector<double> x_d = to_double(input_TH, T * H);
  const std::vector<double> w_d = to_double(weight_->value.data<float>(), E * H);
  Tensor logits = Tensor::from_blob(logits_TE.data(), {T, E});
  ops::linear_forward(logits, Tensor::from_blob(x_d.data(), {T, H}), Tensor::from_blob(w_d.data(), {E, H}));
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t e = 0; e < E; ++e) {
      const double bias = bias_ != nullptr ? bias_->value.data<float>()[e] : 0.0;
      const double logit = logits_TE[t * E + e] + bias;
      logits_TE[t * E + e] = fp32 ? to_fp32(logit) : logit;
    }
  }
  if (config_.force_load_balancing) {
    const CounterRng normal_rng(saved.jitter_seed, saved.jitter_key ^ kForceBalanceSalt);
    for (int64_t i = 0; i < T * E; ++i) {
      const double logit = normal_rng.normal(static_cast<uint64_t>(saved.token_offset * E + i));
      logits_TE[i] = fp32 ? to_fp32(logit) : logit;
    }
  }
}

void TopKRouter::select_experts(std::vector<uint8_t>& selected_TE, std::vector<double>& probs_TE,
                                const std::vector<double>& logits_TE, const int64_t T, const bool training) const {
  const int64_t E = config_.num_experts;
  selected_TE.assign(static_cast<size_t>(T * E), 0);
  probs_TE.assign(static_cast<size_t>(T * E), 0.0);
  if (uses_sinkhorn(config_)) {
    sinkhorn_routing(selected_TE, probs_TE, logits_TE, T, E, config_.topk, training,
                     config_.router_dtype == RouterDType::kFP32);
  } else {
    score_function_routing(selected_TE, probs_TE, logits_TE, T, config_, expert_bias());
  }
}

// Megatron's apply_router_token_dropping: keep at most C tokens per expert, or with --moe-pad-expert-input-to-capacity
// route exactly min(C, T) tokens to every expert (the capacity mask itself; padding tokens have probability 0).
void TopKRouter::apply_capacity(RouterOutput& out, std::vector<double>& probs_TE,
                                const std::vector<uint8_t>& selected_TE, const int64_t T) const {
  const int64_t E = config_.num_experts;
  out.routing_map_TE = selected_TE;
  if (config_.capacity_factor.has_value()) {
    out.capacity = routing::expert_capacity(T, config_.topk, E, *config_.capacity_factor);
    std::vector<uint8_t> mask_TE(static_cast<size_t>(T * E));
    routing::capacity_mask(mask_TE.data(), selected_TE.data(), probs_TE.data(), T, E, out.capacity,
                           config_.drop_policy);
    const bool pad = config_.pad_expert_input_to_capacity;
    for (int64_t i = 0; i < T * E; ++i) {
      out.routing_map_TE[i] = pad ? mask_TE[i] : (selected_TE[i] & mask_TE[i]);
      if (!out.routing_map_TE[i]) probs_TE[i] = 0.0;
    }
  }
  out.tokens_per_expert_E.assign(static_cast<size_t>(E), 0);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t e = 0; e < E; ++e) out.tokens_per_expert_E[e] += out.routing_map_TE[t * E + e];
  }
}

// The auxiliary losses (each only when its coefficient is non-zero, as Megatron) on the aux scores and their own
// plain top-k map, and the z-loss on the logits.
void TopKRouter::attach_losses(RouterOutput& out, RouterActivations& saved) {
  const int64_t S = saved.S, B = saved.B, T = S * B, E = config_.num_experts, k = config_.topk;
  const int64_t tp_cp = tp_cp_.size();
  if (aux_losses_on(config_)) {
    std::vector<double> scores_TE(static_cast<size_t>(T * E));
    std::vector<uint8_t> aux_map_TE(static_cast<size_t>(T * E));
    load_balancing::aux_scores(scores_TE.data(), aux_map_TE.data(), saved.logits_TE.data(), T, E, k,
                               config_.score_function);
    saved.aux_cache.assign(static_cast<size_t>(T * E), 0.0);
    const double* scores = scores_TE.data();
    double* dscores = saved.aux_cache.data();
    const load_balancing::CountReduction reduce_tp_cp = [this](std::vector<double>& counts) {
      sum_counts(counts, tp_cp_);
    };
    const auto& types = config_.load_balancing_types;
    for (size_t i = 0; i < types.size(); ++i) {
      if (std::find(types.begin(), types.begin() + static_cast<std::ptrdiff_t>(i), types[i]) !=
          types.begin() + static_cast<std::ptrdiff_t>(i)) {
        continue;  // a repeated type counts once, as Megatron's get_aux_loss_coeff
      }
      const double coeff = coeff_of(config_, types[i]);
      if (coeff == 0.0) continue;
      // Counts are summed over the ranks holding the other tokens of the same sequences (tp-cp; tp-dp-cp for the
      // global loss), scores stay local: each rank's loss is its tokens' share of the one-process loss.
      double loss = 0.0;
      if (types[i] == LoadBalancingType::kAuxLoss) {
        loss = load_balancing::aux_loss(scores, aux_map_TE.data(), T, E, k, coeff, dscores, reduce_tp_cp, tp_cp);
      } else if (types[i] == LoadBalancingType::kSeqAuxLoss) {
        loss = load_balancing::seq_aux_loss(scores, aux_map_TE.data(), S, B, E, k, coeff, dscores, reduce_tp_cp, tp_cp);
      } else if (types[i] == LoadBalancingType::kGlobalAuxLoss) {
        loss = global_aux_loss(scores, aux_map_TE.data(), T, coeff, dscores);
      } else {
        continue;
      }
      out.load_balancing_losses[i] = loss / coeff;
    }
  }
  if (config_.z_loss_coeff > 0) {
    // Megatron divides the coefficient by |TP x CP|: the ranks' losses add up to the mean over all tokens.
    out.z_loss = load_balancing::z_loss(saved.logits_TE.data(), T, E, 1.0 / static_cast<double>(tp_cp), 0.0, nullptr);
  }
}

// Megatron's _apply_global_aux_loss: counts accumulated over the micro-batches of the global batch (summed over
// tp-dp-cp), averaged over the micro-batches so far.
double TopKRouter::global_aux_loss(const double* scores_TE, const uint8_t* aux_map_TE, const int64_t T,
                                   const double coeff, double* dscores_TE) {
  const int64_t E = config_.num_experts;
  std::vector<double> counts_E(static_cast<size_t>(E), 0.0);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t e = 0; e < E; ++e) counts_E[e] += aux_map_TE[t * E + e];
  }
  sum_counts(counts_E, tp_dp_cp_);
  for (int64_t e = 0; e < E; ++e) global_aux_counts_[e] += counts_E[e];
  global_aux_steps_ += 1;
  std::vector<double> averaged_E(global_aux_counts_);
  for (double& c : averaged_E) c /= static_cast<double>(global_aux_steps_);
  const double total = static_cast<double>(T * tp_dp_cp_.size());
  return load_balancing::switch_loss(scores_TE, averaged_E.data(), T, E, total, config_.topk, E, coeff, dscores_TE);
}

// Aux-loss-free balancing (Megatron's _apply_expert_bias): the final routing map's column sums, padding included.
void TopKRouter::record_expert_bias_counts(const RouterOutput& out) {
  if (!has_expert_bias_) return;
  for (size_t e = 0; e < local_tokens_per_expert_.size(); ++e) {
    local_tokens_per_expert_[e] += static_cast<double>(out.tokens_per_expert_E[e]);
  }
}

void TopKRouter::probs_backward(std::vector<double>& dlogits_TE, const float* dprobs_TE, const RouterActivations& saved,
                                const RouterOutput& routing) const {
  const int64_t T = saved.S * saved.B, E = config_.num_experts, k = config_.topk;
  const double scale = scales_probs(config_) ? *config_.topk_scaling_factor : 1.0;
  const std::vector<uint8_t>& map_TE = routing.routing_map_TE;
  std::vector<int64_t> sel_K;
  std::vector<double> a_E(static_cast<size_t>(E)), g_E(static_cast<size_t>(E)), p_K;
  for (int64_t t = 0; t < T; ++t) {
    const double* l_E = saved.logits_TE.data() + t * E;
    double* dl_E = dlogits_TE.data() + t * E;
    sel_K.clear();
    for (int64_t e = 0; e < E; ++e) {
      // Padding tokens are in the map with probability 0 but were not selected: no gradient, as Megatron (the
      // probs are scattered from the selected ones).
      const bool routed = map_TE[t * E + e] && saved.selected_TE[t * E + e];
      g_E[e] = routed ? scale * static_cast<double>(dprobs_TE[t * E + e]) : 0.0;
      if (saved.selected_TE[t * E + e]) sel_K.push_back(e);
    }
    if (uses_sinkhorn(config_)) {  // probs = act(logits) * map, not renormalised
      if (k == 1) {
        for (int64_t e = 0; e < E; ++e) {
          const double s = routing::sigmoid(l_E[e]);
          dl_E[e] += g_E[e] * s * (1.0 - s);
        }
      } else {
        routing::softmax(a_E.data(), l_E, E);
        double dot = 0.0;
        for (int64_t e = 0; e < E; ++e) dot += a_E[e] * g_E[e];
        for (int64_t e = 0; e < E; ++e) dl_E[e] += a_E[e] * (g_E[e] - dot);
      }
    } else if (config_.score_function == RouterScoreFunction::kSoftmax) {
      if (config_.pre_softmax) {
        routing::softmax(a_E.data(), l_E, E);
        double dot = 0.0;
        for (int64_t e = 0; e < E; ++e) dot += a_E[e] * g_E[e];
        for (int64_t e = 0; e < E; ++e) dl_E[e] += a_E[e] * (g_E[e] - dot);
      } else {
        p_K.resize(sel_K.size());
        for (size_t i = 0; i < sel_K.size(); ++i) p_K[i] = l_E[sel_K[i]];
        routing::softmax(p_K.data(), p_K.data(), static_cast<int64_t>(p_K.size()));
        double dot = 0.0;
        for (size_t i = 0; i < sel_K.size(); ++i) dot += p_K[i] * g_E[sel_K[i]];
        for (size_t i = 0; i < sel_K.size(); ++i) dl_E[sel_K[i]] += p_K[i] * (g_E[sel_K[i]] - dot);
      }
    } else {
      const RouterScoreFunction fn = config_.score_function;
      double sum = 0.0, dot = 0.0;
      for (const int64_t e : sel_K) sum += a_E[e] = routing::pointwise_score(fn, l_E[e]);
      const double denom = sum + 1e-20;
      for (const int64_t e : sel_K) dot += g_E[e] * a_E[e] / denom;
      for (const int64_t e : sel_K) {
        const double ds = k > 1 ? (g_E[e] - dot) / denom : g_E[e];
        dl_E[e] += ds * routing::pointwise_score_grad(fn, l_E[e], a_E[e]);
      }
    }
  }
}

void TopKRouter::backward(float* dx_TH, const float* dprobs_TE, const double aux_grad_scale,
                          const RouterActivations& saved, const RouterOutput& routing) {
  const int64_t T = saved.S * saved.B, H = hidden_, E = config_.num_experts;
  const double* logits_TE = saved.logits_TE.data();
  std::vector<double> dlogits_TE(static_cast<size_t>(T * E), 0.0);
  probs_backward(dlogits_TE, dprobs_TE, saved, routing);

  // Auxiliary and z losses: d(objective)/d(loss) = aux_grad_scale (MoEAuxLossAutoScaler).
  if (!saved.aux_cache.empty()) {
    std::vector<double> dscores_TE(saved.aux_cache);
    for (double& v : dscores_TE) v *= aux_grad_scale;
    load_balancing::aux_scores_backward(dlogits_TE.data(), dscores_TE.data(), logits_TE, T, E, config_.score_function);
  }
  if (saved.training && config_.z_loss_coeff > 0) {
    load_balancing::z_loss(logits_TE, T, E, config_.z_loss_coeff / static_cast<double>(tp_cp_.size()), aux_grad_scale,
                           dlogits_TE.data());
  }
  if (config_.router_dtype == RouterDType::kFP32) {
    for (double& v : dlogits_TE) v = to_fp32(v);
  }

  // dW += dlogits^T x, db += sum_t dlogits, dx += (dlogits W) * jitter.
  const std::vector<double> x_d = to_double(saved.input_TH.data<float>(), T * H);
  const std::vector<double> w_d = to_double(weight_->value.data<float>(), E * H);
  std::vector<double> dw_EH(static_cast<size_t>(E * H)), dx_d(static_cast<size_t>(T * H));
  Tensor dw_d = Tensor::from_blob(dw_EH.data(), {E, H}), dx_dt = Tensor::from_blob(dx_d.data(), {T, H});
  const Tensor x = Tensor::from_blob(x_d.data(), {T, H});
  ops::linear_backward(&dx_dt, &dw_d, nullptr, Tensor::from_blob(dlogits_TE.data(), {T, E}), &x,
                       Tensor::from_blob(w_d.data(), {E, H}));
  float* dw = weight_->grad.data<float>();
  for (int64_t i = 0; i < E * H; ++i) dw[i] += static_cast<float>(dw_EH[i]);
  if (bias_ != nullptr) {
    float* db = bias_->grad.data<float>();
    for (int64_t e = 0; e < E; ++e) {
      double sum = 0.0;
      for (int64_t t = 0; t < T; ++t) sum += dlogits_TE[t * E + e];
      db[e] += static_cast<float>(sum);
    }
  }
  if (dx_TH == nullptr) return;
  const bool jitter = config_.input_jitter_eps > 0;
  const CounterRng jitter_rng(saved.jitter_seed, saved.jitter_key);
  for (int64_t i = 0; i < T * H; ++i) {
    const double factor =
        jitter ? jitter_factor(jitter_rng, static_cast<uint64_t>(saved.token_offset * H + i), config_.input_jitter_eps)
               : 1.0;
    dx_TH[i] += static_cast<float>(dx_d[i] * factor);
  }
}

void TopKRouter::finish_global_batch() {
  if (has_expert_bias_) {
    sum_counts(local_tokens_per_expert_, tp_dp_cp_);
    load_balancing::update_expert_bias(expert_bias(), local_tokens_per_expert_, config_.bias_update_rate);
    std::fill(local_tokens_per_expert_.begin(), local_tokens_per_expert_.end(), 0.0);
  }
  std::fill(global_aux_counts_.begin(), global_aux_counts_.end(), 0.0);
  global_aux_steps_ = 0;
}

std::span<const float> TopKRouter::expert_bias() const {
  if (!has_expert_bias_) return {};
  if (expert_bias_ == nullptr) throw std::logic_error("TopKRouter::expert_bias before bind()");
  return expert_bias_->value.span<float>();
}

std::span<float> TopKRouter::expert_bias() {
  if (!has_expert_bias_) return {};
  if (expert_bias_ == nullptr) throw std::logic_error("TopKRouter::expert_bias before bind()");
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
