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
// Cost: besides the logits GEMMs (T H E), one pass over each token's E logits (top-k kept in one scan, the aux
// scores), parallel over tokens; the dense [T, E] map and probs the dispatcher takes are written from the k selected
// experts of each token, and the switch losses keep per-column sums, not [T, E] gradients.
#include "moecore/moe/router.h"

#include <algorithm>
#include <span>
#include <stdexcept>

#include "moecore/model/config.h"
#include "moecore/moe/load_balancing.h"
#include "moecore/moe/routing_math.h"
#include "moecore/ops/linear.h"
#include "moecore/ops/precision.h"
#include "moecore/ops/quantization.h"
#include "moecore/parallel/comm_stats.h"
#include "moecore/tensor/rng.h"

namespace moecore {
namespace {

// fn(i, key) for every element i of the [rows, W] local rows, key = the element's one-process index (its counter).
template <typename Fn>
void for_each_element(const TokenRows& rows, const int64_t W, Fn&& fn) {
  for (const TokenRows::Run& run : rows.runs()) {
    const int64_t first = run.local * W, key0 = run.global * W;
    for (int64_t k = 0; k < run.count * W; ++k) fn(first + k, static_cast<uint64_t>(key0 + k));
  }
}

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

// Below this many logits the per-token loops stay on one thread.
constexpr int64_t kParallelLogits = 16384;

// One token of Megatron's TopKRouter.sinkhorn_load_balancing: training selects the top-k of the token's row of
// sinkhorn(fp32 logits) (balanced_E), evaluation the top-k of the activation; probs = activation at the selected
// experts, not renormalised and not scaled. act_E: E doubles of scratch.
void sinkhorn_route(int64_t* idx_K, double* p_K, const double* l_E, const float* balanced_E, const int64_t E,
                    const int64_t k, const bool fp32_logits, double* act_E, double* route_E) {
  if (k == 1) {  // torch.sigmoid(logits): in the logits' dtype
    for (int64_t e = 0; e < E; ++e) {
      const double s = routing::sigmoid(l_E[e]);
      act_E[e] = fp32_logits ? to_fp32(s) : s;
    }
  } else {  // torch.softmax(logits, dtype=torch.float32)
    routing::softmax_fp32(act_E, l_E, E);
  }
  if (balanced_E != nullptr) {
    for (int64_t e = 0; e < E; ++e) route_E[e] = balanced_E[e];
    routing::topk(idx_K, route_E, E, k);
  } else {
    routing::topk(idx_K, act_E, E, k);
  }
  for (int64_t i = 0; i < k; ++i) p_K[i] = act_E[idx_K[i]];
}

// One token of Megatron's topk_routing_with_score_function (moe_utils.py, unfused path). --moe-router-pre-softmax
// only matters for softmax scores (Megatron ignores it for sigmoid / sqrtsoftplus). scores_E, route_E: scratch.
void score_function_route(int64_t* idx_K, double* p_K, const double* l_E, const MoEConfig& config,
                          const std::span<const float> expert_bias_E, double* scores_E, double* route_E) {
  const int64_t E = config.num_experts, k = config.topk;
  auto select = [&](const double* values_E) {
    if (config.group_topk > 0) {
      routing::group_limited_topk(idx_K, values_E, E, k, config.num_groups, config.group_topk);
    } else {
      routing::topk(idx_K, values_E, E, k);
    }
  };
  if (config.score_function == RouterScoreFunction::kSoftmax && config.pre_softmax) {
    routing::softmax_fp32(scores_E, l_E, E);
    select(scores_E);
    for (int64_t i = 0; i < k; ++i) p_K[i] = scores_E[idx_K[i]];
  } else if (config.score_function == RouterScoreFunction::kSoftmax) {
    select(l_E);  // top-k of the logits in the router dtype, softmax over the selected in fp32
    for (int64_t i = 0; i < k; ++i) p_K[i] = l_E[idx_K[i]];
    routing::softmax_fp32(p_K, p_K, k);
  } else {
    for (int64_t e = 0; e < E; ++e) scores_E[e] = routing::pointwise_score_fp32(config.score_function, l_E[e]);
    if (!expert_bias_E.empty()) {  // the bias steers the selection only (fp32 sum)
      for (int64_t e = 0; e < E; ++e) route_E[e] = to_fp32(scores_E[e] + expert_bias_E[static_cast<size_t>(e)]);
      select(route_E);
    } else {
      select(scores_E);
    }
    for (int64_t i = 0; i < k; ++i) p_K[i] = scores_E[idx_K[i]];
    if (k > 1) routing::normalize_fp32(p_K, k);
  }
  const float scale = static_cast<float>(config.topk_scaling_factor.value_or(0.0));
  if (scale != 0.0f) {
    for (int64_t i = 0; i < k; ++i) p_K[i] = static_cast<double>(static_cast<float>(p_K[i]) * scale);
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
                                 const TokenRows& rows) {
  if (weight_ == nullptr) throw std::logic_error("TopKRouter::forward before bind()");
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

  saved.input_TH = Tensor({T, hidden_}, DType::kF32, MemCategory::kActivations);
  jittered_input(saved.input_TH.data<float>(), x_TH, T, saved);
  compute_logits(saved.logits_TE, saved.input_TH.data<float>(), T, saved);
  std::vector<double> probs_TK;
  std::vector<int32_t> aux_TK;
  route_tokens(saved, probs_TK, aux_TK, training);

  RouterOutput out;
  apply_capacity(out, saved, probs_TK);
  out.load_balancing_losses.assign(config_.load_balancing_types.size(), 0.0);
  if (training) {
    attach_losses(out, saved, aux_TK);
    record_expert_bias_counts(out);
  }
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
  (void)T;
  for_each_element(saved.rows, H, [&](const int64_t i, const uint64_t key) {
    input_TH[i] = x_TH[i] * jitter_factor(rng, key, config_.input_jitter_eps);
  });
}

// logits = x W^T (+ b) in the router dtype (fp32: one fp32 GEMM with the bias, as Megatron's router_gating_linear;
// fp64: in double); --moe-router-force-load-balancing replaces them with N(0, 1) draws (straight-through: backward
// treats them as the logits, as Megatron's RandomSTE).
void TopKRouter::compute_logits(std::vector<double>& logits_TE, const float* input_TH, const int64_t T,
                                const RouterActivations& saved) const {
  const int64_t H = hidden_, E = config_.num_experts;
  const bool fp32 = config_.router_dtype == RouterDType::kFP32;
  logits_TE.resize(static_cast<size_t>(T * E));
  if (config_.force_load_balancing) {
    const CounterRng normal_rng(saved.jitter_seed, saved.jitter_key ^ kForceBalanceSalt);
    for_each_element(saved.rows, E, [&](const int64_t i, const uint64_t key) {
      const double logit = normal_rng.normal(key);
      logits_TE[i] = fp32 ? to_fp32(logit) : logit;
    });
    return;
  }
  if (fp32) {
    std::vector<float> logits_f(static_cast<size_t>(T * E));
    Tensor logits = Tensor::from_blob(logits_f.data(), {T, E});
    ops::linear_forward(logits, Tensor::from_blob(input_TH, {T, H}), weight_->value,
                        bias_ != nullptr ? &bias_->value : nullptr);
    std::copy(logits_f.begin(), logits_f.end(), logits_TE.begin());
    return;
  }
  const std::vector<double> x_d = to_double(input_TH, T * H);
  const std::vector<double> w_d = to_double(weight_->value.data<float>(), E * H);
  Tensor logits = Tensor::from_blob(logits_TE.data(), {T, E});
  ops::linear_forward(logits, Tensor::from_blob(x_d.data(), {T, H}), Tensor::from_blob(w_d.data(), {E, H}));
  if (bias_ != nullptr) {
    const float* bias_E = bias_->value.data<float>();
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t e = 0; e < E; ++e) logits_TE[t * E + e] += bias_E[e];
    }
  }
}

void TopKRouter::route_tokens(RouterActivations& saved, std::vector<double>& probs_TK, std::vector<int32_t>& aux_TK,
                              const bool training) const {
  const int64_t T = saved.S * saved.B, E = config_.num_experts, k = config_.topk;
  const bool sinkhorn = uses_sinkhorn(config_), fp32 = config_.router_dtype == RouterDType::kFP32;
  const bool aux = training && aux_losses_on(config_), z = training && config_.z_loss_coeff > 0;
  // Sinkhorn's balancing couples all tokens: computed once, then read per token.
  const std::vector<float> balanced_TE =
      sinkhorn && training ? routing::sinkhorn(saved.logits_TE.data(), T, E) : std::vector<float>{};
  saved.selected_TK.resize(static_cast<size_t>(T * k));
  probs_TK.resize(static_cast<size_t>(T * k));
  if (aux) {
    saved.aux_scores_TE.resize(static_cast<size_t>(T * E));
    aux_TK.resize(static_cast<size_t>(T * k));
  }
  if (z) saved.lse_T.resize(static_cast<size_t>(T));
  const std::span<const float> bias_E = expert_bias();
  const double* logits_TE = saved.logits_TE.data();
#pragma omp parallel if (T * E >= kParallelLogits)
  {
    std::vector<double> a_E(static_cast<size_t>(E)), b_E(static_cast<size_t>(E));
    std::vector<int64_t> idx_K(static_cast<size_t>(k));
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; ++t) {
      const double* l_E = logits_TE + t * E;
      double* p_K = probs_TK.data() + t * k;
      if (sinkhorn) {
        sinkhorn_route(idx_K.data(), p_K, l_E, training ? balanced_TE.data() + t * E : nullptr, E, k, fp32, a_E.data(),
                       b_E.data());
      } else {
        score_function_route(idx_K.data(), p_K, l_E, config_, bias_E, a_E.data(), b_E.data());
      }
      for (int64_t i = 0; i < k; ++i) saved.selected_TK[t * k + i] = static_cast<int32_t>(idx_K[i]);
      if (aux) {
        load_balancing::aux_scores_row(a_E.data(), idx_K.data(), l_E, E, k, config_.score_function);
        float* scores_E = saved.aux_scores_TE.data() + t * E;
        for (int64_t e = 0; e < E; ++e) scores_E[e] = static_cast<float>(a_E[e]);
        for (int64_t i = 0; i < k; ++i) aux_TK[t * k + i] = static_cast<int32_t>(idx_K[i]);
      }
      if (z) saved.lse_T[t] = routing::logsumexp(l_E, E);
    }
  }
  saved.selected_TE.assign(static_cast<size_t>(T * E), 0);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t i = 0; i < k; ++i) saved.selected_TE[t * E + saved.selected_TK[t * k + i]] = 1;
  }
}

