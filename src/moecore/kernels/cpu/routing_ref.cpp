// Naive references of the routing kernels (routing.h): a full index sort per top-k, a masked copy for group-limited
// routing, dense Jacobians in the backward, and a stable sort over all n tokens per expert for the capacity mask.
#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

#include "moecore/kernels/cpu/routing.h"
#include "moecore/kernels/cpu/routing_scores.h"

namespace moecore::kernels::ref {
namespace {

using routing_scores::to_fp32;

std::vector<double> row(const auto* in, const int64_t t, const int64_t E) {
  std::vector<double> out(static_cast<size_t>(E));
  for (int64_t e = 0; e < E; ++e) out[static_cast<size_t>(e)] = static_cast<double>(in[t * E + e]);
  return out;
}

std::vector<double> softmax(const std::vector<double>& in) {
  double max_value = -std::numeric_limits<double>::infinity();
  for (const double v : in) max_value = std::max(max_value, v);
  std::vector<double> out(in.size());
  double sum = 0.0;
  for (size_t i = 0; i < in.size(); ++i) sum += out[i] = std::exp(in[i] - max_value);
  for (double& v : out) v /= sum;
  return out;
}

std::vector<double> rounded(std::vector<double> values, const bool fp32) {
  if (fp32) {
    for (double& v : values) v = to_fp32(v);
  }
  return values;
}

std::vector<double> softmax_scored(const std::vector<double>& logits, const bool fp32) {
  return rounded(softmax(rounded(logits, fp32)), fp32);
}

void normalize(std::vector<double>& values, const bool fp32) {
  if (fp32) {
    float sum = 0.0f;
    for (const double v : values) sum += static_cast<float>(v);
    for (double& v : values) v = static_cast<double>(static_cast<float>(v) / (sum + 1e-20f));
    return;
  }
  double sum = 0.0;
  for (const double v : values) sum += v;
  for (double& v : values) v /= sum + 1e-20;
}

// Indices of the k largest, largest first, ties to the lower index.
std::vector<int64_t> topk(const std::vector<double>& values, const int64_t k) {
  std::vector<int64_t> order(values.size());
  std::iota(order.begin(), order.end(), int64_t{0});
  std::stable_sort(order.begin(), order.end(), [&](const int64_t a, const int64_t b) {
    return values[static_cast<size_t>(a)] > values[static_cast<size_t>(b)];
  });
  order.resize(static_cast<size_t>(k));
  return order;
}

std::vector<int64_t> group_limited_topk(const std::vector<double>& values, const int64_t k, const int64_t num_groups,
                                        const int64_t group_topk) {
  const auto E = static_cast<int64_t>(values.size());
  const int64_t per_group = E / num_groups, per_group_k = k / group_topk;
  std::vector<double> group_scores(static_cast<size_t>(num_groups));
  for (int64_t g = 0; g < num_groups; ++g) {
    const std::vector<double> group(values.begin() + g * per_group, values.begin() + (g + 1) * per_group);
    for (const int64_t i : topk(group, per_group_k))
      group_scores[static_cast<size_t>(g)] += group[static_cast<size_t>(i)];
  }
  std::vector<double> masked(values.size(), -std::numeric_limits<double>::infinity());
  for (const int64_t g : topk(group_scores, group_topk)) {
    std::copy(values.begin() + g * per_group, values.begin() + (g + 1) * per_group, masked.begin() + g * per_group);
  }
  return topk(masked, k);
}

}  // namespace

template <typename T>
void topk_routing_forward(int32_t* idx_TK, T* probs_TK, const T* logits_TE, const float* bias_E, const T* select_TE,
                          const int64_t n, const int64_t E, const int64_t k, const TopkRoutingSpec& spec) {
  const bool fp32 = spec.fp32_scores;
  for (int64_t t = 0; t < n; ++t) {
    const std::vector<double> logits = row(logits_TE, t, E);
    std::vector<double> scores, ranked;  // the probabilities' source and what the selection ranks
    std::vector<int64_t> idx;
    std::vector<double> probs(static_cast<size_t>(k));
    if (spec.sinkhorn) {
      scores = logits;
      if (k == 1) {
        for (double& v : scores) v = static_cast<double>(static_cast<T>(routing_scores::sigmoid(v)));
      } else {
        scores = softmax_scored(logits, fp32);
      }
      idx = topk(select_TE != nullptr ? row(select_TE, t, E) : scores, k);
      for (int64_t i = 0; i < k; ++i) probs[static_cast<size_t>(i)] = scores[static_cast<size_t>(idx[i])];
    } else {
      const bool softmax_after = spec.score == RoutingScore::kSoftmax && !spec.pre_softmax;
      if (spec.score == RoutingScore::kSoftmax) {
        scores = spec.pre_softmax ? softmax_scored(logits, fp32) : logits;
      } else {
        scores = logits;
        for (double& v : scores) v = routing_scores::pointwise_scored(spec.score, v, fp32);
      }
      ranked = scores;
      if (bias_E != nullptr && spec.score != RoutingScore::kSoftmax) {
        for (int64_t e = 0; e < E; ++e) ranked[static_cast<size_t>(e)] += static_cast<double>(bias_E[e]);
        ranked = rounded(ranked, fp32);
      }
      if (spec.given_selection && idx_TK[t * k] >= 0) {
        idx.assign(idx_TK + t * k, idx_TK + (t + 1) * k);
      } else {
        idx = spec.group_topk > 0 ? group_limited_topk(ranked, k, spec.num_groups, spec.group_topk) : topk(ranked, k);
      }
      for (int64_t i = 0; i < k; ++i) probs[static_cast<size_t>(i)] = scores[static_cast<size_t>(idx[i])];
      if (softmax_after) probs = softmax_scored(probs, fp32);
      if (spec.score != RoutingScore::kSoftmax && k > 1) normalize(probs, fp32);
      if (spec.scaling_factor != 0.0) {
        for (double& p : probs) {
          p = fp32 ? static_cast<double>(static_cast<float>(p) * static_cast<float>(spec.scaling_factor))
                   : p * spec.scaling_factor;
        }
      }
    }
    for (int64_t i = 0; i < k; ++i) {
      idx_TK[t * k + i] = static_cast<int32_t>(idx[static_cast<size_t>(i)]);
      probs_TK[t * k + i] = static_cast<T>(probs[static_cast<size_t>(i)]);
    }
  }
}

// The Jacobian d probs_i / d logits_e of the k selected probabilities (in double, without fp32 rounding), then
// dlogits += J^T dprobs.
template <typename T>
void topk_routing_backward(T* dlogits_TE, const T* dprobs_TE, const uint8_t* map_TE, const int32_t* idx_TK,
                           const T* logits_TE, const int64_t n, const int64_t E, const int64_t k,
                           const TopkRoutingSpec& spec) {
  const double scale = !spec.sinkhorn && spec.scaling_factor != 0.0 ? spec.scaling_factor : 1.0;
  for (int64_t t = 0; t < n; ++t) {
    const std::vector<double> l = row(logits_TE, t, E);
    std::vector<double> jac(static_cast<size_t>(k * E), 0.0);  // [k, E]
    const auto J = [&](const int64_t i, const int64_t e) -> double& { return jac[static_cast<size_t>(i * E + e)]; };
    const auto sel = [&](const int64_t i) -> int64_t { return idx_TK[t * k + i]; };
    const bool dense_softmax =
        (spec.sinkhorn && k > 1) || (!spec.sinkhorn && spec.score == RoutingScore::kSoftmax && spec.pre_softmax);
    if (dense_softmax) {
      const std::vector<double> a = softmax(l);
      for (int64_t i = 0; i < k; ++i) {
        for (int64_t e = 0; e < E; ++e) {
          J(i, e) = a[static_cast<size_t>(sel(i))] * ((e == sel(i) ? 1.0 : 0.0) - a[static_cast<size_t>(e)]);
        }
      }
    } else if (spec.sinkhorn) {
      for (int64_t i = 0; i < k; ++i) {
        const double s = routing_scores::sigmoid(l[static_cast<size_t>(sel(i))]);
        J(i, sel(i)) = s * (1.0 - s);
      }
    } else if (spec.score == RoutingScore::kSoftmax) {
      std::vector<double> picked(static_cast<size_t>(k));
      for (int64_t i = 0; i < k; ++i) picked[static_cast<size_t>(i)] = l[static_cast<size_t>(sel(i))];
      const std::vector<double> p = softmax(picked);
      for (int64_t i = 0; i < k; ++i) {
        for (int64_t j = 0; j < k; ++j) {
          J(i, sel(j)) = p[static_cast<size_t>(i)] * ((i == j ? 1.0 : 0.0) - p[static_cast<size_t>(j)]);
        }
      }
    } else {
      std::vector<double> f(static_cast<size_t>(k)), df(static_cast<size_t>(k));
      double sum = 0.0;
      for (int64_t i = 0; i < k; ++i) {
        const double x = l[static_cast<size_t>(sel(i))];
        f[static_cast<size_t>(i)] = routing_scores::pointwise(spec.score, x);
        df[static_cast<size_t>(i)] = routing_scores::pointwise_grad(spec.score, x, f[static_cast<size_t>(i)]);
        sum += f[static_cast<size_t>(i)];
      }
      const double denom = sum + 1e-20;
      for (int64_t i = 0; i < k; ++i) {
        for (int64_t j = 0; j < k; ++j) {
          const double dp_df = k == 1 ? 1.0 : ((i == j ? 1.0 : 0.0) - f[static_cast<size_t>(i)] / denom) / denom;
          J(i, sel(j)) = dp_df * df[static_cast<size_t>(j)];
        }
      }
    }
    for (int64_t e = 0; e < E; ++e) {
      double grad = 0.0;
      for (int64_t i = 0; i < k; ++i) {
        const int64_t s = sel(i);
        if (map_TE != nullptr && map_TE[t * E + s] == 0) continue;
        grad += J(i, e) * scale * static_cast<double>(dprobs_TE[t * E + s]);
      }
      dlogits_TE[t * E + e] = static_cast<T>(static_cast<double>(dlogits_TE[t * E + e]) + grad);
    }
  }
}

template <typename T>
void sinkhorn(T* out_TE, const T* logits_TE, const int64_t n, const int64_t E, const double tol) {
  std::vector<float> cost(static_cast<size_t>(n * E));
  for (int64_t i = 0; i < n * E; ++i) cost[static_cast<size_t>(i)] = std::exp(static_cast<float>(logits_TE[i]));
  std::vector<float> d0(static_cast<size_t>(n), 1.0f), d1(static_cast<size_t>(E), 1.0f);
  for (int iter = 0; iter < 100000; ++iter) {
    const std::vector<float> d1_old = d1;
    for (int64_t t = 0; t < n; ++t) {
      double sum = 0.0;
      for (int64_t e = 0; e < E; ++e) sum += static_cast<double>(d1[e] * cost[t * E + e]);
      d0[t] = (1.0f / static_cast<float>(n)) * 1.0f / (static_cast<float>(sum) + 1e-8f);
    }
    for (int64_t e = 0; e < E; ++e) {
      double sum = 0.0;
      for (int64_t t = 0; t < n; ++t) sum += static_cast<double>(d0[t] * cost[t * E + e]);
      d1[e] = (1.0f / static_cast<float>(E)) * 1.0f / (static_cast<float>(sum) + 1e-8f);
    }
    double error = 0.0;
    for (int64_t e = 0; e < E; ++e) error += std::abs(static_cast<double>(d1_old[e]) - d1[e]);
    if (!(error / static_cast<double>(E) > tol)) break;
  }
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t e = 0; e < E; ++e) out_TE[t * E + e] = static_cast<T>(d1[e] * cost[t * E + e] * d0[t]);
  }
}

