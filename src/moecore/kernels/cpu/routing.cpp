// Fast routing kernels (routing.h): one pass over each token's E logits, parallel over tokens; the top-k keeps the
// best k in one scan; the capacity mask buckets the selected tokens per expert instead of sorting all n per expert.
#include "moecore/kernels/cpu/routing.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "moecore/kernels/cpu/above_mask.h"
#include "moecore/kernels/cpu/fast_exp.h"
#include "moecore/kernels/cpu/routing_scores.h"
#include "moecore/kernels/cpu/vector_isa.h"

namespace moecore::kernels::cpu {
namespace {

using routing_scores::to_fp32;

// Below this many logits the per-token loops stay on one thread.
constexpr int64_t kParallelLogits = 16384;
// The one-pass top-k keeps up to this many; a larger k sorts.
constexpr int64_t kStreamingTopkMax = 16;

void softmax(double* out_E, const double* in_E, const int64_t E) {
  const double max_value = *std::max_element(in_E, in_E + E);
  double sum = 0.0;
  for (int64_t e = 0; e < E; ++e) {
    out_E[e] = std::exp(in_E[e] - max_value);
    sum += out_E[e];
  }
  for (int64_t e = 0; e < E; ++e) out_E[e] /= sum;
}

// Rows of at least this many logits try softmax_fp32_vectorised first.
constexpr int64_t kVectorisedSoftmaxMin = 32;

// softmax_scored's fp32 result (below) in vector loops: exp by fast_exp_nonpositive, the sum over eight interleaved
// partial sums. Its quotients q then differ from softmax()'s (glibc's exp, sum in element order) by less than
// delta = 4 (E + 20) 2^-52 relative: each exp within 8 ulp of exp(x), each sum within E ulp of its terms' sum, one
// rounding each for the quotient and the bound, doubled for margin. Where q (1 - delta) and q (1 + delta) round to
// the same fp32 value, so does softmax()'s quotient: the result is bit for bit the same. Returns false (out_E
// unspecified) if some quotient lies closer to an fp32 rounding boundary, or is not finite; the caller then runs
// softmax(). About 2 E delta 2^24 of the rows (1e-3 at E = 256) go that way. out_E must not alias logits_E.
MOECORE_VECTOR_CLONES bool softmax_fp32_vectorised(double* out_E, const double* logits_E, const int64_t E) {
  constexpr int kLanes = 8;
  double part[kLanes];
  for (int64_t e = 0; e < E; ++e) out_E[e] = to_fp32(logits_E[e]);
  for (double& m : part) m = -std::numeric_limits<double>::infinity();
  int64_t e = 0;
  for (; e + kLanes <= E; e += kLanes) {
    for (int j = 0; j < kLanes; ++j) part[j] = out_E[e + j] > part[j] ? out_E[e + j] : part[j];
  }
  double max_value = part[0];
  for (int j = 1; j < kLanes; ++j) max_value = part[j] > max_value ? part[j] : max_value;
  for (; e < E; ++e) max_value = out_E[e] > max_value ? out_E[e] : max_value;
  for (e = 0; e < E; ++e) out_E[e] = fast_exp_nonpositive(out_E[e] - max_value);
  for (double& p : part) p = 0.0;
  for (e = 0; e + kLanes <= E; e += kLanes) {
    for (int j = 0; j < kLanes; ++j) part[j] += out_E[e + j];
  }
  double sum = 0.0;
  for (; e < E; ++e) sum += out_E[e];
  for (const double p : part) sum += p;
  const double delta = 4.0 * static_cast<double>(E + 20) * 0x1p-52;
  const double below = 1.0 - delta, above = 1.0 + delta;
  int unstable = 0;
  for (e = 0; e < E; ++e) {
    const double q = out_E[e] / sum;
    unstable |= static_cast<int>(!(to_fp32(q * below) == to_fp32(q * above)));
    out_E[e] = to_fp32(q);
  }
  return unstable == 0;
}

// torch.softmax(logits, dtype=torch.float32) when fp32: logits rounded to fp32, result rounded to fp32.
void softmax_scored(double* out_E, const double* logits_E, const int64_t E, const bool fp32) {
  if (!fp32) {
    softmax(out_E, logits_E, E);
    return;
  }
  if (E >= kVectorisedSoftmaxMin && out_E != logits_E && softmax_fp32_vectorised(out_E, logits_E, E)) return;
  for (int64_t e = 0; e < E; ++e) out_E[e] = to_fp32(logits_E[e]);
  softmax(out_E, out_E, E);
  for (int64_t e = 0; e < E; ++e) out_E[e] = to_fp32(out_E[e]);
}

// values_K /= (sum + 1e-20), in fp32 arithmetic (the sum left to right) when fp32.
void normalize(double* values_K, const int64_t K, const bool fp32) {
  if (fp32) {
    float sum = 0.0f;
    for (int64_t i = 0; i < K; ++i) sum += static_cast<float>(values_K[i]);
    const float denom = sum + 1e-20f;
    for (int64_t i = 0; i < K; ++i) values_K[i] = static_cast<double>(static_cast<float>(values_K[i]) / denom);
    return;
  }
  double sum = 0.0;
  for (int64_t i = 0; i < K; ++i) sum += values_K[i];
  for (int64_t i = 0; i < K; ++i) values_K[i] /= sum + 1e-20;
}

double logsumexp(const double* in_E, const int64_t E) {
  const double max_value = *std::max_element(in_E, in_E + E);
  double sum = 0.0;
  for (int64_t e = 0; e < E; ++e) sum += std::exp(in_E[e] - max_value);
  return max_value + std::log(sum);
}

// The best k values offered so far, largest first, and their indices: a value enters only when strictly larger
// than the k-th best, so equal values keep the order they were offered in.
class BestK {
 public:
  BestK(int64_t* idx_K, const int64_t k) : idx_K_(idx_K), k_(k) {}
  bool full() const { return n_ == k_; }
  double kth() const { return best_[static_cast<size_t>(k_ - 1)]; }
  void offer(const int64_t e, const double v) {
    if (n_ == k_ && !(v > kth())) return;
    int64_t i = n_ < k_ ? n_++ : k_ - 1;
    for (; i > 0 && v > best_[static_cast<size_t>(i - 1)]; --i) {
      best_[static_cast<size_t>(i)] = best_[static_cast<size_t>(i - 1)];
      idx_K_[i] = idx_K_[i - 1];
    }
    best_[static_cast<size_t>(i)] = v;
    idx_K_[i] = e;
  }