// Megatron's apply_router_token_dropping: keep at most C tokens per expert, or with --moe-pad-expert-input-to-capacity
// route exactly min(C, T) tokens to every expert (the capacity mask itself; padding tokens have probability 0).
void TopKRouter::apply_capacity(RouterOutput& out, const RouterActivations& saved,
                                const std::vector<double>& probs_TK) const {
  const int64_t T = saved.S * saved.B, E = config_.num_experts, k = config_.topk;
  out.tokens_per_expert_E.assign(static_cast<size_t>(E), 0);
  if (config_.capacity_factor.has_value()) {
    out.capacity = routing::expert_capacity(T, k, E, *config_.capacity_factor);
    out.routing_map_TE.resize(static_cast<size_t>(T * E));
    routing::capacity_mask(out.routing_map_TE.data(), saved.selected_TK.data(), probs_TK.data(), T, E, k, out.capacity,
                           config_.drop_policy);
    if (!config_.pad_expert_input_to_capacity) {
      for (int64_t i = 0; i < T * E; ++i) out.routing_map_TE[i] &= saved.selected_TE[i];
    }
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t e = 0; e < E; ++e) out.tokens_per_expert_E[e] += out.routing_map_TE[t * E + e];
    }
  } else {
    out.routing_map_TE = saved.selected_TE;
    for (const int32_t e : saved.selected_TK) ++out.tokens_per_expert_E[e];
  }
  // The selected experts that stayed in the map carry their probability; everything else (dropped experts, padding
  // tokens) is 0.
  out.probs_TE = Tensor({T, E}, DType::kF32, MemCategory::kActivations);
  float* probs_out = out.probs_TE.data<float>();
  std::fill(probs_out, probs_out + T * E, 0.0f);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t i = 0; i < k; ++i) {
      const int64_t e = saved.selected_TK[t * k + i];
      if (out.routing_map_TE[t * E + e]) probs_out[t * E + e] = static_cast<float>(probs_TK[t * k + i]);
    }
  }
}

