// Load-balancing losses and routing math against naive references, hand-computed values and float64 finite
// differences (Megatron's moe_utils.py formulas).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <set>
#include <vector>

#include "moecore/moe/load_balancing.h"
#include "moecore/moe/routing_math.h"

namespace moecore {
namespace {

std::vector<double> random_values(const int64_t n, const uint32_t seed, const double scale = 1.0) {
  std::mt19937 gen(seed);
  std::normal_distribution<double> dist(0.0, scale);
  std::vector<double> v(static_cast<size_t>(n));
  for (double& x : v) x = dist(gen);
  return v;
}

std::vector<uint8_t> random_topk_map(const int64_t T, const int64_t E, const int64_t k, const uint32_t seed) {
  const std::vector<double> values = random_values(T * E, seed);
  std::vector<uint8_t> map(static_cast<size_t>(T * E), 0);
  std::vector<int64_t> idx(static_cast<size_t>(k));
  for (int64_t t = 0; t < T; ++t) {
    routing::topk(idx.data(), values.data() + t * E, E, k);
    for (const int64_t e : idx) map[t * E + e] = 1;
  }
  return map;
}

// Naive aux loss: coeff * E * sum_e f_e P_e with f_e = c_e / (k T), P_e = mean_t S_te.
double naive_aux(const std::vector<double>& scores, const std::vector<uint8_t>& map, const int64_t T, const int64_t E,
                 const int64_t k, const double coeff) {
  double loss = 0.0;
  for (int64_t e = 0; e < E; ++e) {
    double f = 0.0, P = 0.0;
    for (int64_t t = 0; t < T; ++t) {
      f += map[t * E + e];
      P += scores[t * E + e];
    }
    loss += (f / static_cast<double>(k * T)) * (P / static_cast<double>(T));
  }
  return coeff * static_cast<double>(E) * loss;
}

TEST(LoadBalancing, UniformScoresGiveExactlyTheCoefficient) {
  const int64_t T = 16, E = 8, k = 2;
  const std::vector<double> scores(static_cast<size_t>(T * E), 1.0 / E);
  // Any routing map with k experts per token: f sums to 1 and P_e = 1/E, so the loss is coeff.
  const std::vector<uint8_t> map = random_topk_map(T, E, k, 7);
  EXPECT_DOUBLE_EQ(load_balancing::aux_loss(scores.data(), map.data(), T, E, k, 0.01, nullptr), 0.01);
}

TEST(LoadBalancing, AuxLossMatchesNaiveFormula) {
  const int64_t T = 12, E = 6, k = 2;
  std::vector<double> scores = random_values(T * E, 3);
  for (double& s : scores) s = std::abs(s);
  const std::vector<uint8_t> map = random_topk_map(T, E, k, 4);
  EXPECT_NEAR(load_balancing::aux_loss(scores.data(), map.data(), T, E, k, 0.3, nullptr),
              naive_aux(scores, map, T, E, k, 0.3), 1e-14);
}

TEST(LoadBalancing, SeqAuxIsTheMeanOfPerSequenceAuxLosses) {
  const int64_t S = 5, B = 3, E = 4, k = 2, T = S * B;
  std::vector<double> scores = random_values(T * E, 11);
  for (double& s : scores) s = std::abs(s);
  const std::vector<uint8_t> map = random_topk_map(T, E, k, 12);
  double expected = 0.0;
  for (int64_t b = 0; b < B; ++b) {  // tokens of sequence b: t = s * B + b
    std::vector<double> seq_scores;
    std::vector<uint8_t> seq_map;
    for (int64_t s = 0; s < S; ++s) {
      for (int64_t e = 0; e < E; ++e) {
        seq_scores.push_back(scores[(s * B + b) * E + e]);
        seq_map.push_back(map[(s * B + b) * E + e]);
      }
    }
    expected += naive_aux(seq_scores, seq_map, S, E, k, 0.2) / B;
  }
  EXPECT_NEAR(load_balancing::seq_aux_loss(scores.data(), map.data(), S, B, E, k, 0.2, nullptr), expected, 1e-14);
  // With one sequence, seq_aux_loss == aux_loss.
  EXPECT_NEAR(load_balancing::seq_aux_loss(scores.data(), map.data(), T, 1, E, k, 0.2, nullptr),
              load_balancing::aux_loss(scores.data(), map.data(), T, E, k, 0.2, nullptr), 1e-14);
}

TEST(LoadBalancing, LossGradientsMatchFiniteDifferences) {
  const int64_t S = 4, B = 2, E = 5, k = 2, T = S * B;
  const std::vector<uint8_t> map = random_topk_map(T, E, k, 21);
  std::vector<double> scores = random_values(T * E, 22);
  std::vector<double> d_aux(static_cast<size_t>(T * E), 0.0), d_seq(static_cast<size_t>(T * E), 0.0);
  load_balancing::aux_loss(scores.data(), map.data(), T, E, k, 0.7, d_aux.data());
  load_balancing::seq_aux_loss(scores.data(), map.data(), S, B, E, k, 0.7, d_seq.data());
  const double h = 1e-6;
  for (int64_t i = 0; i < T * E; ++i) {
    const double saved = scores[i];
    scores[i] = saved + h;
    const double aux_plus = load_balancing::aux_loss(scores.data(), map.data(), T, E, k, 0.7, nullptr);
    const double seq_plus = load_balancing::seq_aux_loss(scores.data(), map.data(), S, B, E, k, 0.7, nullptr);
    scores[i] = saved - h;
    const double aux_minus = load_balancing::aux_loss(scores.data(), map.data(), T, E, k, 0.7, nullptr);
    const double seq_minus = load_balancing::seq_aux_loss(scores.data(), map.data(), S, B, E, k, 0.7, nullptr);
    scores[i] = saved;
    EXPECT_NEAR(d_aux[i], (aux_plus - aux_minus) / (2 * h), 1e-8);
    EXPECT_NEAR(d_seq[i], (seq_plus - seq_minus) / (2 * h), 1e-8);
  }
}

TEST(LoadBalancing, AuxScoresAndTheirBackward) {
  const int64_t T = 3, E = 6, k = 2;
  for (const RouterScoreFunction fn :
       {RouterScoreFunction::kSoftmax, RouterScoreFunction::kSigmoid, RouterScoreFunction::kSqrtSoftplus}) {
    std::vector<double> logits = random_values(T * E, 31, 1.5);
    const std::vector<double> weights = random_values(T * E, 32);
    std::vector<double> scores(static_cast<size_t>(T * E));
    std::vector<uint8_t> map(static_cast<size_t>(T * E));
    load_balancing::aux_scores(scores.data(), map.data(), logits.data(), T, E, k, fn);
    for (int64_t t = 0; t < T; ++t) {
      double sum = 0.0, kth = 1e300, best_unselected = -1e300;
      int selected = 0;
      for (int64_t e = 0; e < E; ++e) {
        const double s = scores[t * E + e];
        const double raw = fn == RouterScoreFunction::kSoftmax   ? std::exp(logits[t * E + e])
                           : fn == RouterScoreFunction::kSigmoid ? 1.0 / (1.0 + std::exp(-logits[t * E + e]))
                                                                 : std::sqrt(std::log1p(std::exp(logits[t * E + e])));
        double raw_sum = 0.0;
        for (int64_t j = 0; j < E; ++j) {
          const double l = logits[t * E + j];
          raw_sum += fn == RouterScoreFunction::kSoftmax   ? std::exp(l)
                     : fn == RouterScoreFunction::kSigmoid ? 1.0 / (1.0 + std::exp(-l))
                                                           : std::sqrt(std::log1p(std::exp(l)));
        }
        // fp32 scores whatever the logits' precision (Megatron's compute_routing_scores_for_aux_loss)
        EXPECT_EQ(s, static_cast<double>(static_cast<float>(s)));
        EXPECT_NEAR(s, raw / raw_sum, 1e-7);
        sum += s;
        if (map[t * E + e]) {
          ++selected;
          kth = std::min(kth, s);
        } else {
          best_unselected = std::max(best_unselected, s);
        }
      }
      EXPECT_NEAR(sum, 1.0, 1e-6);
      EXPECT_EQ(selected, k);
      EXPECT_GT(kth, best_unselected);
    }
    std::vector<double> dlogits(static_cast<size_t>(T * E), 0.0);
    load_balancing::aux_scores_backward(dlogits.data(), weights.data(), logits.data(), T, E, fn);
    // The backward differentiates the exact scores (the fp32 ones are too coarse for finite differences).
    auto objective = [&](const std::vector<double>& l) {
      double f = 0.0;
      for (int64_t t = 0; t < T; ++t) {
        std::vector<double> raw(static_cast<size_t>(E));
        double raw_sum = 0.0;
        for (int64_t e = 0; e < E; ++e) {
          const double v = l[t * E + e];
          raw_sum += raw[e] = fn == RouterScoreFunction::kSoftmax   ? std::exp(v)
                              : fn == RouterScoreFunction::kSigmoid ? 1.0 / (1.0 + std::exp(-v))
                                                                    : std::sqrt(std::log1p(std::exp(v)));
        }
        for (int64_t e = 0; e < E; ++e) f += weights[t * E + e] * raw[e] / raw_sum;
      }
      return f;
    };
    const double h = 1e-6;
    for (int64_t i = 0; i < T * E; ++i) {
      const double saved = logits[i];
      logits[i] = saved + h;
      const double plus = objective(logits);
      logits[i] = saved - h;
      const double minus = objective(logits);
      logits[i] = saved;
      EXPECT_NEAR(dlogits[i], (plus - minus) / (2 * h), 1e-8);
    }
  }
}

TEST(LoadBalancing, ZLossValueAndGradient) {
  const int64_t T = 4, E = 5;
  std::vector<double> logits = random_values(T * E, 41, 2.0);
  double expected = 0.0;
  for (int64_t t = 0; t < T; ++t) {
    double sum = 0.0;
    for (int64_t e = 0; e < E; ++e) sum += std::exp(logits[t * E + e]);
    expected += std::log(sum) * std::log(sum) / T;
  }
  std::vector<double> dlogits(static_cast<size_t>(T * E), 0.0);
  EXPECT_NEAR(load_balancing::z_loss(logits.data(), T, E, 0.3, 0.5, dlogits.data()), 0.3 * expected, 1e-13);
  const double h = 1e-6;
  for (int64_t i = 0; i < T * E; ++i) {
    const double saved = logits[i];
    logits[i] = saved + h;
    const double plus = load_balancing::z_loss(logits.data(), T, E, 0.3, 0.0, nullptr);
    logits[i] = saved - h;
    const double minus = load_balancing::z_loss(logits.data(), T, E, 0.3, 0.0, nullptr);
    logits[i] = saved;
    EXPECT_NEAR(dlogits[i], 0.5 * (plus - minus) / (2 * h), 1e-8);  // grad_scale 0.5
  }
}

TEST(LoadBalancing, ExpertBiasSignRuleByHand) {
  std::vector<float> bias = {0.5f, -0.25f, 0.0f, 1.0f};
  // mean = 2: expert 0 is over-loaded (bias down), expert 1 under-loaded (up), 2 and 3 balanced (unchanged).
  load_balancing::update_expert_bias(bias, {3.0, 1.0, 2.0, 2.0}, 0.125);
  EXPECT_EQ(bias, (std::vector<float>{0.375f, -0.125f, 0.0f, 1.0f}));
}

TEST(RoutingMath, TopkTiesGoToTheLowerIndex) {
  const std::vector<double> values = {1.0, 3.0, 2.0, 3.0, 2.0};
  std::vector<int64_t> idx(3);
  routing::topk(idx.data(), values.data(), 5, 3);
  EXPECT_EQ(idx, (std::vector<int64_t>{1, 3, 2}));
}

TEST(RoutingMath, GroupLimitedTopkByHand) {
  // 4 groups of 2; k = 2, group_topk = 2: group score = its best value (top-1 of each group).
  // Group scores: g0 = 0.9, g1 = 0.8, g2 = 0.85, g3 = 0.1 -> groups 0 and 2 -> experts 0 (0.9) and 4 (0.85),
  // although expert 2 (0.8) beats expert 5 (0.7) and 1 (0.05).
  const std::vector<double> values = {0.9, 0.05, 0.8, 0.79, 0.85, 0.7, 0.1, 0.0};
  std::vector<int64_t> idx(2);
  routing::group_limited_topk(idx.data(), values.data(), 8, 2, 4, 2);
  EXPECT_EQ(std::set<int64_t>(idx.begin(), idx.end()), (std::set<int64_t>{0, 4}));
  // k = 4, group_topk = 2: group score = sum of its top-2: g0 = 0.95, g1 = 1.59, g2 = 1.55, g3 = 0.1.
  std::vector<int64_t> idx4(4);
  routing::group_limited_topk(idx4.data(), values.data(), 8, 4, 4, 2);
  EXPECT_EQ(std::set<int64_t>(idx4.begin(), idx4.end()), (std::set<int64_t>{2, 3, 4, 5}));
}

TEST(RoutingMath, SoftplusFollowsTorchThreshold) {
  EXPECT_DOUBLE_EQ(routing::softplus(25.0), 25.0);
  EXPECT_DOUBLE_EQ(routing::softplus_grad(25.0), 1.0);
  EXPECT_NEAR(routing::softplus(0.0), std::log(2.0), 1e-15);
  EXPECT_NEAR(routing::pointwise_score(RouterScoreFunction::kSqrtSoftplus, 0.0), std::sqrt(std::log(2.0)), 1e-15);
}

TEST(RoutingMath, SinkhornBalancesColumnsAndRows) {
  const int64_t T = 16, E = 4;
  const std::vector<double> logits = random_values(T * E, 51);
  const std::vector<float> balanced = routing::sinkhorn(logits.data(), T, E);
  for (int64_t e = 0; e < E; ++e) {
    double col = 0.0;
    for (int64_t t = 0; t < T; ++t) col += balanced[t * E + e];
    EXPECT_NEAR(col, 1.0 / E, 1e-5);
  }
  for (int64_t t = 0; t < T; ++t) {
    double row = 0.0;
    for (int64_t e = 0; e < E; ++e) row += balanced[t * E + e];
    EXPECT_NEAR(row, 1.0 / T, 1e-3);
  }
}

TEST(RoutingMath, CapacityFormula) {
  EXPECT_EQ(routing::expert_capacity(10, 2, 4, 1.0), 5);
  EXPECT_EQ(routing::expert_capacity(10, 2, 4, 1.1), 6);  // ceil(5.5)
  EXPECT_EQ(routing::expert_capacity(16, 2, 8, 0.5), 2);
}

// Megatron's capacity mask (apply_router_token_dropping): the top-C of each column over ALL tokens, by prob or by
// "selected first"; ties to the earlier token; everything when C >= T.
TEST(RoutingMath, CapacityMaskPolicies) {
  // One expert column (E = 1), 5 tokens, tokens 0, 1, 3, 4 selected (token 2 not: prob 0).
  const std::vector<uint8_t> selected = {1, 1, 0, 1, 1};
  const std::vector<double> probs = {0.2, 0.5, 0.0, 0.9, 0.5};
  std::vector<uint8_t> mask(5);
  routing::capacity_mask(mask.data(), selected.data(), probs.data(), 5, 1, 2, TokenDropPolicy::kProbs);
  EXPECT_EQ(mask, (std::vector<uint8_t>{0, 1, 0, 1, 0}));  // 0.9, then the earlier of the tied 0.5s
  routing::capacity_mask(mask.data(), selected.data(), probs.data(), 5, 1, 2, TokenDropPolicy::kPosition);
  EXPECT_EQ(mask, (std::vector<uint8_t>{1, 1, 0, 0, 0}));
  routing::capacity_mask(mask.data(), selected.data(), probs.data(), 5, 1, 5, TokenDropPolicy::kProbs);
  EXPECT_EQ(mask, (std::vector<uint8_t>{1, 1, 1, 1, 1}));
  // Fewer selected tokens than C: the mask (the padded routing map) takes the earliest unselected ones.
  const std::vector<uint8_t> few = {0, 1, 0, 0, 1};
  const std::vector<double> few_probs = {0.0, 0.3, 0.0, 0.0, 0.6};
  routing::capacity_mask(mask.data(), few.data(), few_probs.data(), 5, 1, 3, TokenDropPolicy::kProbs);
  EXPECT_EQ(mask, (std::vector<uint8_t>{1, 1, 0, 0, 1}));
  routing::capacity_mask(mask.data(), few.data(), few_probs.data(), 5, 1, 4, TokenDropPolicy::kPosition);
  EXPECT_EQ(mask, (std::vector<uint8_t>{1, 1, 1, 0, 1}));
}

}  // namespace
}  // namespace moecore