template <typename T>
void routing_map(uint8_t* map_TE, T* probs_TE, int64_t* counts_E, const int32_t* idx_TK, const T* probs_TK,
                 const int64_t n, const int64_t E, const int64_t k, const int64_t capacity,
                 const RoutingDropPolicy policy, const bool pad) {
  std::vector<uint8_t> selected(static_cast<size_t>(n * E), 0);
  std::vector<double> dense_probs(static_cast<size_t>(n * E), 0.0);
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t i = 0; i < k; ++i) {
      selected[static_cast<size_t>(t * E + idx_TK[t * k + i])] = 1;
      dense_probs[static_cast<size_t>(t * E + idx_TK[t * k + i])] = static_cast<double>(probs_TK[t * k + i]);
    }
  }
  std::vector<uint8_t> mask(static_cast<size_t>(n * E), 1);
  if (capacity >= 0 && capacity < n) {
    std::vector<int64_t> tokens(static_cast<size_t>(n));
    for (int64_t e = 0; e < E; ++e) {
      const auto key = [&](const int64_t t) {
        const auto i = static_cast<size_t>(t * E + e);
        return policy == RoutingDropPolicy::kProbs ? dense_probs[i] : static_cast<double>(selected[i]);
      };
      std::iota(tokens.begin(), tokens.end(), int64_t{0});
      std::stable_sort(tokens.begin(), tokens.end(), [&](const int64_t a, const int64_t b) { return key(a) > key(b); });
      for (int64_t t = 0; t < n; ++t) mask[static_cast<size_t>(t * E + e)] = 0;
      for (int64_t i = 0; i < capacity; ++i) mask[static_cast<size_t>(tokens[static_cast<size_t>(i)] * E + e)] = 1;
    }
  }
  for (int64_t e = 0; e < E; ++e) counts_E[e] = 0;
  for (int64_t i = 0; i < n * E; ++i) {
    const auto s = static_cast<size_t>(i);
    map_TE[i] = capacity >= 0 && pad ? mask[s] : static_cast<uint8_t>(mask[s] & selected[s]);
    probs_TE[i] = static_cast<T>(map_TE[i] && selected[s] ? dense_probs[s] : 0.0);
    counts_E[i % E] += map_TE[i];
  }
}

