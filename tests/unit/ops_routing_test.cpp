// The routing ops (ops/routing.h), the input jitter (ops/input_jitter.h) and the routing-map padding
// (ops/routing_padding.h) against Megatron's moe_utils.py formulas: naive references, hand-computed values
// and float64 finite differences of the whole loss chains (scores -> column sums -> switch loss), on both backends.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <set>
#include <vector>

#include "moecore/ops/device.h"
#include "moecore/ops/input_jitter.h"
#include "moecore/ops/routing.h"
#include "moecore/ops/routing_padding.h"
#include "moecore/tensor/rng.h"
#include "unit/test_device.h"

namespace moecore::ops {
namespace {

using test::kDevices;
using test::tensor_on;
using test::TestDevice;

std::vector<double> random_values(const int64_t n, const uint32_t seed, const double scale = 1.0) {
  std::mt19937 gen(seed);
  std::normal_distribution<double> dist(0.0, scale);
  std::vector<double> v(static_cast<size_t>(n));
  for (double& x : v) x = dist(gen);
  return v;
}

Tensor tensor_of(std::vector<double>& v, const std::vector<int64_t>& shape) {
  return Tensor::from_blob(v.data(), shape, test::test_device());
}

// k random distinct experts per token (the top-k of random values), as kI32 [T, k].
Tensor random_topk(const int64_t T, const int64_t E, const int64_t k, const uint32_t seed) {
  const std::vector<double> values = random_values(T * E, seed);
  Tensor idx = tensor_on({T, k}, DType::kI32);
  std::vector<int64_t> order(static_cast<size_t>(E));
  for (int64_t t = 0; t < T; ++t) {
    std::iota(order.begin(), order.end(), int64_t{0});
    std::sort(order.begin(), order.end(), [&](const int64_t a, const int64_t b) {
      return values[static_cast<size_t>(t * E + a)] > values[static_cast<size_t>(t * E + b)];
    });
    for (int64_t i = 0; i < k; ++i)
      idx.data<int32_t>()[t * k + i] = static_cast<int32_t>(order[static_cast<size_t>(i)]);
  }
  return idx;
}

// Naive aux loss: coeff * E * sum_e f_e P_e with f_e = c_e / (k T), P_e = mean_t S_te, over the tokens `rows`.
double naive_aux(const std::vector<double>& scores, const Tensor& idx, const std::vector<int64_t>& rows,
                 const int64_t E, const int64_t k, const double coeff) {
  const auto T = static_cast<double>(rows.size());
  double loss = 0.0;
  for (int64_t e = 0; e < E; ++e) {
    double f = 0.0, P = 0.0;
    for (const int64_t t : rows) {
      for (int64_t i = 0; i < k; ++i) f += idx.data<int32_t>()[t * k + i] == e ? 1.0 : 0.0;
      P += scores[static_cast<size_t>(t * E + e)];
    }
    loss += (f / (static_cast<double>(k) * T)) * (P / T);
  }
  return coeff * static_cast<double>(E) * loss;
}

// aux_loss (seq = false) or seq_aux_loss over [S, B] tokens as the router chains the ops; dscores_TE (nullable) +=
// the gradient (the switch losses' per-column gradient, per sequence).
double aux_loss_chain(std::vector<double>& scores, const Tensor& idx, const int64_t S, const int64_t B, const int64_t E,
                      const int64_t k, const double coeff, const bool seq, std::vector<double>* dscores_TE) {
  const int64_t T = S * B;
  Tensor sums_E = tensor_on({E}, DType::kF64), sums_BE = tensor_on({B, E}, DType::kF64),
         counts_BE = tensor_on({B, E}, DType::kF64);
  aux_loss_sums(sums_E, sums_BE, counts_BE, tensor_of(scores, {T, E}), idx.to(test::test_device()), B);
  Tensor grad_BE = tensor_on({B, E}, DType::kF64);
  double loss = 0.0;
  if (seq) {
    const SwitchLossSpec spec{static_cast<double>(S), k, E, coeff / static_cast<double>(B)};
    loss = switch_loss(sums_BE, counts_BE, spec);
    switch_loss_backward(grad_BE, counts_BE, spec, 1.0);
  } else {
    Tensor counts_E = tensor_on({E}, DType::kF64);
    for (int64_t j = 0; j < B * E; ++j) counts_E.data<double>()[j % E] += counts_BE.data<double>()[j];
    const SwitchLossSpec spec{static_cast<double>(T), k, E, coeff};
    loss = switch_loss(sums_E, counts_E, spec);
    Tensor grad_E = tensor_on({E}, DType::kF64);
    switch_loss_backward(grad_E, counts_E, spec, 1.0);
    for (int64_t j = 0; j < B * E; ++j) grad_BE.data<double>()[j] = grad_E.data<double>()[j % E];
  }
  if (dscores_TE != nullptr) {
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t e = 0; e < E; ++e)
        (*dscores_TE)[static_cast<size_t>(t * E + e)] += grad_BE.data<double>()[(t % B) * E + e];
    }
  }
  return loss;
}

