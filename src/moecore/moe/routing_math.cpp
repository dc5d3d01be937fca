#include "moecore/moe/routing_math.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <stdexcept>

namespace moecore::routing {

double softplus(const double x) { return x > 20.0 ? x : std::log1p(std::exp(x)); }

double softplus_grad(const double x) { return x > 20.0 ? 1.0 : sigmoid(x); }

double sigmoid(const double x) {
  if (x >= 0) return 1.0 / (1.0 + std::exp(-x));
  const double z = std::exp(x);
  return z / (1.0 + z);
}

double pointwise_score(const RouterScoreFunction fn, const double logit) {
  if (fn == RouterScoreFunction::kSqrtSoftplus) return std::sqrt(softplus(logit));
  return sigmoid(logit);
}

double pointwise_score_grad(const RouterScoreFunction fn, const double logit, const double score) {
  if (fn == RouterScoreFunction::kSqrtSoftplus) return score > 0 ? softplus_grad(logit) / (2.0 * score) : 0.0;
  return score * (1.0 - score);
}

void softmax(double* out_E, const double* in_E, const int64_t E) {
  const double max_value = *std::max_element(in_E, in_E + E);
  double sum = 0.0;
  for (int64_t e = 0; e < E; ++e) {
    out_E[e] = std::exp(in_E[e] - max_value);
    sum += out_E[e];
  }
  for (int64_t e = 0; e < E; ++e) out_E[e] /= sum;
}

double to_fp32(const double value) { return static_cast<double>(static_cast<float>(value)); }

void softmax_fp32(double* out_E, const double* logits_E, const int64_t E) {
  for (int64_t e = 0; e < E; ++e) out_E[e] = to_fp32(logits_E[e]);
  softmax(out_E, out_E, E);
  for (int64_t e = 0; e < E; ++e) out_E[e] = to_fp32(out_E[e]);
}

double pointwise_score_fp32(const RouterScoreFunction fn, const double logit) {
  return to_fp32(pointwise_score(fn, to_fp32(logit)));
}

void normalize_fp32(double* values_K, const int64_t K) {
  float sum = 0.0f;
  for (int64_t i = 0; i < K; ++i) sum += static_cast<float>(values_K[i]);
  const float denom = sum + 1e-20f;
  for (int64_t i = 0; i < K; ++i) values_K[i] = static_cast<double>(static_cast<float>(values_K[i]) / denom);
}

double logsumexp(const double* in_E, const int64_t E) {
  const double max_value = *std::max_element(in_E, in_E + E);
  double sum = 0.0;
  for (int64_t e = 0; e < E; ++e) sum += std::exp(in_E[e] - max_value);
  return max_value + std::log(sum);
}

void topk(int64_t* idx_K, const double* values_E, const int64_t E, const int64_t k) {
  std::vector<int64_t> order(static_cast<size_t>(E));
  std::iota(order.begin(), order.end(), int64_t{0});
  std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](const int64_t a, const int64_t b) {
    return values_E[a] > values_E[b] || (values_E[a] == values_E[b] && a < b);
  });
  std::copy(order.begin(), order.begin() + k, idx_K);
}

void group_limited_topk(int64_t* idx_K, const double* values_E, const int64_t E, const int64_t k,
                        const int64_t num_groups, const int64_t group_topk) {
  const int64_t per_group = E / num_groups, per_group_k = k / group_topk;
  std::vector<double> group_scores(static_cast<size_t>(num_groups));
  std::vector<int64_t> best(static_cast<size_t>(std::max<int64_t>(per_group_k, group_topk)));
  for (int64_t g = 0; g < num_groups; ++g) {
    topk(best.data(), values_E + g * per_group, per_group, per_group_k);
    double sum = 0.0;
    for (int64_t i = 0; i < per_group_k; ++i) sum += values_E[g * per_group + best[static_cast<size_t>(i)]];
    group_scores[static_cast<size_t>(g)] = sum;
  }
  topk(best.data(), group_scores.data(), num_groups, group_topk);
  std::vector<double> masked(static_cast<size_t>(E), -std::numeric_limits<double>::infinity());
  for (int64_t i = 0; i < group_topk; ++i) {
    const int64_t g = best[static_cast<size_t>(i)];
    std::copy(values_E + g * per_group, values_E + (g + 1) * per_group, masked.begin() + g * per_group);
  }
  topk(idx_K, masked.data(), E, k);
}

