// Naive references of the routing selection (routing_math.h, namespace ref): a full index sort per top-k, a masked
// copy for group-limited routing, and a stable sort over all T tokens per expert for the capacity mask. The router
// uses the one-pass versions in routing_math.cpp; tests hold them equal.
#include <algorithm>
#include <limits>
#include <numeric>
#include <vector>

#include "moecore/moe/routing_math.h"

namespace moecore::routing::ref {

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

void capacity_mask(uint8_t* mask_TE, const uint8_t* selected_TE, const double* probs_TE, const int64_t T,
                   const int64_t E, const int64_t capacity, const TokenDropPolicy policy) {
  if (capacity >= T) {
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

}  // namespace moecore::routing::ref