std::vector<int64_t> all_rows(const int64_t T) {
  std::vector<int64_t> rows(static_cast<size_t>(T));
  std::iota(rows.begin(), rows.end(), int64_t{0});
  return rows;
}

TEST(RoutingOps, UniformScoresGiveExactlyTheCoefficient) {
  const int64_t T = 16, E = 8, k = 2;
  std::vector<double> scores(static_cast<size_t>(T * E), 1.0 / E);
  // Any routing with k experts per token: f sums to 1 and P_e = 1/E, so the loss is coeff.
  const Tensor idx = random_topk(T, E, k, 7);
  for (const Device device : kDevices) {
    const TestDevice scope(device);
    EXPECT_DOUBLE_EQ(aux_loss_chain(scores, idx, T, 1, E, k, 0.01, false, nullptr), 0.01);
  }
}

TEST(RoutingOps, AuxAndSeqAuxLossesMatchNaiveFormulas) {
  const int64_t S = 5, B = 3, E = 4, k = 2, T = S * B;
  std::vector<double> scores = random_values(T * E, 11);
  for (double& s : scores) s = std::abs(s);
  const Tensor idx = random_topk(T, E, k, 12);
  double expected_seq = 0.0;
  for (int64_t b = 0; b < B; ++b) {  // tokens of sequence b: t = s * B + b
    std::vector<int64_t> rows;
    for (int64_t s = 0; s < S; ++s) rows.push_back(s * B + b);
    expected_seq += naive_aux(scores, idx, rows, E, k, 0.2) / B;
  }
  for (const Device device : kDevices) {
    const TestDevice scope(device);
    EXPECT_NEAR(aux_loss_chain(scores, idx, S, B, E, k, 0.3, false, nullptr),
                naive_aux(scores, idx, all_rows(T), E, k, 0.3), 1e-14);
    EXPECT_NEAR(aux_loss_chain(scores, idx, S, B, E, k, 0.2, true, nullptr), expected_seq, 1e-14);
    // With one sequence, seq_aux_loss == aux_loss.
    EXPECT_NEAR(aux_loss_chain(scores, idx, T, 1, E, k, 0.2, true, nullptr),
                aux_loss_chain(scores, idx, T, 1, E, k, 0.2, false, nullptr), 1e-14);
  }
}

TEST(RoutingOps, AuxLossGradientsMatchFiniteDifferences) {
  const int64_t S = 4, B = 2, E = 5, k = 2, T = S * B;
  const Tensor idx = random_topk(T, E, k, 21);
  std::vector<double> scores = random_values(T * E, 22);
  for (const Device device : kDevices) {
    const TestDevice scope(device);
    for (const bool seq : {false, true}) {
      std::vector<double> grad(static_cast<size_t>(T * E), 0.0);
      aux_loss_chain(scores, idx, S, B, E, k, 0.7, seq, &grad);
      const double h = 1e-6;
      for (int64_t i = 0; i < T * E; ++i) {
        const double saved = scores[static_cast<size_t>(i)];
        scores[static_cast<size_t>(i)] = saved + h;
        const double plus = aux_loss_chain(scores, idx, S, B, E, k, 0.7, seq, nullptr);
        scores[static_cast<size_t>(i)] = saved - h;
        const double minus = aux_loss_chain(scores, idx, S, B, E, k, 0.7, seq, nullptr);
        scores[static_cast<size_t>(i)] = saved;
        EXPECT_NEAR(grad[static_cast<size_t>(i)], (plus - minus) / (2 * h), 1e-8) << seq << " " << i;
      }
    }
  }
}

