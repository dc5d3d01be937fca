#include "moecore/moe/routing_math.h"

#include <algorithm>
#include <array>
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

namespace {

// The k largest of value_of(0 .. E-1), largest first, ties to the lower index: one pass keeping the best k sorted
// (a later value enters only when strictly larger than the k-th best, so equal values keep index order).
template <typename ValueOf>
void streaming_topk(int64_t* idx_K, const int64_t E, const int64_t k, const ValueOf& value_of) {
  std::array<double, kStreamingTopkMax> best{};
  int64_t n = 0;
  for (int64_t e = 0; e < E; ++e) {
    const double v = value_of(e);
    if (n == k && !(v > best[static_cast<size_t>(k - 1)])) continue;
    int64_t i = n < k ? n++ : k - 1;
    for (; i > 0 && v > best[static_cast<size_t>(i - 1)]; --i) {
      best[static_cast<size_t>(i)] = best[static_cast<size_t>(i - 1)];
      idx_K[i] = idx_K[i - 1];
    }
    best[static_cast<size_t>(i)] = v;
    idx_K[i] = e;
  }
}

}  // namespace

void topk(int64_t* idx_K, const double* values_E, const int64_t E, const int64_t k) {
  if (k > kStreamingTopkMax) {
    ref::topk(idx_K, values_E, E, k);
    return;
  }
  streaming_topk(idx_K, E, k, [values_E](const int64_t e) { return values_E[e]; });
}

void group_limited_topk(int64_t* idx_K, const double* values_E, const int64_t E, const int64_t k,
                        const int64_t num_groups, const int64_t group_topk) {
  if (k > kStreamingTopkMax) {
    ref::group_limited_topk(idx_K, values_E, E, k, num_groups, group_topk);
    return;
  }
  const int64_t per_group = E / num_groups, per_group_k = k / group_topk;
  // Small stack buffers for the usual group counts; a heap one beyond.
  std::array<double, 64> small_scores{};
  std::vector<double> large_scores(num_groups > 64 ? static_cast<size_t>(num_groups) : 0);
  double* group_scores = num_groups > 64 ? large_scores.data() : small_scores.data();
  std::array<int64_t, kStreamingTopkMax> best{};
  for (int64_t g = 0; g < num_groups; ++g) {
    const double* group_E = values_E + g * per_group;
    streaming_topk(best.data(), per_group, per_group_k, [group_E](const int64_t e) { return group_E[e]; });
    double sum = 0.0;
    for (int64_t i = 0; i < per_group_k; ++i) sum += group_E[best[static_cast<size_t>(i)]];
    group_scores[g] = sum;
  }
  streaming_topk(best.data(), num_groups, group_topk, [group_scores](const int64_t g) { return group_scores[g]; });
  // The experts of the other groups count as -inf (Megatron's masked_fill), without building the masked copy.
  std::array<uint8_t, 64> small_kept{};
  std::vector<uint8_t> large_kept(num_groups > 64 ? static_cast<size_t>(num_groups) : 0, 0);
  uint8_t* kept = num_groups > 64 ? large_kept.data() : small_kept.data();
  for (int64_t i = 0; i < group_topk; ++i) kept[best[static_cast<size_t>(i)]] = 1;
  streaming_topk(idx_K, E, k, [&](const int64_t e) {
    return kept[e / per_group] ? values_E[e] : -std::numeric_limits<double>::infinity();
  });
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

void capacity_mask(uint8_t* mask_TE, const int32_t* selected_TK, const double* probs_TK, const int64_t T,
                   const int64_t E, const int64_t k, const int64_t capacity, const TokenDropPolicy policy) {
  if (capacity >= T) {  // Megatron: no dropping when the capacity exceeds the tokens (top-T of T is all of them)
    std::fill(mask_TE, mask_TE + T * E, uint8_t{1});
    return;
  }
  std::fill(mask_TE, mask_TE + T * E, uint8_t{0});
  const int64_t kept = std::max<int64_t>(capacity, 0);
  if (kept == 0) return;
  // Each expert's candidates, the tokens whose key is non-zero (only selected tokens can have one), bucketed by a
  // counting sort that keeps token order.
  std::vector<int64_t> offsets_E1(static_cast<size_t>(E + 1), 0);
  for (int64_t i = 0; i < T * k; ++i) ++offsets_E1[static_cast<size_t>(selected_TK[i]) + 1];
  for (int64_t e = 0; e < E; ++e) offsets_E1[e + 1] += offsets_E1[e];
  struct Candidate {
    int64_t token;
    double key;
  };
  std::vector<Candidate> candidates(static_cast<size_t>(T * k));
  std::vector<int64_t> fill = offsets_E1;
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t i = 0; i < k; ++i) {
      const int64_t e = selected_TK[t * k + i];
      const double key = policy == TokenDropPolicy::kProbs ? probs_TK[t * k + i] : 1.0;
      candidates[static_cast<size_t>(fill[e]++)] = {t, key};
    }
  }
  std::vector<uint8_t> negative_T;
  for (int64_t e = 0; e < E; ++e) {
    const auto first = candidates.begin() + offsets_E1[e], last = candidates.begin() + offsets_E1[e + 1];
    const auto nonzero_end = std::stable_partition(first, last, [](const Candidate& c) { return c.key != 0.0; });
    std::stable_sort(first, nonzero_end, [](const Candidate& a, const Candidate& b) { return a.key > b.key; });
    // Megatron's order over all T tokens: positive keys (descending, ties to the earlier token), then every
    // zero-key token in token order, then negative keys.
    int64_t taken = 0;
    auto it = first;
    for (; it != nonzero_end && it->key > 0.0 && taken < kept; ++it, ++taken) mask_TE[it->token * E + e] = 1;
    if (taken == kept) continue;
    const auto negatives = it;
    if (negatives != nonzero_end) {
      negative_T.assign(static_cast<size_t>(T), 0);
      for (auto n = negatives; n != nonzero_end; ++n) negative_T[static_cast<size_t>(n->token)] = 1;
    }
    for (int64_t t = 0; t < T && taken < kept; ++t) {
      if (mask_TE[t * E + e] || (negatives != nonzero_end && negative_T[static_cast<size_t>(t)])) continue;
      mask_TE[t * E + e] = 1;
      ++taken;
    }
    for (auto n = negatives; n != nonzero_end && taken < kept; ++n, ++taken) mask_TE[n->token * E + e] = 1;
  }
}

}  // namespace moecore::routing