 private:
  std::array<double, kStreamingTopkMax> best_{};
  int64_t* idx_K_;
  int64_t k_, n_ = 0;
};

// The k largest of value_of(0 .. E-1), largest first, ties to the lower index, in one pass.
template <typename ValueOf>
void streaming_topk(int64_t* idx_K, const int64_t E, const int64_t k, const ValueOf& value_of) {
  BestK best(idx_K, k);
  for (int64_t e = 0; e < E; ++e) best.offer(e, value_of(e));
}

// Sorting top-k for a k beyond the streaming buffer (same order: largest first, ties to the lower index).
void sorted_topk(int64_t* idx_K, const double* values_E, const int64_t E, const int64_t k) {
  std::vector<int64_t> order(static_cast<size_t>(E));
  for (int64_t e = 0; e < E; ++e) order[static_cast<size_t>(e)] = e;
  std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](const int64_t a, const int64_t b) {
    return values_E[a] > values_E[b] || (values_E[a] == values_E[b] && a < b);
  });
  std::copy(order.begin(), order.begin() + k, idx_K);
}

// streaming_topk over an array, offering only the values that beat the k-th best as their block of 16 starts: the
// others would be refused (the k-th best only grows), so the result is the same. Once the best k are large, most
// blocks offer nothing and cost one vector compare or two (above_mask.h).
void topk(int64_t* idx_K, const double* values_E, const int64_t E, const int64_t k) {
  if (k > kStreamingTopkMax) {
    sorted_topk(idx_K, values_E, E, k);
    return;
  }
  constexpr int64_t kBlock = 16;
  BestK best(idx_K, k);
  int64_t e = 0;
  for (; e < E && !best.full(); ++e) best.offer(e, values_E[e]);
  const AboveMask16 above = best_above_mask16();
  for (; e + kBlock <= E; e += kBlock) {
    for (uint32_t mask = above(values_E + e, best.kth()); mask != 0; mask &= mask - 1) {
      const int64_t j = std::countr_zero(mask);
      best.offer(e + j, values_E[e + j]);
    }
  }
  for (; e < E; ++e) best.offer(e, values_E[e]);
}

