// TopKRouter: Megatron's router.py / moe_utils.py semantics with an explicit backward.
// Legend: T tokens (t = s * B + b), H hidden, E experts, K top-k.
#include "moecore/moe/router.h"

#include <algorithm>
#include <span>
#include <stdexcept>

#include "moecore/kernels/cpu/gemm.h"
#include "moecore/model/config.h"
#include "moecore/moe/load_balancing.h"
#include "moecore/moe/routing_math.h"
#include "moecore/parallel/comm_stats.h"
#include "moecore/tensor/rng.h"

namespace moecore {
namespace {

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

}  // namespace

TopKRouter::TopKRouter(const MoEConfig& config, const int64_t hidden, const bool add_bias, const std::string& prefix,
                       std::vector<Param>& params, const parallel::ParallelState& parallel, const int module)
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
  if (config.group_topk > 0 && (config.num_groups <= 0 || E % config.num_groups != 0 ||
                                config.group_topk > config.num_groups || config.topk % config.group_topk != 0)) {
    throw ConfigError("router: --moe-router-num-groups " + std::to_string(config.num_groups) +
                      " / --moe-router-group-topk " + std::to_string(config.group_topk) +
                      " need num_groups dividing the experts, group_topk <= num_groups and dividing topk");
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
    expert_bias_.assign(static_cast<size_t>(E), 0.0f);
    local_tokens_per_expert_.assign(static_cast<size_t>(E), 0.0);
  }
  global_aux_counts_.assign(static_cast<size_t>(E), 0.0);
}