double raw_score(const RoutingScore fn, const double l) {
  return fn == RoutingScore::kSoftmax   ? std::exp(l)
         : fn == RoutingScore::kSigmoid ? 1.0 / (1.0 + std::exp(-l))
                                        : std::sqrt(std::log1p(std::exp(l)));
}

TEST(RoutingOps, AuxScoresAreFp32NormalisedScoresAndTheirTopk) {
  const int64_t T = 3, E = 6, k = 2;
  std::vector<double> logits = random_values(T * E, 31, 1.5);
  for (const Device device : kDevices) {
    const TestDevice scope(device);
    for (const RoutingScore fn : {RoutingScore::kSoftmax, RoutingScore::kSigmoid, RoutingScore::kSqrtSoftplus}) {
      Tensor scores = tensor_on({T, E}, DType::kF64), idx = tensor_on({T, k}, DType::kI32);
      aux_scores_forward(scores, idx, tensor_of(logits, {T, E}), fn, true);
      for (int64_t t = 0; t < T; ++t) {
        double raw_sum = 0.0, sum = 0.0, kth = 1e300, best_unselected = -1e300;
        for (int64_t e = 0; e < E; ++e) raw_sum += raw_score(fn, logits[static_cast<size_t>(t * E + e)]);
        const std::set<int32_t> picked(idx.data<int32_t>() + t * k, idx.data<int32_t>() + (t + 1) * k);
        EXPECT_EQ(static_cast<int64_t>(picked.size()), k);
        for (int64_t e = 0; e < E; ++e) {
          const double s = scores.data<double>()[t * E + e];
          // fp32 scores whatever the logits' precision (Megatron's compute_routing_scores_for_aux_loss)
          EXPECT_EQ(s, static_cast<double>(static_cast<float>(s)));
          EXPECT_NEAR(s, raw_score(fn, logits[static_cast<size_t>(t * E + e)]) / raw_sum, 1e-7);
          sum += s;
          if (picked.count(static_cast<int32_t>(e))) {
            kth = std::min(kth, s);
          } else {
            best_unselected = std::max(best_unselected, s);
          }
        }
        EXPECT_NEAR(sum, 1.0, 1e-6);
        EXPECT_GT(kth, best_unselected);
      }
    }
  }
}

TEST(RoutingOps, ZLossValueAndGradient) {
  const int64_t T = 4, E = 5;
  std::vector<double> logits = random_values(T * E, 41, 2.0);
  double expected = 0.0;
  for (int64_t t = 0; t < T; ++t) {
    double sum = 0.0;
    for (int64_t e = 0; e < E; ++e) sum += std::exp(logits[static_cast<size_t>(t * E + e)]);
    expected += std::log(sum) * std::log(sum) / T;
  }
  for (const Device device : kDevices) {
    const TestDevice scope(device);
    Tensor lse = tensor_on({T}, DType::kF64);
    Tensor dlogits = tensor_on({T, E}, DType::kF64);
    EXPECT_NEAR(z_loss_forward(lse, tensor_of(logits, {T, E}), 0.3), 0.3 * expected, 1e-13);
    z_loss_backward(dlogits, tensor_of(logits, {T, E}), lse, 0.3 * 0.5);  // grad_scale 0.5
    const double h = 1e-6;
    for (int64_t i = 0; i < T * E; ++i) {
      const double saved = logits[static_cast<size_t>(i)];
      logits[static_cast<size_t>(i)] = saved + h;
      const double plus = z_loss_forward(lse, tensor_of(logits, {T, E}), 0.3);
      logits[static_cast<size_t>(i)] = saved - h;
      const double minus = z_loss_forward(lse, tensor_of(logits, {T, E}), 0.3);
      logits[static_cast<size_t>(i)] = saved;
      EXPECT_NEAR(dlogits.data<double>()[i], 0.5 * (plus - minus) / (2 * h), 1e-8);
    }
  }
}

