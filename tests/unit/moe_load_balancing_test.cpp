// Load-balancing losses and routing math against naive references, hand-computed values and float64 finite
// differences (Megatron's moe_utils.py formulas).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
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

// The sparse selection of a dense map with exactly k ones per row, in expert order, and its probs.
struct SparseSelection {
  std::vector<int32_t> selected_TK;
  std::vector<double> probs_TK;
};
SparseSelection sparse_of(const std::vector<uint8_t>& selected_TE, const std::vector<double>& probs_TE, const int64_t T,
                          const int64_t E, const int64_t k) {
  SparseSelection s;
  for (int64_t t = 0; t < T; ++t) {
    int64_t n = 0;
    for (int64_t e = 0; e < E; ++e) {
      if (!selected_TE[t * E + e]) continue;
      s.selected_TK.push_back(static_cast<int32_t>(e));
      s.probs_TK.push_back(probs_TE[t * E + e]);
      ++n;
    }
    EXPECT_EQ(n, k) << "row " << t;
  }
  return s;
}

// Megatron's capacity mask (apply_router_token_dropping): the top-C of each column over ALL tokens, by prob or by
// "selected first"; ties to the earlier token; everything when C >= T. Column 0 holds the example; column 1 takes
// the tokens column 0 did not select (top-1 routing over two experts). Checked on the reference (dense) and the
// sparse mask.
TEST(RoutingMath, CapacityMaskPolicies) {
  auto column0 = [](const std::vector<uint8_t>& sel0, const std::vector<double>& probs0, const int64_t capacity,
                    const TokenDropPolicy policy) {
    const int64_t T = static_cast<int64_t>(sel0.size()), E = 2;
    std::vector<uint8_t> selected(static_cast<size_t>(T * E));
    std::vector<double> probs(static_cast<size_t>(T * E), 0.0);
    for (int64_t t = 0; t < T; ++t) {
      selected[t * E] = sel0[t];
      selected[t * E + 1] = !sel0[t];
      probs[t * E] = probs0[t];
      probs[t * E + 1] = sel0[t] ? 0.0 : 0.25;
    }
    std::vector<uint8_t> ref_mask(static_cast<size_t>(T * E)), mask(static_cast<size_t>(T * E));
    routing::ref::capacity_mask(ref_mask.data(), selected.data(), probs.data(), T, E, capacity, policy);
    const SparseSelection sparse = sparse_of(selected, probs, T, E, 1);
    routing::capacity_mask(mask.data(), sparse.selected_TK.data(), sparse.probs_TK.data(), T, E, 1, capacity, policy);
    EXPECT_EQ(mask, ref_mask);
    std::vector<uint8_t> out;
    for (int64_t t = 0; t < T; ++t) out.push_back(mask[t * E]);
    return out;
  };
  // 5 tokens, tokens 0, 1, 3, 4 selected (token 2 not: prob 0).
  const std::vector<uint8_t> selected = {1, 1, 0, 1, 1};
  const std::vector<double> probs = {0.2, 0.5, 0.0, 0.9, 0.5};
  // 0.9, then the earlier of the tied 0.5s
  EXPECT_EQ(column0(selected, probs, 2, TokenDropPolicy::kProbs), (std::vector<uint8_t>{0, 1, 0, 1, 0}));
  EXPECT_EQ(column0(selected, probs, 2, TokenDropPolicy::kPosition), (std::vector<uint8_t>{1, 1, 0, 0, 0}));
  EXPECT_EQ(column0(selected, probs, 5, TokenDropPolicy::kProbs), (std::vector<uint8_t>{1, 1, 1, 1, 1}));
  // Fewer selected tokens than C: the mask (the padded routing map) takes the earliest unselected ones.
  const std::vector<uint8_t> few = {0, 1, 0, 0, 1};
  const std::vector<double> few_probs = {0.0, 0.3, 0.0, 0.0, 0.6};
  EXPECT_EQ(column0(few, few_probs, 3, TokenDropPolicy::kProbs), (std::vector<uint8_t>{1, 1, 0, 0, 1}));
  EXPECT_EQ(column0(few, few_probs, 4, TokenDropPolicy::kPosition), (std::vector<uint8_t>{1, 1, 1, 0, 1}));
  // A selected token with probability 0 ranks with the unselected ones (token order); a negative one after them.
  const std::vector<uint8_t> zeros = {1, 0, 1, 1, 0};
  const std::vector<double> zero_probs = {-0.5, 0.0, 0.0, 0.4, 0.0};
  EXPECT_EQ(column0(zeros, zero_probs, 3, TokenDropPolicy::kProbs), (std::vector<uint8_t>{0, 1, 1, 1, 0}));
  EXPECT_EQ(column0(zeros, zero_probs, 5, TokenDropPolicy::kProbs), (std::vector<uint8_t>{1, 1, 1, 1, 1}));
  EXPECT_EQ(column0(zeros, zero_probs, 4, TokenDropPolicy::kProbs), (std::vector<uint8_t>{0, 1, 1, 1, 1}));
}