// Megatron's group_limited_topk: a group's score is the sum of its top-(k // group_topk) values; the group_topk best
// groups stay, the experts of the others count as -inf.
void group_limited_topk(int64_t* idx_K, const double* values_E, const int64_t E, const int64_t k,
                        const int64_t num_groups, const int64_t group_topk) {
  const int64_t per_group = E / num_groups, per_group_k = k / group_topk;
  std::vector<double> group_scores(static_cast<size_t>(num_groups));
  std::vector<int64_t> best(static_cast<size_t>(std::max(per_group_k, group_topk)));
  for (int64_t g = 0; g < num_groups; ++g) {
    const double* group_E = values_E + g * per_group;
    topk(best.data(), group_E, per_group, per_group_k);
    double sum = 0.0;
    for (int64_t i = 0; i < per_group_k; ++i) sum += group_E[best[static_cast<size_t>(i)]];
    group_scores[static_cast<size_t>(g)] = sum;
  }
  topk(best.data(), group_scores.data(), num_groups, group_topk);
  std::vector<uint8_t> kept(static_cast<size_t>(num_groups), 0);
  for (int64_t i = 0; i < group_topk; ++i) kept[static_cast<size_t>(best[static_cast<size_t>(i)])] = 1;
  const auto masked = [&](const int64_t e) {
    return kept[static_cast<size_t>(e / per_group)] ? values_E[e] : -std::numeric_limits<double>::infinity();
  };
  if (k <= kStreamingTopkMax) {
    streaming_topk(idx_K, E, k, masked);
    return;
  }
  std::vector<double> masked_E(static_cast<size_t>(E));
  for (int64_t e = 0; e < E; ++e) masked_E[static_cast<size_t>(e)] = masked(e);
  sorted_topk(idx_K, masked_E.data(), E, k);
}

// Per-thread scratch of the per-token loops.
struct Scratch {
  explicit Scratch(const int64_t E, const int64_t k)
      : l_E(static_cast<size_t>(E)),
        a_E(static_cast<size_t>(E)),
        b_E(static_cast<size_t>(E)),
        d_E(static_cast<size_t>(E)),
        g_K(static_cast<size_t>(k)),
        p_K(static_cast<size_t>(k)),
        idx_K(static_cast<size_t>(k)) {}
  std::vector<double> l_E, a_E, b_E, d_E, g_K, p_K;
  std::vector<int64_t> idx_K;
};

// Elementwise row loops in the CPU's widest vectors (vector_isa.h): the same values as scalar code. load_row widens a
// row to double, store_row writes one as T; add_to_columns adds a row to two rows of column sums (each sum in token
// order); add_softmax_grad adds s_e (ds_e - dot) to each gradient entry in double, written back as T.
MOECORE_VECTOR_CLONES void load_row(double* out_E, const float* in_E, const int64_t E) {
  for (int64_t e = 0; e < E; ++e) out_E[e] = static_cast<double>(in_E[e]);
}
MOECORE_VECTOR_CLONES void load_row(double* out_E, const double* in_E, const int64_t E) {
  for (int64_t e = 0; e < E; ++e) out_E[e] = in_E[e];
}
MOECORE_VECTOR_CLONES void store_row(float* out_E, const double* in_E, const int64_t E) {
  for (int64_t e = 0; e < E; ++e) out_E[e] = static_cast<float>(in_E[e]);
}
MOECORE_VECTOR_CLONES void store_row(double* out_E, const double* in_E, const int64_t E) {
  for (int64_t e = 0; e < E; ++e) out_E[e] = in_E[e];
}
MOECORE_VECTOR_CLONES void add_to_columns(double* __restrict all_E, double* __restrict seq_E, const float* s_E,
                                          const int64_t E) {
  for (int64_t e = 0; e < E; ++e) {
    all_E[e] += static_cast<double>(s_E[e]);
    seq_E[e] += static_cast<double>(s_E[e]);
  }
}
MOECORE_VECTOR_CLONES void add_to_columns(double* __restrict all_E, double* __restrict seq_E, const double* s_E,
                                          const int64_t E) {
  for (int64_t e = 0; e < E; ++e) {
    all_E[e] += s_E[e];
    seq_E[e] += s_E[e];
  }
}
MOECORE_VECTOR_CLONES void add_softmax_grad(float* dl_E, const float* s_E, const float* ds_E, const double dot,
                                            const int64_t E) {
  for (int64_t e = 0; e < E; ++e) {
    dl_E[e] = static_cast<float>(static_cast<double>(dl_E[e]) +
                                 static_cast<double>(s_E[e]) * (static_cast<double>(ds_E[e]) - dot));
  }
}
MOECORE_VECTOR_CLONES void add_softmax_grad(double* dl_E, const double* s_E, const double* ds_E, const double dot,
                                            const int64_t E) {
  for (int64_t e = 0; e < E; ++e) dl_E[e] = dl_E[e] + s_E[e] * (ds_E[e] - dot);
}