TEST(RoutingOps, ExpertBiasSignRuleByHand) {
  for (const Device device : kDevices) {
    const TestDevice scope(device);
    std::vector<float> bias = {0.5f, -0.25f, 0.0f, 1.0f};
    std::vector<double> counts = {3.0, 1.0, 2.0, 2.0};
    // mean = 2: expert 0 is over-loaded (bias down), expert 1 under-loaded (up), 2 and 3 balanced (unchanged).
    Tensor bias_E = Tensor::from_blob(bias.data(), {4}, test::test_device());
    expert_bias_update(bias_E, tensor_of(counts, {4}), 0.125);
    EXPECT_EQ(bias, (std::vector<float>{0.375f, -0.125f, 0.0f, 1.0f}));
  }
}

// The top-k over raw logits (softmax scores without --moe-router-pre-softmax) selects on the values themselves.
std::vector<int32_t> select(std::vector<double> values, const int64_t k, const int64_t groups = 0,
                            const int64_t group_topk = 0) {
  const auto E = static_cast<int64_t>(values.size());
  TopkRoutingSpec spec;
  spec.num_groups = groups;
  spec.group_topk = group_topk;
  Tensor idx = tensor_on({1, k}, DType::kI32), probs = tensor_on({1, k}, DType::kF64);
  topk_routing_forward(idx, probs, tensor_of(values, {1, E}), nullptr, nullptr, spec);
  return {idx.data<int32_t>(), idx.data<int32_t>() + k};
}

TEST(RoutingOps, TopkTiesGoToTheLowerIndexAndGroupsByHand) {
  for (const Device device : kDevices) {
    const TestDevice scope(device);
    EXPECT_EQ(select({1.0, 3.0, 2.0, 3.0, 2.0}, 3), (std::vector<int32_t>{1, 3, 2}));
    // 4 groups of 2; k = 2, group_topk = 2: group score = its best value (top-1 of each group).
    // Group scores: g0 = 0.9, g1 = 0.8, g2 = 0.85, g3 = 0.1 -> groups 0 and 2 -> experts 0 (0.9) and 4 (0.85),
    // although expert 2 (0.8) beats expert 5 (0.7) and 1 (0.05).
    const std::vector<double> values = {0.9, 0.05, 0.8, 0.79, 0.85, 0.7, 0.1, 0.0};
    EXPECT_EQ(select(values, 2, 4, 2), (std::vector<int32_t>{0, 4}));
    // k = 4, group_topk = 2: group score = sum of its top-2: g0 = 0.95, g1 = 1.59, g2 = 1.55, g3 = 0.1.
    const std::vector<int32_t> four = select(values, 4, 4, 2);
    EXPECT_EQ(std::set<int32_t>(four.begin(), four.end()), (std::set<int32_t>{2, 3, 4, 5}));
  }
}

TEST(RoutingOps, SqrtSoftplusFollowsTorchThreshold) {
  for (const Device device : kDevices) {
    const TestDevice scope(device);
    TopkRoutingSpec spec;
    spec.score = RoutingScore::kSqrtSoftplus;
    spec.fp32_scores = false;
    std::vector<double> logits = {25.0, 0.0};  // softplus(25) = 25 exactly above torch's threshold 20
    Tensor idx = tensor_on({2, 1}, DType::kI32), probs = tensor_on({2, 1}, DType::kF64);
    topk_routing_forward(idx, probs, tensor_of(logits, {2, 1}), nullptr, nullptr, spec);
    EXPECT_DOUBLE_EQ(probs.data<double>()[0], 5.0);
    EXPECT_NEAR(probs.data<double>()[1], std::sqrt(std::log(2.0)), 1e-15);
    // d sqrt(softplus(l)) / dl = sigmoid(l) / (2 sqrt(softplus(l))); above the threshold softplus' = 1.
    std::vector<double> dprobs = {1.0, 1.0};
    Tensor dlogits = tensor_on({2, 1}, DType::kF64);
    topk_routing_backward(dlogits, tensor_of(dprobs, {2, 1}), nullptr, idx, tensor_of(logits, {2, 1}), spec);
    EXPECT_DOUBLE_EQ(dlogits.data<double>()[0], 1.0 / 10.0);
    EXPECT_NEAR(dlogits.data<double>()[1], 0.5 / (2.0 * std::sqrt(std::log(2.0))), 1e-15);
  }
}