template <typename T>
void aux_scores_forward(T* scores_TE, int32_t* idx_TK, const T* logits_TE, const int64_t n, const int64_t E,
                        const int64_t k, const RoutingScore score, const bool fp32_scores) {
  for (int64_t t = 0; t < n; ++t) {
    std::vector<double> s = row(logits_TE, t, E);
    if (score == RoutingScore::kSoftmax) {
      s = softmax_scored(s, fp32_scores);
    } else {
      for (double& v : s) v = routing_scores::pointwise_scored(score, v, fp32_scores);
      normalize(s, fp32_scores);
    }
    const std::vector<int64_t> idx = topk(s, k);
    for (int64_t e = 0; e < E; ++e) scores_TE[t * E + e] = static_cast<T>(s[static_cast<size_t>(e)]);
    for (int64_t i = 0; i < k; ++i) idx_TK[t * k + i] = static_cast<int32_t>(idx[static_cast<size_t>(i)]);
  }
}

// Dense Jacobians: softmax ds_i/dl_e = s_i (delta_ie - s_e) from the forward's scores; normalised pointwise scores
// s_i = f_i / (F + 1e-20): ds_i/dl_e = f'_e (delta_ie / D - f_i / D^2).
template <typename T>
void aux_scores_backward(T* dlogits_TE, const T* dscores_RE, const int64_t R, const T* scores_TE, const T* logits_TE,
                         const int64_t n, const int64_t E, const RoutingScore score) {
  for (int64_t t = 0; t < n; ++t) {
    const std::vector<double> ds = row(dscores_RE, t % R, E), l = row(logits_TE, t, E), s = row(scores_TE, t, E);
    std::vector<double> f(static_cast<size_t>(E)), df(static_cast<size_t>(E));
    double denom = 1e-20;
    if (score != RoutingScore::kSoftmax) {
      for (int64_t e = 0; e < E; ++e) {
        f[static_cast<size_t>(e)] = routing_scores::pointwise(score, l[static_cast<size_t>(e)]);
        df[static_cast<size_t>(e)] =
            routing_scores::pointwise_grad(score, l[static_cast<size_t>(e)], f[static_cast<size_t>(e)]);
        denom += f[static_cast<size_t>(e)];
      }
    }
    for (int64_t e = 0; e < E; ++e) {
      double grad = 0.0;
      for (int64_t i = 0; i < E; ++i) {
        const double delta = i == e ? 1.0 : 0.0;
        const auto si = static_cast<size_t>(i), se = static_cast<size_t>(e);
        const double jac = score == RoutingScore::kSoftmax ? s[si] * (delta - s[se])
                                                           : df[se] * (delta / denom - f[si] / (denom * denom));
        grad += jac * ds[si];
      }
      dlogits_TE[t * E + e] = static_cast<T>(static_cast<double>(dlogits_TE[t * E + e]) + grad);
    }
  }
}