// One token of TopKRouter.sinkhorn_load_balancing: the activation is sigmoid (top-1, in the logits' type T) or the
// softmax; the selection ranks select_E (training) or the activation; probs = activation at the selected experts.
template <typename T>
void sinkhorn_token(int64_t* idx_K, double* p_K, const double* l_E, const T* select_E, const int64_t E, const int64_t k,
                    const bool fp32, double* act_E, double* route_E) {
  if (k == 1) {
    for (int64_t e = 0; e < E; ++e) act_E[e] = static_cast<double>(static_cast<T>(routing_scores::sigmoid(l_E[e])));
  } else {
    softmax_scored(act_E, l_E, E, fp32);
  }
  if (select_E != nullptr) {
    load_row(route_E, select_E, E);
    topk(idx_K, route_E, E, k);
  } else {
    topk(idx_K, act_E, E, k);
  }
  for (int64_t i = 0; i < k; ++i) p_K[i] = act_E[idx_K[i]];
}

// One token of Megatron's topk_routing_with_score_function (unfused path).
void score_function_token(int64_t* idx_K, double* p_K, const double* l_E, const float* bias_E, const int64_t E,
                          const int64_t k, const TopkRoutingSpec& spec, double* scores_E, double* route_E,
                          const bool given) {
  const bool fp32 = spec.fp32_scores;
  auto select = [&](const double* values_E) {
    if (given) return;  // idx_K holds the replayed experts
    if (spec.group_topk > 0) {
      group_limited_topk(idx_K, values_E, E, k, spec.num_groups, spec.group_topk);
    } else {
      topk(idx_K, values_E, E, k);
    }
  };
  if (spec.score == RoutingScore::kSoftmax && spec.pre_softmax) {
    softmax_scored(scores_E, l_E, E, fp32);
    select(scores_E);
    for (int64_t i = 0; i < k; ++i) p_K[i] = scores_E[idx_K[i]];
  } else if (spec.score == RoutingScore::kSoftmax) {
    select(l_E);  // top-k of the logits, softmax over the selected
    for (int64_t i = 0; i < k; ++i) p_K[i] = l_E[idx_K[i]];
    softmax_scored(p_K, p_K, k, fp32);
  } else {
    for (int64_t e = 0; e < E; ++e) scores_E[e] = routing_scores::pointwise_scored(spec.score, l_E[e], fp32);
    if (bias_E != nullptr) {  // the bias steers the selection only
      for (int64_t e = 0; e < E; ++e) {
        const double biased = scores_E[e] + static_cast<double>(bias_E[e]);
        route_E[e] = fp32 ? to_fp32(biased) : biased;
      }
      select(route_E);
    } else {
      select(scores_E);
    }
    for (int64_t i = 0; i < k; ++i) p_K[i] = scores_E[idx_K[i]];
    if (k > 1) normalize(p_K, k, fp32);
  }
  if (fp32) {
    const float scale = static_cast<float>(spec.scaling_factor);
    if (scale != 0.0f) {
      for (int64_t i = 0; i < k; ++i) p_K[i] = static_cast<double>(static_cast<float>(p_K[i]) * scale);
    }
  } else if (spec.scaling_factor != 0.0) {
    for (int64_t i = 0; i < k; ++i) p_K[i] *= spec.scaling_factor;
  }
}

}  // namespace

template <typename T>
void topk_routing_forward(int32_t* idx_TK, T* probs_TK, const T* logits_TE, const float* bias_E, const T* select_TE,
                          const int64_t n, const int64_t E, const int64_t k, const TopkRoutingSpec& spec) {
#pragma omp parallel if (n * E >= kParallelLogits)
  {
    Scratch s(E, k);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < n; ++t) {
      load_row(s.l_E.data(), logits_TE + t * E, E);
      const bool given = spec.given_selection && idx_TK[t * k] >= 0;
      if (given) {
        for (int64_t i = 0; i < k; ++i) s.idx_K[static_cast<size_t>(i)] = idx_TK[t * k + i];
      }
      if (spec.sinkhorn) {
        sinkhorn_token(s.idx_K.data(), s.p_K.data(), s.l_E.data(), select_TE != nullptr ? select_TE + t * E : nullptr,
                       E, k, spec.fp32_scores, s.a_E.data(), s.b_E.data());
      } else {
        score_function_token(s.idx_K.data(), s.p_K.data(), s.l_E.data(), bias_E, E, k, spec, s.a_E.data(), s.b_E.data(),
                             given);
      }
      for (int64_t i = 0; i < k; ++i) {
        idx_TK[t * k + i] = static_cast<int32_t>(s.idx_K[static_cast<size_t>(i)]);
        probs_TK[t * k + i] = static_cast<T>(s.p_K[static_cast<size_t>(i)]);
      }
    }
  }
}