TEST(RoutingOps, SinkhornBalancesColumnsAndRows) {
  const int64_t T = 16, E = 4;
  std::vector<double> logits = random_values(T * E, 51);
  for (const Device device : kDevices) {
    const TestDevice scope(device);
    Tensor balanced = tensor_on({T, E}, DType::kF64);
    sinkhorn(balanced, tensor_of(logits, {T, E}));
    for (int64_t e = 0; e < E; ++e) {
      double col = 0.0;
      for (int64_t t = 0; t < T; ++t) col += balanced.data<double>()[t * E + e];
      EXPECT_NEAR(col, 1.0 / E, 1e-5);
    }
    for (int64_t t = 0; t < T; ++t) {
      double row = 0.0;
      for (int64_t e = 0; e < E; ++e) row += balanced.data<double>()[t * E + e];
      EXPECT_NEAR(row, 1.0 / T, 1e-3);
    }
  }
}

// Megatron's capacity mask (apply_router_token_dropping): the top-C of each column over ALL tokens, by prob or by
// "selected first"; ties to the earlier token; everything when C >= T. Column 0 holds the example; column 1 takes
// the tokens column 0 did not select (top-1 routing over two experts). Returns column 0 of the padded map (the mask).
std::vector<uint8_t> column0(const std::vector<uint8_t>& sel0, const std::vector<double>& probs0,
                             const int64_t capacity, const RoutingDropPolicy policy) {
  const auto T = static_cast<int64_t>(sel0.size());
  const int64_t E = 2;
  Tensor idx = tensor_on({T, 1}, DType::kI32), probs = tensor_on({T, 1}, DType::kF64);
  for (int64_t t = 0; t < T; ++t) {
    idx.data<int32_t>()[t] = sel0[static_cast<size_t>(t)] ? 0 : 1;
    probs.data<double>()[t] = sel0[static_cast<size_t>(t)] ? probs0[static_cast<size_t>(t)] : 0.25;
  }
  Tensor map = tensor_on({T, E}, DType::kU8), probs_TE = tensor_on({T, E}, DType::kF64),
         counts = tensor_on({E}, DType::kI64);
  routing_map(map, probs_TE, counts, idx, probs, capacity, policy, true);
  std::vector<uint8_t> out;
  for (int64_t t = 0; t < T; ++t) out.push_back(map.data<uint8_t>()[t * E]);
  return out;
}

TEST(RoutingOps, CapacityMaskPolicies) {
  for (const Device device : kDevices) {
    const TestDevice scope(device);
    // 5 tokens, tokens 0, 1, 3, 4 selected (token 2 not: prob 0).
    const std::vector<uint8_t> selected = {1, 1, 0, 1, 1};
    const std::vector<double> probs = {0.2, 0.5, 0.0, 0.9, 0.5};
    // 0.9, then the earlier of the tied 0.5s
    EXPECT_EQ(column0(selected, probs, 2, RoutingDropPolicy::kProbs), (std::vector<uint8_t>{0, 1, 0, 1, 0}));
    EXPECT_EQ(column0(selected, probs, 2, RoutingDropPolicy::kPosition), (std::vector<uint8_t>{1, 1, 0, 0, 0}));
    EXPECT_EQ(column0(selected, probs, 5, RoutingDropPolicy::kProbs), (std::vector<uint8_t>{1, 1, 1, 1, 1}));
    // Fewer selected tokens than C: the mask (the padded routing map) takes the earliest unselected ones.
    const std::vector<uint8_t> few = {0, 1, 0, 0, 1};
    const std::vector<double> few_probs = {0.0, 0.3, 0.0, 0.0, 0.6};
    EXPECT_EQ(column0(few, few_probs, 3, RoutingDropPolicy::kProbs), (std::vector<uint8_t>{1, 1, 0, 0, 1}));
    EXPECT_EQ(column0(few, few_probs, 4, RoutingDropPolicy::kPosition), (std::vector<uint8_t>{1, 1, 1, 0, 1}));
    // A selected token with probability 0 ranks with the unselected ones (token order); a negative one after them.
    const std::vector<uint8_t> zeros = {1, 0, 1, 1, 0};
    const std::vector<double> zero_probs = {-0.5, 0.0, 0.0, 0.4, 0.0};
    EXPECT_EQ(column0(zeros, zero_probs, 3, RoutingDropPolicy::kProbs), (std::vector<uint8_t>{0, 1, 1, 1, 0}));
    EXPECT_EQ(column0(zeros, zero_probs, 5, RoutingDropPolicy::kProbs), (std::vector<uint8_t>{1, 1, 1, 1, 1}));
    EXPECT_EQ(column0(zeros, zero_probs, 4, RoutingDropPolicy::kProbs), (std::vector<uint8_t>{0, 1, 1, 1, 1}));
  }
}