std::vector<float> sinkhorn(const double* logits_TE, const int64_t T, const int64_t E, const double tol) {
  std::vector<float> cost_TE(static_cast<size_t>(T * E));
  for (int64_t i = 0; i < T * E; ++i) cost_TE[static_cast<size_t>(i)] = std::exp(static_cast<float>(logits_TE[i]));
  std::vector<float> d0_T(static_cast<size_t>(T), 1.0f), d1_E(static_cast<size_t>(E), 1.0f);
  std::vector<float> d1_old_E = d1_E;
  const float eps = 1e-8f;
  // Megatron's loop has no iteration cap; this one stops after many iterations rather than spin forever.
  for (int iter = 0; iter < 100000; ++iter) {
    for (int64_t t = 0; t < T; ++t) {
      double row = 0.0;
      for (int64_t e = 0; e < E; ++e) row += static_cast<double>(d1_E[e] * cost_TE[t * E + e]);
      d0_T[t] = (1.0f / static_cast<float>(T)) * 1.0f / (static_cast<float>(row) + eps);
    }
    for (int64_t e = 0; e < E; ++e) {
      double col = 0.0;
      for (int64_t t = 0; t < T; ++t) col += static_cast<double>(d0_T[t] * cost_TE[t * E + e]);
      d1_E[e] = (1.0f / static_cast<float>(E)) * 1.0f / (static_cast<float>(col) + eps);
    }
    double error = 0.0;
    for (int64_t e = 0; e < E; ++e) error += std::abs(static_cast<double>(d1_old_E[e]) - d1_E[e]);
    error /= static_cast<double>(E);
    d1_old_E = d1_E;
    if (!(error > tol)) break;
  }
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t e = 0; e < E; ++e) cost_TE[t * E + e] = d1_E[e] * cost_TE[t * E + e] * d0_T[t];
  }
  return cost_TE;
}

int64_t expert_capacity(const int64_t T, const int64_t k, const int64_t E, const double capacity_factor) {
  return static_cast<int64_t>(std::ceil((static_cast<double>(T * k) / static_cast<double>(E)) * capacity_factor));
}

void capacity_mask(uint8_t* mask_TE, const uint8_t* selected_TE, const double* probs_TE, const int64_t T,
                   const int64_t E, const int64_t capacity, const TokenDropPolicy policy) {
  if (capacity >= T) {  // Megatron: no dropping when the capacity exceeds the tokens (top-T of T is all of them)
    std::fill(mask_TE, mask_TE + T * E, uint8_t{1});
    return;
  }
  const int64_t kept = std::max<int64_t>(capacity, 0);
  std::vector<int64_t> tokens(static_cast<size_t>(T));
  for (int64_t e = 0; e < E; ++e) {
    auto key = [&](const int64_t t) {
      return policy == TokenDropPolicy::kProbs ? probs_TE[t * E + e] : static_cast<double>(selected_TE[t * E + e]);
    };
    std::iota(tokens.begin(), tokens.end(), int64_t{0});
    std::stable_sort(tokens.begin(), tokens.end(), [&](const int64_t a, const int64_t b) { return key(a) > key(b); });
    for (int64_t t = 0; t < T; ++t) mask_TE[t * E + e] = 0;
    for (int64_t i = 0; i < kept; ++i) mask_TE[tokens[static_cast<size_t>(i)] * E + e] = 1;
  }
}

}  // namespace moecore::routing