template <typename T>
void topk_routing_backward(T* dlogits_TE, const T* dprobs_TE, const uint8_t* map_TE, const int32_t* idx_TK,
                           const T* logits_TE, const int64_t n, const int64_t E, const int64_t k,
                           const TopkRoutingSpec& spec) {
  const bool scaled = !spec.sinkhorn && spec.scaling_factor != 0.0;
  const double scale = scaled ? spec.scaling_factor : 1.0;
  const RoutingScore fn = spec.score;
  // The probabilities depend on all E logits through a softmax over all of them (pre-softmax, sinkhorn top-k > 1),
  // else on the k selected logits only.
  const bool dense_softmax =
      (spec.sinkhorn && k > 1) || (!spec.sinkhorn && fn == RoutingScore::kSoftmax && spec.pre_softmax);
#pragma omp parallel if (n * E >= kParallelLogits)
  {
    Scratch s(E, k);
    double* a_E = s.a_E.data();
    double* g_K = s.g_K.data();
    double* p_K = s.p_K.data();
    int64_t* sel_K = s.idx_K.data();
#pragma omp for schedule(static)
    for (int64_t t = 0; t < n; ++t) {
      const T* logits_E = logits_TE + t * E;
      T* dlogits_E = dlogits_TE + t * E;
      // The selected experts in ascending order; padding tokens are in the map with probability 0 but were not
      // selected, so they carry no gradient, as Megatron (the probs are scattered from the selected ones).
      for (int64_t i = 0; i < k; ++i) sel_K[i] = idx_TK[t * k + i];
      std::sort(sel_K, sel_K + k);
      for (int64_t i = 0; i < k; ++i) {
        const int64_t e = sel_K[i];
        const bool kept = map_TE == nullptr || map_TE[t * E + e] != 0;
        g_K[i] = kept ? scale * static_cast<double>(dprobs_TE[t * E + e]) : 0.0;
      }
      // Each gradient entry is read as a double, added to in double and written back to T (the untouched ones
      // unchanged): only the dense softmax reaches every logit, the other scores the k selected.
      const auto add = [&](const int64_t e, const double value) {
        dlogits_E[e] = static_cast<T>(static_cast<double>(dlogits_E[e]) + value);
      };
      const auto logit = [&](const int64_t e) { return static_cast<double>(logits_E[e]); };
      if (dense_softmax) {  // probs = softmax(logits) at the selected experts
        double* l_E = s.l_E.data();
        load_row(l_E, logits_E, E);
        softmax(a_E, l_E, E);
        double dot = 0.0;
        for (int64_t i = 0; i < k; ++i) dot += a_E[sel_K[i]] * g_K[i];
        for (int64_t e = 0, i = 0; e < E; ++e) {
          const double g = i < k && sel_K[i] == e ? g_K[i++] : 0.0;
          add(e, a_E[e] * (g - dot));
        }
      } else if (spec.sinkhorn) {  // top-1: probs = sigmoid(logits), not renormalised
        for (int64_t i = 0; i < k; ++i) {
          const double sg = routing_scores::sigmoid(logit(sel_K[i]));
          add(sel_K[i], g_K[i] * sg * (1.0 - sg));
        }
      } else if (fn == RoutingScore::kSoftmax) {  // softmax over the selected logits
        for (int64_t i = 0; i < k; ++i) p_K[i] = logit(sel_K[i]);
        softmax(p_K, p_K, k);
        double dot = 0.0;
        for (int64_t i = 0; i < k; ++i) dot += p_K[i] * g_K[i];
        for (int64_t i = 0; i < k; ++i) add(sel_K[i], p_K[i] * (g_K[i] - dot));
      } else {  // sigmoid / sqrtsoftplus scores, normalised over the selected when k > 1
        double sum = 0.0, dot = 0.0;
        for (int64_t i = 0; i < k; ++i) sum += a_E[i] = routing_scores::pointwise(fn, logit(sel_K[i]));
        const double denom = sum + 1e-20;
        for (int64_t i = 0; i < k; ++i) dot += g_K[i] * a_E[i] / denom;
        for (int64_t i = 0; i < k; ++i) {
          const double ds = k > 1 ? (g_K[i] - dot) / denom : g_K[i];
          add(sel_K[i], ds * routing_scores::pointwise_grad(fn, logit(sel_K[i]), a_E[i]));
        }
      }
    }
  }
}