void TopKRouter::bind(std::vector<Param>& params) {
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
  const int64_t T = S * B, H = hidden_, E = config_.num_experts, k = config_.topk;
  const bool fp32 = config_.router_dtype == RouterDType::kFP32;
  auto rnd = [fp32](const double v) { return fp32 ? static_cast<double>(static_cast<float>(v)) : v; };
  saved = RouterActivations{};
  saved.S = S;
  saved.B = B;
  saved.training = training;
  saved.jitter_seed = seed;
  saved.jitter_key = jitter_key;
  saved.token_offset = token_offset;
  const int64_t tp_cp = tp_cp_.size();

  // Input jitter (training only), then logits = x W^T (+ b) in the router dtype.
  saved.input_TH = Tensor({T, H}, DType::kF32, MemCategory::kActivations);
  float* input_TH = saved.input_TH.data<float>();
  const bool jitter = training && config_.input_jitter_eps > 0;
  const CounterRng jitter_rng(seed, jitter_key);
  for (int64_t i = 0; i < T * H; ++i) {
    input_TH[i] = jitter ? x_TH[i] * jitter_factor(jitter_rng, static_cast<uint64_t>(token_offset * H + i),
                                                   config_.input_jitter_eps)
                         : x_TH[i];
  }
  std::vector<double>& logits_TE = saved.logits_TE;
  logits_TE.assign(static_cast<size_t>(T * E), 0.0);
  {
    const std::vector<double> x_d = to_double(input_TH, T * H);
    const std::vector<double> w_d = to_double(weight_->value.data<float>(), E * H);
    kernels::cpu::gemm<double>(false, true, T, E, H, 1.0, x_d.data(), H, w_d.data(), H, 0.0, logits_TE.data(), E);
  }
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t e = 0; e < E; ++e) {
      const double bias = bias_ != nullptr ? bias_->value.data<float>()[e] : 0.0;
      logits_TE[t * E + e] = rnd(logits_TE[t * E + e] + bias);
    }
  }
  if (config_.force_load_balancing) {  // straight-through: backward treats these as the logits
    const CounterRng normal_rng(seed, jitter_key ^ kForceBalanceSalt);
    for (int64_t i = 0; i < T * E; ++i) {
      logits_TE[i] = rnd(normal_rng.normal(static_cast<uint64_t>(token_offset * E + i)));
    }
  }

  // Top-k selection and probabilities.
  std::vector<double> probs_TE(static_cast<size_t>(T * E), 0.0);
  std::vector<uint8_t>& selected_TE = saved.selected_TE;
  selected_TE.assign(static_cast<size_t>(T * E), 0);
  const double scale = config_.topk_scaling_factor.value_or(0.0) != 0.0 ? *config_.topk_scaling_factor : 1.0;
  const bool grouped = config_.group_topk > 0;
  std::vector<int64_t> idx_K(static_cast<size_t>(k));
  std::vector<double> scores_E(static_cast<size_t>(E)), route_E(static_cast<size_t>(E)), p_K(static_cast<size_t>(k));
  auto select = [&](const double* values_E) {
    if (grouped) {
      routing::group_limited_topk(idx_K.data(), values_E, E, k, config_.num_groups, config_.group_topk);
    } else {
      routing::topk(idx_K.data(), values_E, E, k);
    }
  };
  if (uses_sinkhorn(config_)) {
    const std::vector<float> balanced_TE = training ? routing::sinkhorn(logits_TE.data(), T, E) : std::vector<float>{};
    for (int64_t t = 0; t < T; ++t) {
      const double* l_E = logits_TE.data() + t * E;
      if (k == 1) {
        for (int64_t e = 0; e < E; ++e) scores_E[e] = rnd(routing::sigmoid(l_E[e]));
      } else {
        routing::softmax(scores_E.data(), l_E, E);
        for (double& v : scores_E) v = rnd(v);
      }
      if (training) {
        for (int64_t e = 0; e < E; ++e) route_E[e] = balanced_TE[static_cast<size_t>(t * E + e)];
        routing::topk(idx_K.data(), route_E.data(), E, k);
      } else {
        routing::topk(idx_K.data(), scores_E.data(), E, k);
      }
      for (const int64_t e : idx_K) {
        selected_TE[t * E + e] = 1;
        probs_TE[t * E + e] = scores_E[e];
      }
    }
  } else {
    for (int64_t t = 0; t < T; ++t) {
      const double* l_E = logits_TE.data() + t * E;
      if (config_.score_function == RouterScoreFunction::kSoftmax) {
        if (config_.pre_softmax) {
          routing::softmax(scores_E.data(), l_E, E);
          for (double& v : scores_E) v = rnd(v);
          select(scores_E.data());
          for (int64_t i = 0; i < k; ++i) p_K[i] = scores_E[idx_K[i]];
        } else {
          select(l_E);
          for (int64_t i = 0; i < k; ++i) p_K[i] = l_E[idx_K[i]];
          routing::softmax(p_K.data(), p_K.data(), k);
          for (double& v : p_K) v = rnd(v);
        }
      } else {
        for (int64_t e = 0; e < E; ++e) scores_E[e] = rnd(routing::pointwise_score(config_.score_function, l_E[e]));
        if (!expert_bias_.empty()) {  // the bias steers the selection only
          for (int64_t e = 0; e < E; ++e) route_E[e] = rnd(scores_E[e] + expert_bias_[static_cast<size_t>(e)]);
          select(route_E.data());
        } else {
          select(scores_E.data());
        }
        double sum = 0.0;
        for (int64_t i = 0; i < k; ++i) sum += p_K[i] = scores_E[idx_K[i]];
        if (k > 1) {
          const double denom = rnd(sum + 1e-20);
          for (double& v : p_K) v = rnd(v / denom);
        }
      }
      for (int64_t i = 0; i < k; ++i) {
        selected_TE[t * E + idx_K[i]] = 1;
        probs_TE[t * E + idx_K[i]] = scale != 1.0 ? rnd(p_K[i] * scale) : p_K[i];
      }
    }
  }

  // Capacity: keep at most C tokens per expert; the dispatcher pads to C when asked.
  RouterOutput out;
  std::vector<uint8_t> map_TE = selected_TE;
  if (config_.capacity_factor.has_value()) {
    out.capacity = routing::expert_capacity(T, k, E, *config_.capacity_factor);
    std::vector<uint8_t> keep_TE(static_cast<size_t>(T * E));
    routing::capacity_keep_mask(keep_TE.data(), selected_TE.data(), probs_TE.data(), T, E, out.capacity,
                                config_.drop_policy);
    for (int64_t i = 0; i < T * E; ++i) {
      map_TE[i] = selected_TE[i] & keep_TE[i];
      if (!map_TE[i]) probs_TE[i] = 0.0;
    }
  }
  out.tokens_per_expert_E.assign(static_cast<size_t>(E), 0);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t e = 0; e < E; ++e) out.tokens_per_expert_E[e] += map_TE[t * E + e];
  }
  const bool padded = config_.pad_expert_input_to_capacity && out.capacity >= 0;
  if (padded) std::fill(out.tokens_per_expert_E.begin(), out.tokens_per_expert_E.end(), out.capacity);

  // Auxiliary losses (training only, each only when its coefficient is non-zero, as Megatron).
  const size_t num_types = config_.load_balancing_types.size();
  out.load_balancing_losses.assign(num_types, 0.0);
  if (training && aux_losses_on(config_)) {
    saved.scores_TE.assign(static_cast<size_t>(T * E), 0.0);
    std::vector<uint8_t> aux_map_TE(static_cast<size_t>(T * E));
    load_balancing::aux_scores(saved.scores_TE.data(), aux_map_TE.data(), logits_TE.data(), T, E, k,
                               config_.score_function);
    for (double& v : saved.scores_TE) v = rnd(v);
    saved.aux_cache.assign(static_cast<size_t>(T * E), 0.0);
    const double* scores = saved.scores_TE.data();
    double* dscores = saved.aux_cache.data();
    const load_balancing::CountReduction reduce_tp_cp = [this](std::vector<double>& counts) {
      sum_counts(counts, tp_cp_);
    };
    for (size_t i = 0; i < num_types; ++i) {
      const LoadBalancingType type = config_.load_balancing_types[i];
      if (std::find(config_.load_balancing_types.begin(), config_.load_balancing_types.begin() + i, type) !=
          config_.load_balancing_types.begin() + i) {
        continue;  // a repeated type counts once, as Megatron's get_aux_loss_coeff
      }
      const double coeff = coeff_of(config_, type);
      if (coeff == 0.0) continue;
      double loss = 0.0;
      // Counts are summed over the ranks holding the other tokens of the same sequences (tp-cp; tp-dp-cp for the
      // global loss), scores stay local: each rank's loss is its tokens' share of the one-process loss.
      if (type == LoadBalancingType::kAuxLoss) {
        loss = load_balancing::aux_loss(scores, aux_map_TE.data(), T, E, k, coeff, dscores, reduce_tp_cp, tp_cp);
      } else if (type == LoadBalancingType::kSeqAuxLoss) {
        loss = load_balancing::seq_aux_loss(scores, aux_map_TE.data(), S, B, E, k, coeff, dscores, reduce_tp_cp, tp_cp);
      } else if (type == LoadBalancingType::kGlobalAuxLoss) {
        std::vector<double> counts_E(static_cast<size_t>(E), 0.0);
        for (int64_t t = 0; t < T; ++t) {
          for (int64_t e = 0; e < E; ++e) counts_E[e] += aux_map_TE[t * E + e];
        }
        sum_counts(counts_E, tp_dp_cp_);
        for (int64_t e = 0; e < E; ++e) global_aux_counts_[e] += counts_E[e];
        global_aux_tokens_ += T;
        global_aux_steps_ += 1;
        std::vector<double> averaged_E(global_aux_counts_);
        for (double& c : averaged_E) c /= static_cast<double>(global_aux_steps_);
        const double total = static_cast<double>(T * tp_dp_cp_.size());
        loss = load_balancing::switch_loss(scores, averaged_E.data(), T, E, total, k, E, coeff, dscores);
      } else {
        continue;
      }
      out.load_balancing_losses[i] = loss / coeff;
    }
  }
  if (training && config_.z_loss_coeff > 0) {
    // Megatron divides the coefficient by |TP x CP|: the ranks' losses add up to the mean over all tokens.
    out.z_loss = load_balancing::z_loss(logits_TE.data(), T, E, 1.0 / static_cast<double>(tp_cp), 0.0, nullptr);
  }

  // Aux-loss-free balancing: count the tokens each expert received (Megatron counts padded slots too).
  if (training && !expert_bias_.empty()) {
    for (int64_t e = 0; e < E; ++e) {
      if (padded) {
        local_tokens_per_expert_[e] += static_cast<double>(std::min(out.capacity, T));
      } else {
        local_tokens_per_expert_[e] += static_cast<double>(out.tokens_per_expert_E[e]);
      }
    }
  }

  out.probs_TE = Tensor({T, E}, DType::kF32, MemCategory::kActivations);
  float* probs_out = out.probs_TE.data<float>();
  for (int64_t i = 0; i < T * E; ++i) probs_out[i] = static_cast<float>(probs_TE[i]);
  saved.probs_TE = std::move(probs_TE);
  out.routing_map_TE = std::move(map_TE);
  saved.output = out;
  return out;
}