// The auxiliary losses (each only when its coefficient is non-zero, as Megatron) on the aux scores and their own
// plain top-k map, and the z-loss on the logits. Megatron's switch loss is
// factor * sum_j (sum_t scores_tj) counts_j over the columns j of the scores (experts; (sequence, expert) pairs for
// seq_aux_loss), so only the column sums and counts are needed, and its gradient with respect to scores_tj is
// factor * counts_j for every token: kept per column in saved.aux_grad_BE.
void TopKRouter::attach_losses(RouterOutput& out, RouterActivations& saved, const std::vector<int32_t>& aux_TK) {
  const int64_t S = saved.S, B = saved.B, T = S * B, E = config_.num_experts, k = config_.topk;
  const int64_t tp_cp = tp_cp_.size();
  if (aux_losses_on(config_)) {
    const float* scores_TE = saved.aux_scores_TE.data();
    // Column sums over all tokens (aux, global aux) and per sequence (seq aux), accumulated in token order.
    std::vector<double> sums_E(static_cast<size_t>(E), 0.0), sums_BE(static_cast<size_t>(B * E), 0.0);
    std::vector<double> counts_BE(static_cast<size_t>(B * E), 0.0);
    for (int64_t t = 0; t < T; ++t) {
      const float* s_E = scores_TE + t * E;
      double* seq_E = sums_BE.data() + (t % B) * E;
      for (int64_t e = 0; e < E; ++e) {
        sums_E[e] += static_cast<double>(s_E[e]);
        seq_E[e] += static_cast<double>(s_E[e]);
      }
      for (int64_t i = 0; i < k; ++i) counts_BE[(t % B) * E + aux_TK[t * k + i]] += 1.0;
    }
    std::vector<double> counts_E(static_cast<size_t>(E), 0.0);
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t e = 0; e < E; ++e) counts_E[e] += counts_BE[b * E + e];
    }
    saved.aux_grad_BE.assign(static_cast<size_t>(B * E), 0.0);
    std::vector<double> grad_E(static_cast<size_t>(E));
    auto add_to_every_sequence = [&] {
      for (int64_t b = 0; b < B; ++b) {
        for (int64_t e = 0; e < E; ++e) saved.aux_grad_BE[b * E + e] += grad_E[e];
      }
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
      std::fill(grad_E.begin(), grad_E.end(), 0.0);
      if (types[i] == LoadBalancingType::kAuxLoss) {
        std::vector<double> counts = counts_E;
        sum_counts(counts, tp_cp_);
        loss = load_balancing::switch_loss_from_sums(sums_E.data(), counts.data(), E, static_cast<double>(T * tp_cp), k,
                                                     E, coeff, grad_E.data());
        add_to_every_sequence();
      } else if (types[i] == LoadBalancingType::kSeqAuxLoss) {
        // Megatron views [S*B, E] as [S, B*E]: "experts" are (sequence, expert) pairs over S tokens, divided by B.
        std::vector<double> counts = counts_BE;
        sum_counts(counts, tp_cp_);
        loss =
            load_balancing::switch_loss_from_sums(sums_BE.data(), counts.data(), B * E, static_cast<double>(S * tp_cp),
                                                  k, E, coeff / static_cast<double>(B), saved.aux_grad_BE.data());
      } else if (types[i] == LoadBalancingType::kGlobalAuxLoss) {
        loss = global_aux_loss(sums_E.data(), counts_E, T, coeff, grad_E.data());
        add_to_every_sequence();
      } else {
        continue;
      }
      out.load_balancing_losses[i] = loss / coeff;
    }
  }
  if (config_.z_loss_coeff > 0) {
    // Megatron divides the coefficient by |TP x CP|: the ranks' losses add up to the mean over all tokens.
    double sum = 0.0;
    for (const double lse : saved.lse_T) sum += lse * lse;
    out.z_loss = (1.0 / static_cast<double>(tp_cp)) * sum / static_cast<double>(T);
  }
}