// Megatron's apply_input_jitter: factor Uniform(1 - eps, 1 + eps) = low + (high - low) u in fp32 with u the counter
// RNG's uniform at the element's one-process counter; backward multiplies by the same factor.
TEST(RoutingOps, InputJitterIsTheCounterRngUniform) {
  for (const Device device : kDevices) {
    const TestDevice scope(device);
    constexpr int64_t R = 3, W = 5;
    const std::vector<int64_t> first_R = {40, 0, 15};  // rows 8, 0 and 3 of the one-process [., 5] tensor
    const InputJitterSpec spec{0.01, 1234, 77};
    Tensor inp = tensor_on({R, W}, DType::kF32), out = tensor_on({R, W}, DType::kF32);
    Tensor dout = tensor_on({R, W}, DType::kF32), dinp = tensor_on({R, W}, DType::kF32);
    for (int64_t i = 0; i < R * W; ++i) {
      inp.data<float>()[i] = 0.25f * static_cast<float>(i - 7);
      dout.data<float>()[i] = 0.5f + 0.125f * static_cast<float>(i);
      dinp.data<float>()[i] = 1.0f;
    }
    input_jitter_forward(out, inp, first_R, W, spec);
    input_jitter_backward(dinp, dout, first_R, W, spec);
    const CounterRng rng(spec.seed, spec.key);
    const float low = static_cast<float>(1.0 - spec.eps), high = static_cast<float>(1.0 + spec.eps);
    for (int64_t r = 0; r < R; ++r) {
      for (int64_t j = 0; j < W; ++j) {
        const int64_t i = r * W + j;
        const float factor = low + (high - low) * rng.uniform(static_cast<uint64_t>(first_R[r] + j));
        EXPECT_EQ(out.data<float>()[i], inp.data<float>()[i] * factor) << "element " << i;
        EXPECT_EQ(dinp.data<float>()[i], 1.0f + dout.data<float>()[i] * factor) << "element " << i;
      }
    }
    // eps 0: every factor is 1.
    input_jitter_forward(out, inp, first_R, W, InputJitterSpec{0.0, 1234, 77});
    for (int64_t i = 0; i < R * W; ++i) EXPECT_EQ(out.data<float>()[i], inp.data<float>()[i]);
    EXPECT_THROW(input_jitter_forward(out, inp, first_R, W, InputJitterSpec{-0.1, 1, 2}), std::invalid_argument);
    EXPECT_THROW(input_jitter_forward(out, inp, std::vector<int64_t>{0, 5}, W, spec), std::invalid_argument);
  }
}

// Megatron's pad_routing_map: each expert takes its first (-count mod multiple) unrouted tokens, lowest first.
TEST(RoutingOps, PadRoutingMapTakesTheLowestUnroutedTokens) {
  for (const Device device : kDevices) {
    const TestDevice scope(device);
    const std::vector<uint8_t> before = {1, 0, 0, 0, 1, 0, 1, 1, 0, 0, 0, 0, 0, 0, 1, 1, 0, 0};  // T = 6, E = 3
    const std::vector<uint8_t> after = {1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 1, 0, 0, 0, 1, 1, 0, 0};
    Tensor map = tensor_on({6, 3}, DType::kU8), counts = tensor_on({3}, DType::kI64);
    std::copy(before.begin(), before.end(), map.data<uint8_t>());
    pad_routing_map(map, counts, 4);
    EXPECT_EQ(std::vector<uint8_t>(map.data<uint8_t>(), map.data<uint8_t>() + 18), after);
    EXPECT_EQ(std::vector<int64_t>(counts.data<int64_t>(), counts.data<int64_t>() + 3),
              (std::vector<int64_t>{4, 4, 4}));
    EXPECT_THROW(pad_routing_map(map, counts, 0), std::invalid_argument);
  }
}

}  // namespace
}  // namespace moecore::ops