// Values with many exact ties (a few levels) and some -inf entries: the one-pass top-k must pick exactly what the
// reference's full sort picks, in the same order.
std::vector<double> tied_values(const int64_t n, const uint32_t seed, const int levels) {
  std::mt19937 gen(seed);
  std::uniform_int_distribution<int> level(0, levels);
  std::vector<double> v(static_cast<size_t>(n));
  for (double& x : v) {
    const int l = level(gen);
    x = l == 0 ? -std::numeric_limits<double>::infinity() : 0.125 * l;
  }
  return v;
}

TEST(RoutingMath, OnePassTopkEqualsTheFullSortOnRandomData) {
  for (const int64_t E : {1, 2, 7, 64, 257}) {
    for (const int64_t k : {int64_t{1}, int64_t{2}, int64_t{3}, int64_t{8}, int64_t{16}, int64_t{20}}) {
      if (k > E) continue;
      for (uint32_t seed = 0; seed < 20; ++seed) {
        const std::vector<double> v =
            seed % 2 == 0 ? random_values(E, seed + 100) : tied_values(E, seed + 100, 1 + static_cast<int>(seed % 5));
        std::vector<int64_t> want(static_cast<size_t>(k)), got(static_cast<size_t>(k));
        routing::ref::topk(want.data(), v.data(), E, k);
        routing::topk(got.data(), v.data(), E, k);
        ASSERT_EQ(got, want) << "E " << E << " k " << k << " seed " << seed;
      }
    }
  }
}

TEST(RoutingMath, GroupLimitedTopkEqualsTheReferenceOnRandomData) {
  struct Case {
    int64_t E, k, groups, group_topk;
  };
  for (const Case c : {Case{8, 2, 4, 2}, Case{8, 3, 4, 2}, Case{64, 4, 8, 2}, Case{256, 8, 8, 4}, Case{128, 6, 64, 3},
                       Case{160, 4, 80, 4}}) {
    for (uint32_t seed = 0; seed < 20; ++seed) {
      const std::vector<double> v =
          seed % 2 == 0 ? random_values(c.E, seed + 200) : tied_values(c.E, seed + 200, 2 + static_cast<int>(seed % 4));
      std::vector<int64_t> want(static_cast<size_t>(c.k)), got(static_cast<size_t>(c.k));
      routing::ref::group_limited_topk(want.data(), v.data(), c.E, c.k, c.groups, c.group_topk);
      routing::group_limited_topk(got.data(), v.data(), c.E, c.k, c.groups, c.group_topk);
      ASSERT_EQ(got, want) << "E " << c.E << " groups " << c.groups << " seed " << seed;
    }
  }
}

TEST(RoutingMath, SparseCapacityMaskEqualsTheReferenceOnRandomData) {
  for (const int64_t E : {1, 4, 16}) {
    for (const int64_t k : {int64_t{1}, int64_t{2}, int64_t{4}}) {
      if (k > E) continue;
      const int64_t T = 37;
      for (uint32_t seed = 0; seed < 12; ++seed) {
        // Random top-k rows; probs with ties, zeros and (rarely) negatives.
        std::mt19937 gen(seed + 300);
        std::vector<uint8_t> selected(static_cast<size_t>(T * E), 0);
        std::vector<double> probs(static_cast<size_t>(T * E), 0.0);
        std::vector<int64_t> order(static_cast<size_t>(E));
        std::uniform_int_distribution<int> level(-1, 6);
        for (int64_t t = 0; t < T; ++t) {
          std::iota(order.begin(), order.end(), int64_t{0});
          std::shuffle(order.begin(), order.end(), gen);
          for (int64_t i = 0; i < k; ++i) {
            selected[t * E + order[i]] = 1;
            probs[t * E + order[i]] = 0.125 * level(gen);
          }
        }
        const SparseSelection sparse = sparse_of(selected, probs, T, E, k);
        for (const TokenDropPolicy policy : {TokenDropPolicy::kProbs, TokenDropPolicy::kPosition}) {
          for (const int64_t capacity : {int64_t{-1}, int64_t{0}, int64_t{1}, int64_t{3}, T * k / E, T - 1, T, T + 5}) {
            std::vector<uint8_t> want(static_cast<size_t>(T * E)), got(static_cast<size_t>(T * E), 7);
            routing::ref::capacity_mask(want.data(), selected.data(), probs.data(), T, E, capacity, policy);
            routing::capacity_mask(got.data(), sparse.selected_TK.data(), sparse.probs_TK.data(), T, E, k, capacity,
                                   policy);
            ASSERT_EQ(got, want) << "E " << E << " k " << k << " seed " << seed << " capacity " << capacity;
          }
        }
      }
    }
  }
}