// Megatron's _apply_global_aux_loss: counts accumulated over the micro-batches of the global batch (summed over
// tp-dp-cp), averaged over the micro-batches so far.
double TopKRouter::global_aux_loss(const double* score_sums_E, const std::vector<double>& local_counts_E,
                                   const int64_t T, const double coeff, double* dscores_E) {
  const int64_t E = config_.num_experts;
  std::vector<double> counts_E = local_counts_E;
  sum_counts(counts_E, tp_dp_cp_);
  for (int64_t e = 0; e < E; ++e) global_aux_counts_[e] += counts_E[e];
  global_aux_steps_ += 1;
  std::vector<double> averaged_E(global_aux_counts_);
  for (double& c : averaged_E) c /= static_cast<double>(global_aux_steps_);
  const double total = static_cast<double>(T * tp_dp_cp_.size());
  return load_balancing::switch_loss_from_sums(score_sums_E, averaged_E.data(), E, total, config_.topk, E, coeff,
                                               dscores_E);
}

// Aux-loss-free balancing (Megatron's _apply_expert_bias): the final routing map's column sums, padding included.
void TopKRouter::record_expert_bias_counts(const RouterOutput& out) {
  if (!has_expert_bias_) return;
  for (size_t e = 0; e < local_tokens_per_expert_.size(); ++e) {
    local_tokens_per_expert_[e] += static_cast<double>(out.tokens_per_expert_E[e]);
  }
}