template <typename T>
void aux_loss_sums(T* sums_E, T* sums_BE, T* counts_BE, const T* scores_TE, const int32_t* idx_TK, const int64_t n,
                   const int64_t B, const int64_t E, const int64_t k) {
  for (int64_t e = 0; e < E; ++e) {
    double all = 0.0;
    for (int64_t t = 0; t < n; ++t) all += static_cast<double>(scores_TE[t * E + e]);
    sums_E[e] = static_cast<T>(all);
    for (int64_t b = 0; b < B; ++b) {
      double seq = 0.0, count = 0.0;
      for (int64_t t = b; t < n; t += B) {
        seq += static_cast<double>(scores_TE[t * E + e]);
        for (int64_t i = 0; i < k; ++i) count += idx_TK[t * k + i] == e ? 1.0 : 0.0;
      }
      sums_BE[b * E + e] = static_cast<T>(seq);
      counts_BE[b * E + e] = static_cast<T>(count);
    }
  }
}

template <typename T>
double z_loss_forward(T* lse_T, const T* logits_TE, const int64_t n, const int64_t E) {
  double sum = 0.0;
  for (int64_t t = 0; t < n; ++t) {
    double total = 0.0;
    for (int64_t e = 0; e < E; ++e) total += std::exp(static_cast<double>(logits_TE[t * E + e]));
    lse_T[t] = static_cast<T>(std::log(total));
    sum += static_cast<double>(lse_T[t]) * static_cast<double>(lse_T[t]);
  }
  return sum;
}