template <typename T>
void sinkhorn(T* out_TE, const T* logits_TE, const int64_t n, const int64_t E, const double tol) {
  std::vector<float> cost_TE(static_cast<size_t>(n * E));
  for (int64_t i = 0; i < n * E; ++i) cost_TE[static_cast<size_t>(i)] = std::exp(static_cast<float>(logits_TE[i]));
  std::vector<float> d0_T(static_cast<size_t>(n), 1.0f), d1_E(static_cast<size_t>(E), 1.0f);
  std::vector<float> d1_old_E = d1_E;
  const float eps = 1e-8f;
  // Megatron's loop has no iteration cap; this one stops after many iterations rather than spin forever.
  for (int iter = 0; iter < 100000; ++iter) {
    for (int64_t t = 0; t < n; ++t) {
      double row = 0.0;
      for (int64_t e = 0; e < E; ++e) row += static_cast<double>(d1_E[e] * cost_TE[t * E + e]);
      d0_T[t] = (1.0f / static_cast<float>(n)) * 1.0f / (static_cast<float>(row) + eps);
    }
    for (int64_t e = 0; e < E; ++e) {
      double col = 0.0;
      for (int64_t t = 0; t < n; ++t) col += static_cast<double>(d0_T[t] * cost_TE[t * E + e]);
      d1_E[e] = (1.0f / static_cast<float>(E)) * 1.0f / (static_cast<float>(col) + eps);
    }
    double error = 0.0;
    for (int64_t e = 0; e < E; ++e) error += std::abs(static_cast<double>(d1_old_E[e]) - d1_E[e]);
    error /= static_cast<double>(E);
    d1_old_E = d1_E;
    if (!(error > tol)) break;
  }
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t e = 0; e < E; ++e) out_TE[t * E + e] = static_cast<T>(d1_E[e] * cost_TE[t * E + e] * d0_T[t]);
  }
}

namespace {

// Megatron's capacity mask from the sparse selection: each expert's candidates (its selected tokens) bucketed by a
// counting sort that keeps token order, then ordered by key. Megatron's order over all n tokens: positive keys
// (descending, ties to the earlier token), then every zero-key token in token order, then negative keys.
template <typename T>
void capacity_mask(uint8_t* mask_TE, const int32_t* idx_TK, const T* probs_TK, const int64_t n, const int64_t E,
                   const int64_t k, const int64_t capacity, const RoutingDropPolicy policy) {
  if (capacity >= n) {  // Megatron: no dropping when the capacity exceeds the tokens (top-n of n is all of them)
    std::fill(mask_TE, mask_TE + n * E, uint8_t{1});
    return;
  }
  std::fill(mask_TE, mask_TE + n * E, uint8_t{0});
  const int64_t kept = std::max<int64_t>(capacity, 0);
  if (kept == 0) return;
  std::vector<int64_t> offsets_E1(static_cast<size_t>(E + 1), 0);
  for (int64_t i = 0; i < n * k; ++i) ++offsets_E1[static_cast<size_t>(idx_TK[i]) + 1];
  for (int64_t e = 0; e < E; ++e) offsets_E1[e + 1] += offsets_E1[e];
  struct Candidate {
    int64_t token;
    double key;
  };
  std::vector<Candidate> candidates(static_cast<size_t>(n * k));
  std::vector<int64_t> fill = offsets_E1;
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t i = 0; i < k; ++i) {
      const int64_t e = idx_TK[t * k + i];
      const double key = policy == RoutingDropPolicy::kProbs ? static_cast<double>(probs_TK[t * k + i]) : 1.0;
      candidates[static_cast<size_t>(fill[e]++)] = {t, key};
    }
  }
  std::vector<uint8_t> negative_T;
  for (int64_t e = 0; e < E; ++e) {
    const auto first = candidates.begin() + offsets_E1[e], last = candidates.begin() + offsets_E1[e + 1];
    const auto nonzero_end = std::stable_partition(first, last, [](const Candidate& c) { return c.key != 0.0; });
    std::stable_sort(first, nonzero_end, [](const Candidate& a, const Candidate& b) { return a.key > b.key; });
    int64_t taken = 0;
    auto it = first;
    for (; it != nonzero_end && it->key > 0.0 && taken < kept; ++it, ++taken) mask_TE[it->token * E + e] = 1;
    if (taken == kept) continue;
    const auto negatives = it;
    if (negatives != nonzero_end) {
      negative_T.assign(static_cast<size_t>(n), 0);
      for (auto m = negatives; m != nonzero_end; ++m) negative_T[static_cast<size_t>(m->token)] = 1;
    }
    for (int64_t t = 0; t < n && taken < kept; ++t) {
      if (mask_TE[t * E + e] || (negatives != nonzero_end && negative_T[static_cast<size_t>(t)])) continue;
      mask_TE[t * E + e] = 1;
      ++taken;
    }
    for (auto m = negatives; m != nonzero_end && taken < kept; ++m, ++taken) mask_TE[m->token * E + e] = 1;
  }
}

}  // namespace