// The router's row / column-sum form of the aux losses against the dense form: scores and top-k per row, the loss
// from column sums, and the per-column gradient, for aux_loss (columns = experts) and seq_aux_loss (columns =
// (sequence, expert) pairs).
TEST(LoadBalancing, ColumnSumFormEqualsTheDenseForm) {
  const int64_t S = 7, B = 3, T = S * B, E = 12, k = 3;
  for (const RouterScoreFunction fn :
       {RouterScoreFunction::kSoftmax, RouterScoreFunction::kSigmoid, RouterScoreFunction::kSqrtSoftplus}) {
    const std::vector<double> logits = random_values(T * E, 61, 1.5);
    std::vector<double> scores(static_cast<size_t>(T * E)), row_scores(static_cast<size_t>(T * E));
    std::vector<uint8_t> map(static_cast<size_t>(T * E)), row_map(static_cast<size_t>(T * E), 0);
    load_balancing::aux_scores(scores.data(), map.data(), logits.data(), T, E, k, fn);
    std::vector<int64_t> idx(static_cast<size_t>(k));
    for (int64_t t = 0; t < T; ++t) {
      load_balancing::aux_scores_row(row_scores.data() + t * E, idx.data(), logits.data() + t * E, E, k, fn);
      for (const int64_t e : idx) row_map[t * E + e] = 1;
    }
    ASSERT_EQ(row_scores, scores);
    ASSERT_EQ(row_map, map);

    std::vector<double> sums_E(static_cast<size_t>(E), 0.0), counts_E(static_cast<size_t>(E), 0.0);
    std::vector<double> sums_BE(static_cast<size_t>(B * E), 0.0), counts_BE(static_cast<size_t>(B * E), 0.0);
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t e = 0; e < E; ++e) {
        sums_E[e] += scores[t * E + e];
        counts_E[e] += map[t * E + e];
        sums_BE[(t % B) * E + e] += scores[t * E + e];
        counts_BE[(t % B) * E + e] += map[t * E + e];
      }
    }
    std::vector<double> d_dense(static_cast<size_t>(T * E), 0.0), d_E(static_cast<size_t>(E), 0.0);
    const double aux = load_balancing::aux_loss(scores.data(), map.data(), T, E, k, 0.3, d_dense.data());
    EXPECT_NEAR(load_balancing::switch_loss_from_sums(sums_E.data(), counts_E.data(), E, T, k, E, 0.3, d_E.data()), aux,
                1e-15 * aux);
    for (int64_t i = 0; i < T * E; ++i) ASSERT_EQ(d_dense[i], d_E[i % E]) << i;

    std::vector<double> d_seq(static_cast<size_t>(T * E), 0.0), d_BE(static_cast<size_t>(B * E), 0.0);
    const double seq = load_balancing::seq_aux_loss(scores.data(), map.data(), S, B, E, k, 0.3, d_seq.data());
    EXPECT_NEAR(
        load_balancing::switch_loss_from_sums(sums_BE.data(), counts_BE.data(), B * E, S, k, E, 0.3 / B, d_BE.data()),
        seq, 1e-15 * seq);
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t e = 0; e < E; ++e) ASSERT_EQ(d_seq[t * E + e], d_BE[(t % B) * E + e]) << t << "," << e;
    }

    // Backward per row (softmax through the fp32 scores) against the dense backward on exact scores.
    const std::vector<double> dscores = random_values(T * E, 62);
    std::vector<double> want(static_cast<size_t>(T * E), 0.5), got(static_cast<size_t>(T * E), 0.5);
    load_balancing::aux_scores_backward(want.data(), dscores.data(), logits.data(), T, E, fn);
    std::vector<float> scores_f(scores.begin(), scores.end());
    std::vector<double> scratch(static_cast<size_t>(E));
    for (int64_t t = 0; t < T; ++t) {
      load_balancing::aux_scores_backward_row(got.data() + t * E, dscores.data() + t * E, logits.data() + t * E,
                                              scores_f.data() + t * E, E, fn, scratch.data());
    }
    for (int64_t i = 0; i < T * E; ++i) {
      if (fn == RouterScoreFunction::kSoftmax) {
        EXPECT_NEAR(got[i], want[i], 1e-6 * (1.0 + std::abs(want[i]))) << i;  // fp32 scores
      } else {
        EXPECT_NEAR(got[i], want[i], 1e-14 * (1.0 + std::abs(want[i]))) << i;
      }
    }
  }
}

}  // namespace
}  // namespace moecore