void TopKRouter::logits_backward(std::vector<double>& dlogits_TE, const float* dprobs_TE, const double aux_grad_scale,
                                 const RouterActivations& saved, const RouterOutput& routing) const {
  const int64_t T = saved.S * saved.B, B = saved.B, E = config_.num_experts, k = config_.topk;
  const double scale = scales_probs(config_) ? *config_.topk_scaling_factor : 1.0;
  const bool sinkhorn = uses_sinkhorn(config_);
  const RouterScoreFunction fn = config_.score_function;
  // The probabilities depend on all E logits through a softmax over all of them (pre-softmax, sinkhorn top-k > 1),
  // else on the k selected logits only.
  const bool dense_softmax =
      (sinkhorn && k > 1) || (!sinkhorn && fn == RouterScoreFunction::kSoftmax && config_.pre_softmax);
  // d(objective)/d(aux score) = aux_grad_scale * d(aux losses)/d(score) (MoEAuxLossAutoScaler).
  std::vector<double> aux_grad_BE(saved.aux_grad_BE);
  for (double& v : aux_grad_BE) v *= aux_grad_scale;
  const bool z = saved.training && config_.z_loss_coeff > 0;
  const double z_coeff = config_.z_loss_coeff / static_cast<double>(tp_cp_.size());
  const std::vector<uint8_t>& map_TE = routing.routing_map_TE;
  dlogits_TE.assign(static_cast<size_t>(T * E), 0.0);
#pragma omp parallel if (T * E >= kParallelLogits)
  {
    std::vector<double> a_E(static_cast<size_t>(E)), g_K(static_cast<size_t>(k)), p_K(static_cast<size_t>(k));
    std::vector<int64_t> sel_K(static_cast<size_t>(k));
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; ++t) {
      const double* l_E = saved.logits_TE.data() + t * E;
      double* dl_E = dlogits_TE.data() + t * E;
      // The selected experts in ascending order; padding tokens are in the map with probability 0 but were not
      // selected, so they carry no gradient, as Megatron (the probs are scattered from the selected ones).
      std::copy(saved.selected_TK.begin() + t * k, saved.selected_TK.begin() + (t + 1) * k, sel_K.begin());
      std::sort(sel_K.begin(), sel_K.end());
      for (int64_t i = 0; i < k; ++i) {
        const int64_t e = sel_K[i];
        g_K[i] = map_TE[t * E + e] ? scale * static_cast<double>(dprobs_TE[t * E + e]) : 0.0;
      }
      if (dense_softmax) {  // probs = softmax(logits) at the selected experts
        routing::softmax(a_E.data(), l_E, E);
        double dot = 0.0;
        for (int64_t i = 0; i < k; ++i) dot += a_E[sel_K[i]] * g_K[i];
        for (int64_t e = 0, i = 0; e < E; ++e) {
          const double g = i < k && sel_K[i] == e ? g_K[i++] : 0.0;
          dl_E[e] += a_E[e] * (g - dot);
        }
      } else if (sinkhorn) {  // top-1: probs = sigmoid(logits), not renormalised
        for (int64_t i = 0; i < k; ++i) {
          const double s = routing::sigmoid(l_E[sel_K[i]]);
          dl_E[sel_K[i]] += g_K[i] * s * (1.0 - s);
        }
      } else if (fn == RouterScoreFunction::kSoftmax) {  // softmax over the selected logits
        for (int64_t i = 0; i < k; ++i) p_K[i] = l_E[sel_K[i]];
        routing::softmax(p_K.data(), p_K.data(), k);
        double dot = 0.0;
        for (int64_t i = 0; i < k; ++i) dot += p_K[i] * g_K[i];
        for (int64_t i = 0; i < k; ++i) dl_E[sel_K[i]] += p_K[i] * (g_K[i] - dot);
      } else {  // sigmoid / sqrtsoftplus scores, normalised over the selected when k > 1
        double sum = 0.0, dot = 0.0;
        for (int64_t i = 0; i < k; ++i) sum += a_E[i] = routing::pointwise_score(fn, l_E[sel_K[i]]);
        const double denom = sum + 1e-20;
        for (int64_t i = 0; i < k; ++i) dot += g_K[i] * a_E[i] / denom;
        for (int64_t i = 0; i < k; ++i) {
          const double ds = k > 1 ? (g_K[i] - dot) / denom : g_K[i];
          dl_E[sel_K[i]] += ds * routing::pointwise_score_grad(fn, l_E[sel_K[i]], a_E[i]);
        }
      }
      if (!aux_grad_BE.empty()) {
        load_balancing::aux_scores_backward_row(dl_E, aux_grad_BE.data() + (t % B) * E, l_E,
                                                saved.aux_scores_TE.data() + t * E, E, fn, a_E.data());
      }
      if (z) {  // z = coeff * mean_t lse_t^2: d/dl = coeff * 2 lse_t softmax(l_t) / T
        routing::softmax(a_E.data(), l_E, E);
        const double z_scale = aux_grad_scale * z_coeff * 2.0 * saved.lse_T[t] / static_cast<double>(T);
        for (int64_t e = 0; e < E; ++e) dl_E[e] += z_scale * a_E[e];
      }
    }
  }
}