void TopKRouter::backward(float* dx_TH, const float* dprobs_TE, const double aux_grad_scale,
                          const RouterActivations& saved) {
  const int64_t T = saved.S * saved.B, H = hidden_, E = config_.num_experts, k = config_.topk;
  const double* logits_TE = saved.logits_TE.data();
  const std::vector<uint8_t>& map_TE = saved.output.routing_map_TE;
  const double scale = config_.topk_scaling_factor.value_or(0.0) != 0.0 ? *config_.topk_scaling_factor : 1.0;
  std::vector<double> dlogits_TE(static_cast<size_t>(T * E), 0.0);

  // Through the probabilities (dropped or unselected experts carry no gradient).
  std::vector<int64_t> sel_K;
  std::vector<double> a_E(static_cast<size_t>(E)), g_E(static_cast<size_t>(E)), p_K;
  for (int64_t t = 0; t < T; ++t) {
    const double* l_E = logits_TE + t * E;
    double* dl_E = dlogits_TE.data() + t * E;
    sel_K.clear();
    for (int64_t e = 0; e < E; ++e) {
      g_E[e] = map_TE[t * E + e] ? scale * static_cast<double>(dprobs_TE[t * E + e]) : 0.0;
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

  // Auxiliary and z losses: d(objective)/d(loss) = aux_grad_scale (MoEAuxLossAutoScaler).
  if (!saved.aux_cache.empty()) {
    std::vector<double> dscores_TE(saved.aux_cache);
    for (double& v : dscores_TE) v *= aux_grad_scale;
    load_balancing::aux_scores_backward(dlogits_TE.data(), dscores_TE.data(), logits_TE, saved.scores_TE.data(), T, E,
                                        config_.score_function);
  }
  if (saved.training && config_.z_loss_coeff > 0) {
    load_balancing::z_loss(logits_TE, T, E, config_.z_loss_coeff / static_cast<double>(tp_cp_.size()), aux_grad_scale,
                           dlogits_TE.data());
  }
  if (config_.router_dtype == RouterDType::kFP32) {
    for (double& v : dlogits_TE) v = static_cast<double>(static_cast<float>(v));
  }

  // dW += dlogits^T x, db += sum_t dlogits, dx += (dlogits W) * jitter.
  const std::vector<double> x_d = to_double(saved.input_TH.data<float>(), T * H);
  const std::vector<double> w_d = to_double(weight_->value.data<float>(), E * H);
  std::vector<double> dw_EH(static_cast<size_t>(E * H)), dx_d(static_cast<size_t>(T * H));
  kernels::cpu::gemm<double>(true, false, E, H, T, 1.0, dlogits_TE.data(), E, x_d.data(), H, 0.0, dw_EH.data(), H);
  kernels::cpu::gemm<double>(false, false, T, H, E, 1.0, dlogits_TE.data(), E, w_d.data(), H, 0.0, dx_d.data(), H);
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
  const bool jitter = saved.training && config_.input_jitter_eps > 0;
  const CounterRng jitter_rng(saved.jitter_seed, saved.jitter_key);
  for (int64_t i = 0; i < T * H; ++i) {
    const double factor =
        jitter ? jitter_factor(jitter_rng, static_cast<uint64_t>(saved.token_offset * H + i), config_.input_jitter_eps)
               : 1.0;
    dx_TH[i] += static_cast<float>(dx_d[i] * factor);
  }
}

void TopKRouter::finish_global_batch() {
  if (!expert_bias_.empty()) {
    sum_counts(local_tokens_per_expert_, tp_dp_cp_);
    load_balancing::update_expert_bias(expert_bias_, local_tokens_per_expert_, config_.bias_update_rate);
    std::fill(local_tokens_per_expert_.begin(), local_tokens_per_expert_.end(), 0.0);
  }
  std::fill(global_aux_counts_.begin(), global_aux_counts_.end(), 0.0);
  global_aux_tokens_ = 0;
  global_aux_steps_ = 0;
}

}  // namespace moecore