template <typename T>
void routing_map(uint8_t* map_TE, T* probs_TE, int64_t* counts_E, const int32_t* idx_TK, const T* probs_TK,
                 const int64_t n, const int64_t E, const int64_t k, const int64_t capacity,
                 const RoutingDropPolicy policy, const bool pad) {
  std::fill(counts_E, counts_E + E, int64_t{0});
  if (capacity >= 0) {
    capacity_mask(map_TE, idx_TK, probs_TK, n, E, k, capacity, policy);
    if (!pad) {  // selected & mask: clear what was not selected
      std::vector<uint8_t> selected_E(static_cast<size_t>(E));
      for (int64_t t = 0; t < n; ++t) {
        std::fill(selected_E.begin(), selected_E.end(), uint8_t{0});
        for (int64_t i = 0; i < k; ++i) selected_E[static_cast<size_t>(idx_TK[t * k + i])] = 1;
        for (int64_t e = 0; e < E; ++e) map_TE[t * E + e] &= selected_E[static_cast<size_t>(e)];
      }
    }
    for (int64_t t = 0; t < n; ++t) {
      for (int64_t e = 0; e < E; ++e) counts_E[e] += map_TE[t * E + e];
    }
  } else {
#pragma omp parallel for schedule(static) if (n * E >= kParallelLogits)
    for (int64_t t = 0; t < n; ++t) {
      std::fill(map_TE + t * E, map_TE + (t + 1) * E, uint8_t{0});
      for (int64_t i = 0; i < k; ++i) map_TE[t * E + idx_TK[t * k + i]] = 1;
    }
    for (int64_t i = 0; i < n * k; ++i) ++counts_E[idx_TK[i]];
  }
  // The selected experts that stayed in the map carry their probability; everything else (dropped experts, padding
  // tokens) is 0.
#pragma omp parallel for schedule(static) if (n * E >= kParallelLogits)
  for (int64_t t = 0; t < n; ++t) {
    std::fill(probs_TE + t * E, probs_TE + (t + 1) * E, T(0));
    for (int64_t i = 0; i < k; ++i) {
      const int64_t e = idx_TK[t * k + i];
      if (map_TE[t * E + e]) probs_TE[t * E + e] = probs_TK[t * k + i];
    }
  }
}

template <typename T>
void aux_scores_forward(T* scores_TE, int32_t* idx_TK, const T* logits_TE, const int64_t n, const int64_t E,
                        const int64_t k, const RoutingScore score, const bool fp32_scores) {
#pragma omp parallel if (n * E >= kParallelLogits)
  {
    Scratch s(E, k);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < n; ++t) {
      load_row(s.l_E.data(), logits_TE + t * E, E);
      double* a_E = s.a_E.data();
      if (score == RoutingScore::kSoftmax) {
        softmax_scored(a_E, s.l_E.data(), E, fp32_scores);
      } else {
        for (int64_t e = 0; e < E; ++e) a_E[e] = routing_scores::pointwise_scored(score, s.l_E[e], fp32_scores);
        normalize(a_E, E, fp32_scores);
      }
      topk(s.idx_K.data(), a_E, E, k);
      store_row(scores_TE + t * E, a_E, E);
      for (int64_t i = 0; i < k; ++i) idx_TK[t * k + i] = static_cast<int32_t>(s.idx_K[static_cast<size_t>(i)]);
    }
  }
}