void TopKRouter::backward(float* dx_TH, const float* dprobs_TE, const double aux_grad_scale,
                          const RouterActivations& saved, const RouterOutput& routing) {
  const ops::ScopedActivationDType router_precision(DType::kF32);
  const ops::ScopedLinearQuantization router_unquantized(nullptr);
  const int64_t T = saved.S * saved.B, H = hidden_, E = config_.num_experts;
  std::vector<double> dlogits_TE;
  logits_backward(dlogits_TE, dprobs_TE, aux_grad_scale, saved, routing);

  // dW += dlogits^T x, db += sum_t dlogits, dx += (dlogits W) * jitter, in the router dtype.
  const bool fp32 = config_.router_dtype == RouterDType::kFP32;
  const bool jitter = config_.input_jitter_eps > 0;
  Tensor dx_jittered;  // dlogits W before the jitter factors
  if (dx_TH != nullptr && (jitter || !fp32)) {
    dx_jittered = Tensor({T, H}, fp32 ? DType::kF32 : DType::kF64, MemCategory::kActivations);
    dx_jittered.zero_();
  }
  Tensor dx_direct = dx_TH != nullptr && !dx_jittered.defined() ? Tensor::from_blob(dx_TH, {T, H}) : Tensor();
  Tensor* dx = dx_jittered.defined() ? &dx_jittered : (dx_direct.defined() ? &dx_direct : nullptr);
  if (fp32) {
    std::vector<float> dlogits_f(static_cast<size_t>(T * E));
    for (int64_t i = 0; i < T * E; ++i) dlogits_TE[i] = dlogits_f[i] = static_cast<float>(dlogits_TE[i]);
    ops::linear_backward(dx, &weight_->grad, nullptr, Tensor::from_blob(dlogits_f.data(), {T, E}), &saved.input_TH,
                         weight_->value);
  } else {
    const std::vector<double> x_d = to_double(saved.input_TH.data<float>(), T * H);
    const std::vector<double> w_d = to_double(weight_->value.data<float>(), E * H);
    std::vector<double> dw_EH(static_cast<size_t>(E * H));
    Tensor dw_d = Tensor::from_blob(dw_EH.data(), {E, H});
    const Tensor x = Tensor::from_blob(x_d.data(), {T, H});
    ops::linear_backward(dx, &dw_d, nullptr, Tensor::from_blob(dlogits_TE.data(), {T, E}), &x,
                         Tensor::from_blob(w_d.data(), {E, H}));
    float* dw = weight_->grad.data<float>();
    for (int64_t i = 0; i < E * H; ++i) dw[i] += static_cast<float>(dw_EH[i]);
  }
  if (bias_ != nullptr) {
    std::vector<double> sums_E(static_cast<size_t>(E), 0.0);
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t e = 0; e < E; ++e) sums_E[e] += dlogits_TE[t * E + e];
    }
    float* db = bias_->grad.data<float>();
    for (int64_t e = 0; e < E; ++e) db[e] += static_cast<float>(sums_E[e]);
  }
  if (!dx_jittered.defined()) return;
  const CounterRng jitter_rng(saved.jitter_seed, saved.jitter_key);
  for_each_element(saved.rows, H, [&](const int64_t i, const uint64_t key) {
    const double factor = jitter ? jitter_factor(jitter_rng, key, config_.input_jitter_eps) : 1.0;
    const double d = fp32 ? static_cast<double>(dx_jittered.data<float>()[i]) : dx_jittered.data<double>()[i];
    dx_TH[i] += static_cast<float>(d * factor);
  });
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
