#include "moecore/moe/load_balancing.h"

#include <cmath>

#include "moecore/moe/routing_math.h"

namespace moecore::load_balancing {

void aux_scores_row(double* scores_E, int64_t* idx_K, const double* logits_E, const int64_t E, const int64_t k,
                    const RouterScoreFunction fn) {
  if (fn == RouterScoreFunction::kSoftmax) {
    routing::softmax_fp32(scores_E, logits_E, E);
  } else {
    for (int64_t e = 0; e < E; ++e) scores_E[e] = routing::pointwise_score_fp32(fn, logits_E[e]);
    routing::normalize_fp32(scores_E, E);
  }
  routing::topk(idx_K, scores_E, E, k);
}

void aux_scores(double* scores_TE, uint8_t* map_TE, const double* logits_TE, const int64_t T, const int64_t E,
                const int64_t k, const RouterScoreFunction fn) {
  std::vector<int64_t> idx_K(static_cast<size_t>(k));
  for (int64_t t = 0; t < T; ++t) {
    aux_scores_row(scores_TE + t * E, idx_K.data(), logits_TE + t * E, E, k, fn);
    for (int64_t e = 0; e < E; ++e) map_TE[t * E + e] = 0;
    for (const int64_t e : idx_K) map_TE[t * E + e] = 1;
  }
}

void aux_scores_backward_row(double* dlogits_E, const double* dscores_E, const double* logits_E, const float* scores_E,
                             const int64_t E, const RouterScoreFunction fn, double* scratch_E) {
  double dot = 0.0;
  if (fn == RouterScoreFunction::kSoftmax) {
    for (int64_t e = 0; e < E; ++e) dot += static_cast<double>(scores_E[e]) * dscores_E[e];
    for (int64_t e = 0; e < E; ++e) dlogits_E[e] += static_cast<double>(scores_E[e]) * (dscores_E[e] - dot);
    return;
  }
  // s_e = f_e / (sum f + 1e-20): d/d f_e = (ds_e - sum_j ds_j s_j) / (sum f + 1e-20).
  double* f_E = scratch_E;
  double sum = 0.0;
  for (int64_t e = 0; e < E; ++e) sum += f_E[e] = routing::pointwise_score(fn, logits_E[e]);
  const double denom = sum + 1e-20;
  for (int64_t e = 0; e < E; ++e) dot += f_E[e] / denom * dscores_E[e];
  for (int64_t e = 0; e < E; ++e) {
    dlogits_E[e] += (dscores_E[e] - dot) / denom * routing::pointwise_score_grad(fn, logits_E[e], f_E[e]);
  }
}

void aux_scores_backward(double* dlogits_TE, const double* dscores_TE, const double* logits_TE, const int64_t T,
                         const int64_t E, const RouterScoreFunction fn) {
  std::vector<double> f_E(static_cast<size_t>(E)), s_E(static_cast<size_t>(E));
  for (int64_t t = 0; t < T; ++t) {
    const double* l_E = logits_TE + t * E;
    const double* ds_E = dscores_TE + t * E;
    double sum = 0.0;
    if (fn == RouterScoreFunction::kSoftmax) {
      routing::softmax(s_E.data(), l_E, E);
    } else {
      for (int64_t e = 0; e < E; ++e) sum += f_E[e] = routing::pointwise_score(fn, l_E[e]);
      for (int64_t e = 0; e < E; ++e) s_E[e] = f_E[e] / (sum + 1e-20);
    }
    double dot = 0.0;
    for (int64_t e = 0; e < E; ++e) dot += s_E[e] * ds_E[e];
    if (fn == RouterScoreFunction::kSoftmax) {
      for (int64_t e = 0; e < E; ++e) dlogits_TE[t * E + e] += s_E[e] * (ds_E[e] - dot);
      continue;
    }
    // s_e = f_e / (sum f + 1e-20): d/d f_e = (ds_e - sum_j ds_j s_j) / (sum f + 1e-20).
    for (int64_t e = 0; e < E; ++e) {
      const double df = (ds_E[e] - dot) / (sum + 1e-20);
      dlogits_TE[t * E + e] += df * routing::pointwise_score_grad(fn, l_E[e], f_E[e]);
    }
  }
}

double switch_loss(const double* scores_TE, const double* tokens_per_expert_E, const int64_t T, const int64_t E,
                   const double total_tokens, const int64_t k, const int64_t num_experts, const double coeff,
                   double* dscores_TE) {
  const double factor =
      static_cast<double>(num_experts) * coeff / (static_cast<double>(k) * total_tokens * total_tokens);
  double loss = 0.0;
  for (int64_t e = 0; e < E; ++e) {
    double column = 0.0;
    for (int64_t t = 0; t < T; ++t) column += scores_TE[t * E + e];
    loss += column * tokens_per_expert_E[e];
  }
  if (dscores_TE != nullptr) {
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t e = 0; e < E; ++e) dscores_TE[t * E + e] += factor * tokens_per_expert_E[e];
    }
  }
  return loss * factor;
}