template <typename T>
void z_loss_backward(T* dlogits_TE, const T* logits_TE, const T* lse_T, const int64_t n, const int64_t E,
                     const double scale) {
  for (int64_t t = 0; t < n; ++t) {
    const double lse = static_cast<double>(lse_T[t]);
    for (int64_t e = 0; e < E; ++e) {
      const double p = std::exp(static_cast<double>(logits_TE[t * E + e]) - lse);
      dlogits_TE[t * E + e] =
          static_cast<T>(static_cast<double>(dlogits_TE[t * E + e]) + scale * 2.0 * lse / static_cast<double>(n) * p);
    }
  }
}

template <typename T>
double switch_loss(const T* sums_J, const T* counts_J, const int64_t J, const double factor) {
  double loss = 0.0;
  for (int64_t j = 0; j < J; ++j) loss += static_cast<double>(sums_J[j]) * static_cast<double>(counts_J[j]);
  return loss * factor;
}

template <typename T>
void switch_loss_backward(T* dsums_J, const T* counts_J, const int64_t J, const double factor, const double dloss) {
  const double scale = dloss * factor;
  for (int64_t j = 0; j < J; ++j) {
    dsums_J[j] = static_cast<T>(static_cast<double>(dsums_J[j]) + scale * static_cast<double>(counts_J[j]));
  }
}

template <typename T>
void expert_bias_update(float* bias_E, const T* counts_E, const int64_t E, const double rate) {
  if (E == 0) return;
  double total = 0.0;
  for (int64_t e = 0; e < E; ++e) total += static_cast<double>(counts_E[e]);
  const float mean = static_cast<float>(total) / static_cast<float>(E);
  const float step = static_cast<float>(rate);
  for (int64_t e = 0; e < E; ++e) {
    const float offset = mean - static_cast<float>(counts_E[e]);
    const float sign = offset > 0 ? 1.0f : (offset < 0 ? -1.0f : 0.0f);
    bias_E[e] = bias_E[e] + sign * step;
  }
}

#define MOECORE_INSTANTIATE(T)                                                                                       \
  template void topk_routing_forward<T>(int32_t*, T*, const T*, const float*, const T*, int64_t, int64_t, int64_t,   \
                                        const TopkRoutingSpec&);                                                     \
  template void topk_routing_backward<T>(T*, const T*, const uint8_t*, const int32_t*, const T*, int64_t, int64_t,   \
                                         int64_t, const TopkRoutingSpec&);                                           \
  template void sinkhorn<T>(T*, const T*, int64_t, int64_t, double);                                                 \
  template void routing_map<T>(uint8_t*, T*, int64_t*, const int32_t*, const T*, int64_t, int64_t, int64_t, int64_t, \
                               RoutingDropPolicy, bool);                                                             \
  template void aux_scores_forward<T>(T*, int32_t*, const T*, int64_t, int64_t, int64_t, RoutingScore, bool);        \
  template void aux_scores_backward<T>(T*, const T*, int64_t, const T*, const T*, int64_t, int64_t, RoutingScore);   \
  template void aux_loss_sums<T>(T*, T*, T*, const T*, const int32_t*, int64_t, int64_t, int64_t, int64_t);          \
  template double z_loss_forward<T>(T*, const T*, int64_t, int64_t);                                                 \
  template void z_loss_backward<T>(T*, const T*, const T*, int64_t, int64_t, double);                                \
  template double switch_loss<T>(const T*, const T*, int64_t, double);                                               \
  template void switch_loss_backward<T>(T*, const T*, int64_t, double, double);                                      \
  template void expert_bias_update<T>(float*, const T*, int64_t, double);
MOECORE_INSTANTIATE(float)
MOECORE_INSTANTIATE(double)
#undef MOECORE_INSTANTIATE

}  // namespace moecore::kernels::ref