template <typename T>
void aux_scores_backward(T* dlogits_TE, const T* dscores_RE, const int64_t R, const T* scores_TE, const T* logits_TE,
                         const int64_t n, const int64_t E, const RoutingScore score) {
#pragma omp parallel if (n * E >= kParallelLogits)
  {
    std::vector<double> f_E(static_cast<size_t>(E));
#pragma omp for schedule(static)
    for (int64_t t = 0; t < n; ++t) {
      const T* ds_E = dscores_RE + (t % R) * E;
      const T* l_E = logits_TE + t * E;
      T* dl_E = dlogits_TE + t * E;
      double dot = 0.0;
      if (score == RoutingScore::kSoftmax) {  // through the forward's scores, as autograd's softmax backward
        const T* s_E = scores_TE + t * E;
        for (int64_t e = 0; e < E; ++e) dot += static_cast<double>(s_E[e]) * static_cast<double>(ds_E[e]);
        add_softmax_grad(dl_E, s_E, ds_E, dot, E);
        continue;
      }
      // s_e = f_e / (sum f + 1e-20): d/d f_e = (ds_e - sum_j ds_j s_j) / (sum f + 1e-20).
      double sum = 0.0;
      for (int64_t e = 0; e < E; ++e) sum += f_E[e] = routing_scores::pointwise(score, static_cast<double>(l_E[e]));
      const double denom = sum + 1e-20;
      for (int64_t e = 0; e < E; ++e) dot += f_E[e] / denom * static_cast<double>(ds_E[e]);
      for (int64_t e = 0; e < E; ++e) {
        const double grad = (static_cast<double>(ds_E[e]) - dot) / denom *
                            routing_scores::pointwise_grad(score, static_cast<double>(l_E[e]), f_E[e]);
        dl_E[e] = static_cast<T>(static_cast<double>(dl_E[e]) + grad);
      }
    }
  }
}

template <typename T>
void aux_loss_sums(T* sums_E, T* sums_BE, T* counts_BE, const T* scores_TE, const int32_t* idx_TK, const int64_t n,
                   const int64_t B, const int64_t E, const int64_t k) {
  std::fill(counts_BE, counts_BE + B * E, T(0));
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t i = 0; i < k; ++i) counts_BE[(t % B) * E + idx_TK[t * k + i]] += T(1);
  }
  // Each column accumulated in double in token order (the sums are the switch losses' values); blocks of columns in
  // parallel, each walking every token, so the sums do not depend on the threads.
  constexpr int64_t kColumns = 64;
  const int64_t blocks = (E + kColumns - 1) / kColumns;
#pragma omp parallel for schedule(static) if (n * E >= kParallelLogits && blocks > 1)
  for (int64_t block = 0; block < blocks; ++block) {
    const int64_t e0 = block * kColumns, w = std::min(E, e0 + kColumns) - e0;
    std::vector<double> all_E(static_cast<size_t>(w), 0.0), seq_BE(static_cast<size_t>(B * w), 0.0);
    for (int64_t t = 0; t < n; ++t) {
      const T* s_E = scores_TE + t * E + e0;
      double* seq_E = seq_BE.data() + (t % B) * w;
      add_to_columns(all_E.data(), seq_E, s_E, w);
    }
    for (int64_t e = 0; e < w; ++e) sums_E[e0 + e] = static_cast<T>(all_E[static_cast<size_t>(e)]);
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t e = 0; e < w; ++e) sums_BE[b * E + e0 + e] = static_cast<T>(seq_BE[static_cast<size_t>(b * w + e)]);
    }
  }
}

template <typename T>
double z_loss_forward(T* lse_T, const T* logits_TE, const int64_t n, const int64_t E) {
#pragma omp parallel if (n * E >= kParallelLogits)
  {
    std::vector<double> l_E(static_cast<size_t>(E));
#pragma omp for schedule(static)
    for (int64_t t = 0; t < n; ++t) {
      load_row(l_E.data(), logits_TE + t * E, E);
      lse_T[t] = static_cast<T>(logsumexp(l_E.data(), E));
    }
  }
  double sum = 0.0;
  for (int64_t t = 0; t < n; ++t) sum += static_cast<double>(lse_T[t]) * static_cast<double>(lse_T[t]);
  return sum;
}

template <typename T>
void z_loss_backward(T* dlogits_TE, const T* logits_TE, const T* lse_T, const int64_t n, const int64_t E,
                     const double scale) {
#pragma omp parallel if (n * E >= kParallelLogits)
  {
    std::vector<double> l_E(static_cast<size_t>(E)), p_E(static_cast<size_t>(E));
#pragma omp for schedule(static)
    for (int64_t t = 0; t < n; ++t) {
      load_row(l_E.data(), logits_TE + t * E, E);
      softmax(p_E.data(), l_E.data(), E);
      const double z_scale = scale * 2.0 * static_cast<double>(lse_T[t]) / static_cast<double>(n);
      for (int64_t e = 0; e < E; ++e) {
        dlogits_TE[t * E + e] = static_cast<T>(static_cast<double>(dlogits_TE[t * E + e]) + z_scale * p_E[e]);
      }
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

}  // namespace moecore::kernels::cpu