double switch_loss_from_sums(const double* score_sums_J, const double* counts_J, const int64_t J,
                             const double total_tokens, const int64_t k, const int64_t num_experts, const double coeff,
                             double* dscores_J) {
  const double factor =
      static_cast<double>(num_experts) * coeff / (static_cast<double>(k) * total_tokens * total_tokens);
  double loss = 0.0;
  for (int64_t j = 0; j < J; ++j) loss += score_sums_J[j] * counts_J[j];
  if (dscores_J != nullptr) {
    for (int64_t j = 0; j < J; ++j) dscores_J[j] += factor * counts_J[j];
  }
  return loss * factor;
}

double aux_loss(const double* scores_TE, const uint8_t* map_TE, const int64_t T, const int64_t E, const int64_t k,
                const double coeff, double* dscores_TE, const CountReduction& reduce, const int64_t ranks) {
  std::vector<double> counts_E(static_cast<size_t>(E), 0.0);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t e = 0; e < E; ++e) counts_E[e] += map_TE[t * E + e];
  }
  if (reduce) reduce(counts_E);
  return switch_loss(scores_TE, counts_E.data(), T, E, static_cast<double>(T * ranks), k, E, coeff, dscores_TE);
}

double seq_aux_loss(const double* scores_TE, const uint8_t* map_TE, const int64_t S, const int64_t B, const int64_t E,
                    const int64_t k, const double coeff, double* dscores_TE, const CountReduction& reduce,
                    const int64_t ranks) {
  // Megatron views [S*B, E] as [S, B*E]: "experts" are (sequence, expert) pairs, T = S, then divides by B.
  const int64_t BE = B * E;
  std::vector<double> counts_BE(static_cast<size_t>(BE), 0.0);
  for (int64_t s = 0; s < S; ++s) {
    for (int64_t j = 0; j < BE; ++j) counts_BE[j] += map_TE[s * BE + j];
  }
  if (reduce) reduce(counts_BE);
  const double scaled_coeff = coeff / static_cast<double>(B);
  return switch_loss(scores_TE, counts_BE.data(), S, BE, static_cast<double>(S * ranks), k, E, scaled_coeff,
                     dscores_TE);
}

double z_loss(const double* logits_TE, const int64_t T, const int64_t E, const double coeff, const double grad_scale,
              double* dlogits_TE) {
  double sum = 0.0;
  std::vector<double> p_E(static_cast<size_t>(E));
  for (int64_t t = 0; t < T; ++t) {
    const double lse = routing::logsumexp(logits_TE + t * E, E);
    sum += lse * lse;
    if (dlogits_TE == nullptr) continue;
    routing::softmax(p_E.data(), logits_TE + t * E, E);
    const double scale = grad_scale * coeff * 2.0 * lse / static_cast<double>(T);
    for (int64_t e = 0; e < E; ++e) dlogits_TE[t * E + e] += scale * p_E[e];
  }
  return coeff * sum / static_cast<double>(T);
}

void update_expert_bias(const std::span<float> expert_bias_E, const std::vector<double>& tokens_per_expert_E,
                        const double update_rate) {
  const size_t E = tokens_per_expert_E.size();
  if (E == 0) return;
  double total = 0.0;
  for (const double c : tokens_per_expert_E) total += c;
  const float mean = static_cast<float>(total) / static_cast<float>(E);
  const float rate = static_cast<float>(update_rate);
  for (size_t e = 0; e < E; ++e) {
    const float offset = mean - static_cast<float>(tokens_per_expert_E[e]);
    const float sign = offset > 0 ? 1.0f : (offset < 0 ? -1.0f : 0.0f);
    expert_bias_E[e] = expert_bias_E[e] + sign * rate;
  }
}

}  // namespace moecore::load_balancing
