// TopKRouter behaviours of Megatron's router.py, hand-computed examples, and the backward of the
// whole router against central finite differences in float64.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <random>
#include <set>
#include <vector>

#include "moecore/model/config.h"
#include "moecore/moe/router.h"

namespace moecore {
namespace {

using LB = LoadBalancingType;

MoEConfig base_config(const int64_t E, const int64_t k) {
  MoEConfig c;
  c.num_experts = E;
  c.topk = k;
  c.router_dtype = RouterDType::kFP64;
  c.load_balancing_types = {LB::kAuxLoss};
  c.aux_loss_coeffs = {0.0};
  return c;
}

std::vector<float> random_floats(const int64_t n, const uint32_t seed, const float scale = 1.0f) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = dist(gen);
  return v;
}

struct RouterUnderTest {
  std::vector<Param> params;
  std::unique_ptr<TopKRouter> router;
  Param* weight = nullptr;
  Param* bias = nullptr;

  RouterUnderTest(const MoEConfig& config, const int64_t H, const bool add_bias, const uint32_t seed) {
    router = std::make_unique<TopKRouter>(config, H, add_bias, "decoder.layers.0.", params);
    router->bind(params);
    for (Param& p : params) {
      if (p.name == "decoder.layers.0.mlp.router.weight") weight = &p;
      if (p.name == "decoder.layers.0.mlp.router.bias") bias = &p;
    }
    const std::vector<float> w = random_floats(weight->value.numel(), seed, 0.5f);
    std::copy(w.begin(), w.end(), weight->value.data<float>());
    if (bias != nullptr) {
      const std::vector<float> b = random_floats(bias->value.numel(), seed + 1, 0.3f);
      std::copy(b.begin(), b.end(), bias->value.data<float>());
    }
  }
  void zero_grads() {
    for (Param& p : params) p.grad.zero_();
  }
};

// Identity gate (H == E) so that logits == x.
void set_identity(Param& weight, const int64_t E) {
  float* w = weight.value.data<float>();
  for (int64_t i = 0; i < E * E; ++i) w[i] = (i / E == i % E) ? 1.0f : 0.0f;
}

int64_t count_ones(const std::vector<uint8_t>& v) { return std::count(v.begin(), v.end(), uint8_t{1}); }

TEST(Router, ShapesAndDroplessRouting) {
  const int64_t S = 6, B = 2, T = S * B, H = 8, E = 6, k = 2;
  MoEConfig config = base_config(E, k);
  config.router_dtype = RouterDType::kFP32;
  RouterUnderTest r(config, H, false, 1);
  const std::vector<float> x = random_floats(T * H, 2);
  RouterActivations act;
  const RouterOutput out = r.router->forward(x.data(), S, B, true, 3, 4, act);
  EXPECT_EQ(out.probs_TE.shape(), (std::vector<int64_t>{T, E}));
  EXPECT_EQ(out.routing_map_TE.size(), static_cast<size_t>(T * E));
  EXPECT_EQ(out.tokens_per_expert_E.size(), static_cast<size_t>(E));
  EXPECT_EQ(out.capacity, -1);
  EXPECT_EQ(out.load_balancing_losses.size(), 1u);
  int64_t total = 0;
  for (const int64_t c : out.tokens_per_expert_E) total += c;
  EXPECT_EQ(total, T * k);  // dropless
  const float* p = out.probs_TE.data<float>();
  for (int64_t t = 0; t < T; ++t) {
    double sum = 0.0;
    int selected = 0;
    for (int64_t e = 0; e < E; ++e) {
      EXPECT_EQ(out.routing_map_TE[t * E + e] != 0, p[t * E + e] > 0);
      selected += out.routing_map_TE[t * E + e];
      sum += p[t * E + e];
    }
    EXPECT_EQ(selected, k);
    EXPECT_NEAR(sum, 1.0, 1e-6);  // post-softmax over the k selected logits
  }
}

TEST(Router, Fp32MatchesFp64ToFloatPrecision) {
  const int64_t S = 4, B = 2, T = S * B, H = 16, E = 8;
  MoEConfig config = base_config(E, 2);
  RouterUnderTest r64(config, H, true, 5);
  config.router_dtype = RouterDType::kFP32;
  RouterUnderTest r32(config, H, true, 5);
  const std::vector<float> x = random_floats(T * H, 6);
  RouterActivations a64, a32;
  const RouterOutput o64 = r64.router->forward(x.data(), S, B, false, 0, 0, a64);
  const RouterOutput o32 = r32.router->forward(x.data(), S, B, false, 0, 0, a32);
  EXPECT_EQ(o64.routing_map_TE, o32.routing_map_TE);
  for (int64_t i = 0; i < T * E; ++i) {
    EXPECT_NEAR(a32.logits_TE[i], a64.logits_TE[i], 1e-6 * (1 + std::abs(a64.logits_TE[i])));
    EXPECT_EQ(a32.logits_TE[i], static_cast<double>(static_cast<float>(a32.logits_TE[i])));
    EXPECT_NEAR(o32.probs_TE.data<float>()[i], o64.probs_TE.data<float>()[i], 1e-6);
  }
}

TEST(Router, PreVersusPostSoftmaxByHand) {
  const int64_t E = 4;
  const std::vector<float> x = {1.0f, 2.0f, 0.0f, -1.0f};
  MoEConfig config = base_config(E, 2);
  RouterUnderTest post(config, E, false, 1);
  set_identity(*post.weight, E);
  config.pre_softmax = true;
  RouterUnderTest pre(config, E, false, 1);
  set_identity(*pre.weight, E);
  RouterActivations act;
  const RouterOutput o_post = post.router->forward(x.data(), 1, 1, false, 0, 0, act);
  const RouterOutput o_pre = pre.router->forward(x.data(), 1, 1, false, 0, 0, act);
  // post: softmax over the selected logits {2, 1}; pre: softmax over all four, no renormalisation.
  EXPECT_NEAR(o_post.probs_TE.data<float>()[1], 0.7310585786300049, 1e-7);
  EXPECT_NEAR(o_post.probs_TE.data<float>()[0], 0.2689414213699951, 1e-7);
  EXPECT_NEAR(o_pre.probs_TE.data<float>()[1], 0.6439142598879722, 1e-7);
  EXPECT_NEAR(o_pre.probs_TE.data<float>()[0], 0.23688281808991013, 1e-7);
  for (const RouterOutput* o : {&o_post, &o_pre}) {
    EXPECT_EQ(o->routing_map_TE, (std::vector<uint8_t>{1, 1, 0, 0}));
    EXPECT_EQ(o->probs_TE.data<float>()[2], 0.0f);
  }
}

TEST(Router, SigmoidNormalisationAndScalingByHand) {
  const int64_t E = 4;
  // sigmoid scores 0.5, 0.75, 0.25, 0.9; top-2 = {3, 1}; p = s / (0.9 + 0.75) * 2.5.
  const std::vector<float> x = {0.0f, static_cast<float>(std::log(3.0)), static_cast<float>(-std::log(3.0)),
                                static_cast<float>(std::log(9.0))};
  MoEConfig config = base_config(E, 2);
  config.score_function = RouterScoreFunction::kSigmoid;
  config.topk_scaling_factor = 2.5;
  RouterUnderTest r(config, E, false, 1);
  set_identity(*r.weight, E);
  RouterActivations act;
  const RouterOutput out = r.router->forward(x.data(), 1, 1, false, 0, 0, act);
  EXPECT_EQ(out.routing_map_TE, (std::vector<uint8_t>{0, 1, 0, 1}));
  EXPECT_NEAR(out.probs_TE.data<float>()[3], 1.3636363636363638, 2e-7);
  EXPECT_NEAR(out.probs_TE.data<float>()[1], 1.1363636363636365, 2e-7);
  // k = 1: the raw score, not renormalised.
  config.topk = 1;
  config.topk_scaling_factor.reset();
  RouterUnderTest r1(config, E, false, 1);
  set_identity(*r1.weight, E);
  const RouterOutput out1 = r1.router->forward(x.data(), 1, 1, false, 0, 0, act);
  EXPECT_NEAR(out1.probs_TE.data<float>()[3], 0.9, 1e-7);
}

TEST(Router, UniformRoutingGivesAuxLossExactlyOne) {
  const int64_t S = 4, B = 2, T = S * B, H = 8, E = 8;
  for (const RouterScoreFunction fn : {RouterScoreFunction::kSoftmax, RouterScoreFunction::kSigmoid}) {
    for (const RouterDType dtype : {RouterDType::kFP32, RouterDType::kFP64}) {
      MoEConfig config = base_config(E, 2);
      config.score_function = fn;
      config.router_dtype = dtype;
      config.load_balancing_types = {LB::kAuxLoss, LB::kSeqAuxLoss, LB::kGlobalAuxLoss};
      config.aux_loss_coeffs = {0.01, 0.02, 0.03};
      RouterUnderTest r(config, H, false, 1);
      r.weight->value.zero_();  // all logits 0: every score is 1/E
      const std::vector<float> x = random_floats(T * H, 2);
      RouterActivations act;
      const RouterOutput out = r.router->forward(x.data(), S, B, true, 0, 0, act);
      for (const double loss : out.load_balancing_losses) EXPECT_DOUBLE_EQ(loss, 1.0);
    }
  }
}

TEST(Router, SeqAuxEqualsAuxForBatchOne) {
  const int64_t S = 12, H = 8, E = 6;
  MoEConfig config = base_config(E, 2);
  config.load_balancing_types = {LB::kAuxLoss, LB::kSeqAuxLoss};
  config.aux_loss_coeffs = {0.1, 0.4};
  RouterUnderTest r(config, H, false, 3);
  const std::vector<float> x = random_floats(S * H, 4);
  RouterActivations act;
  const RouterOutput out = r.router->forward(x.data(), S, 1, true, 0, 0, act);
  EXPECT_GT(out.load_balancing_losses[0], 1.0);  // random routing is not perfectly balanced
  EXPECT_NEAR(out.load_balancing_losses[0], out.load_balancing_losses[1], 1e-12);
}

// Naive softmax scores and top-k counts of x W^T (no bias), for the global aux loss reference.
void naive_scores_counts(const std::vector<float>& x, const Param& weight, const int64_t T, const int64_t H,
                         const int64_t E, const int64_t k, std::vector<double>& P_E, std::vector<double>& c_E) {
  P_E.assign(static_cast<size_t>(E), 0.0);
  c_E.assign(static_cast<size_t>(E), 0.0);
  const float* w = weight.value.data<float>();
  for (int64_t t = 0; t < T; ++t) {
    std::vector<double> s(static_cast<size_t>(E));
    double sum = 0.0;
    for (int64_t e = 0; e < E; ++e) {
      double l = 0.0;
      for (int64_t h = 0; h < H; ++h) l += static_cast<double>(x[t * H + h]) * w[e * H + h];
      s[e] = std::exp(l);
      sum += s[e];
    }
    std::vector<int64_t> order(static_cast<size_t>(E));
    for (int64_t e = 0; e < E; ++e) order[e] = e;
    std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return s[a] > s[b]; });
    for (int64_t e = 0; e < E; ++e) P_E[e] += s[e] / sum;
    for (int64_t i = 0; i < k; ++i) c_E[order[i]] += 1;
  }
}

TEST(Router, GlobalAuxAccumulatesOverMicroBatchesAndResets) {
  const int64_t S = 8, B = 2, T = S * B, H = 8, E = 4, k = 2;
  MoEConfig config = base_config(E, k);
  config.load_balancing_types = {LB::kGlobalAuxLoss};
  config.aux_loss_coeffs = {0.5};
  RouterUnderTest r(config, H, false, 7);
  const std::vector<float> xa = random_floats(T * H, 8), xb = random_floats(T * H, 9);
  std::vector<double> Pa, ca, Pb, cb;
  naive_scores_counts(xa, *r.weight, T, H, E, k, Pa, ca);
  naive_scores_counts(xb, *r.weight, T, H, E, k, Pb, cb);
  auto loss_of = [&](const std::vector<double>& P, const std::vector<double>& c) {
    double sum = 0.0;
    for (int64_t e = 0; e < E; ++e) sum += P[e] * c[e];
    return static_cast<double>(E) / (k * T * T) * sum;
  };
  RouterActivations act;
  const double first = r.router->forward(xa.data(), S, B, true, 0, 0, act).load_balancing_losses[0];
  EXPECT_NEAR(first, loss_of(Pa, ca), 1e-12);
  const double second = r.router->forward(xb.data(), S, B, true, 0, 1, act).load_balancing_losses[0];
  std::vector<double> averaged(static_cast<size_t>(E));
  for (int64_t e = 0; e < E; ++e) averaged[e] = (ca[e] + cb[e]) / 2;
  EXPECT_NEAR(second, loss_of(Pb, averaged), 1e-12);
  EXPECT_GT(std::abs(second - loss_of(Pb, cb)), 1e-6);  // the counts of micro-batch A matter
  // Evaluation forwards do not accumulate.
  r.router->forward(xa.data(), S, B, false, 0, 2, act);
  r.router->finish_global_batch();
  const double after_reset = r.router->forward(xb.data(), S, B, true, 0, 3, act).load_balancing_losses[0];
  EXPECT_NEAR(after_reset, loss_of(Pb, cb), 1e-12);
}

TEST(Router, AuxAndZGradientOnlyWithNonZeroCoefficient) {
  const int64_t S = 4, B = 2, T = S * B, H = 8, E = 6;
  const std::vector<float> x = random_floats(T * H, 11);
  const std::vector<float> zero_dprobs(static_cast<size_t>(T * E), 0.0f);
  struct Case {
    std::vector<LB> types;
    std::vector<double> coeffs;
    double z;
    bool expect_grad;
  };
  const std::vector<Case> cases = {
      {{LB::kAuxLoss}, {0.0}, 0.0, false},
      {{LB::kAuxLoss, LB::kSeqAuxLoss, LB::kGlobalAuxLoss}, {0.0, 0.0, 0.0}, 0.0, false},
      {{LB::kNone}, {0.0}, 0.0, false},
      {{LB::kAuxLoss}, {0.1}, 0.0, true},
      {{LB::kSeqAuxLoss}, {0.1}, 0.0, true},
      {{LB::kGlobalAuxLoss}, {0.1}, 0.0, true},
      {{LB::kAuxLoss}, {0.0}, 0.01, true},
  };
  for (const Case& c : cases) {
    MoEConfig config = base_config(E, 2);
    config.load_balancing_types = c.types;
    config.aux_loss_coeffs = c.coeffs;
    config.z_loss_coeff = c.z;
    RouterUnderTest r(config, H, true, 12);
    r.zero_grads();
    RouterActivations act;
    const RouterOutput out = r.router->forward(x.data(), S, B, true, 0, 0, act);
    std::vector<float> dx(static_cast<size_t>(T * H), 0.0f);
    r.router->backward(dx.data(), zero_dprobs.data(), 1.0, act);
    double norm = 0.0;
    for (const float g : r.weight->grad.span<float>()) norm += std::abs(g);
    for (const float g : r.bias->grad.span<float>()) norm += std::abs(g);
    for (const float g : dx) norm += std::abs(g);
    if (c.expect_grad) {
      EXPECT_GT(norm, 1e-6);
    } else {
      EXPECT_EQ(norm, 0.0);
      for (const double loss : out.load_balancing_losses) EXPECT_EQ(loss, 0.0);
      EXPECT_EQ(out.z_loss, 0.0);
    }
  }
}

TEST(Router, CapacityDroppingAndPadding) {
  const int64_t S = 8, B = 2, T = S * B, H = 8, E = 4, k = 2;
  const std::vector<float> x = random_floats(T * H, 21);
  for (const TokenDropPolicy policy : {TokenDropPolicy::kProbs, TokenDropPolicy::kPosition}) {
    for (const bool pad : {false, true}) {
      MoEConfig config = base_config(E, k);
      config.capacity_factor = 0.5;  // C = ceil(T * k / E * 0.5) = 4; T * k * cf = 16
      config.drop_policy = policy;
      config.pad_expert_input_to_capacity = pad;
      RouterUnderTest r(config, H, true, 22);
      r.bias->value.data<float>()[0] = 3.0f;  // expert 0 is everyone's favourite: tokens must be dropped
      RouterActivations act;
      const RouterOutput out = r.router->forward(x.data(), S, B, true, 0, 0, act);
      EXPECT_EQ(out.capacity, 4);
      EXPECT_EQ(count_ones(act.selected_TE), T * k);
      const int64_t routed = count_ones(out.routing_map_TE);
      EXPECT_LT(routed, T * k);
      EXPECT_LE(routed, 16);
      int64_t slots = 0;
      for (int64_t e = 0; e < E; ++e) {
        int64_t column = 0;
        double min_kept = 1e9, max_dropped = -1e9;
        int64_t last_kept = -1, first_dropped = T;
        for (int64_t t = 0; t < T; ++t) {
          const size_t i = static_cast<size_t>(t * E + e);
          column += out.routing_map_TE[i];
          EXPECT_LE(out.routing_map_TE[i], act.selected_TE[i]);
          const double p = act.probs_TE[i];
          if (!out.routing_map_TE[i]) {
            EXPECT_EQ(p, 0.0);
          }
          if (out.routing_map_TE[i]) {
            min_kept = std::min(min_kept, p);
            last_kept = t;
          } else if (act.selected_TE[i]) {
            first_dropped = std::min(first_dropped, t);
            // the prob the token would have had: recompute post-softmax over its two selected logits
            double other = 0.0;
            for (int64_t j = 0; j < E; ++j) {
              if (j != e && act.selected_TE[t * E + j]) other = act.logits_TE[t * E + j];
            }
            max_dropped = std::max(max_dropped, 1.0 / (1.0 + std::exp(other - act.logits_TE[i])));
          }
        }
        EXPECT_LE(column, 4);
        if (policy == TokenDropPolicy::kProbs) {
          EXPECT_GE(min_kept, max_dropped);
        }
        if (policy == TokenDropPolicy::kPosition) {
          EXPECT_LT(last_kept, first_dropped);
        }
        EXPECT_EQ(out.tokens_per_expert_E[e], pad ? 4 : column);
        slots += out.tokens_per_expert_E[e];
      }
      if (pad) {
        EXPECT_EQ(slots, 16);  // exactly T * k * cf
      } else {
        EXPECT_EQ(slots, routed);
      }
    }
  }
}

TEST(Router, GroupLimitedRoutingUsesAtMostGroupTopkGroups) {
  const int64_t S = 16, B = 2, T = S * B, H = 8, E = 16, k = 4, G = 4, g = 2;
  const std::vector<float> x = random_floats(T * H, 31);
  for (const RouterScoreFunction fn : {RouterScoreFunction::kSoftmax, RouterScoreFunction::kSigmoid}) {
    MoEConfig config = base_config(E, k);
    config.score_function = fn;
    config.pre_softmax = fn == RouterScoreFunction::kSoftmax;
    config.num_groups = G;
    config.group_topk = g;
    RouterUnderTest r(config, H, false, 32);
    RouterActivations act;
    const RouterOutput out = r.router->forward(x.data(), S, B, false, 0, 0, act);
    int64_t differs_from_plain_topk = 0;
    for (int64_t t = 0; t < T; ++t) {
      std::vector<double> s(static_cast<size_t>(E));
      double sum = 0.0;
      for (int64_t e = 0; e < E; ++e) {
        const double l = act.logits_TE[t * E + e];
        s[e] = fn == RouterScoreFunction::kSigmoid ? 1.0 / (1.0 + std::exp(-l)) : std::exp(l);
        sum += s[e];
      }
      if (fn == RouterScoreFunction::kSoftmax) {
        for (double& v : s) v /= sum;
      }
      // Naive reference: group score = sum of its best k/g scores; best g groups; best k experts inside them.
      std::vector<std::pair<double, int64_t>> groups;
      for (int64_t gi = 0; gi < G; ++gi) {
        std::vector<double> members(s.begin() + gi * (E / G), s.begin() + (gi + 1) * (E / G));
        std::sort(members.rbegin(), members.rend());
        groups.push_back({members[0] + members[1], gi});
      }
      std::sort(groups.rbegin(), groups.rend());
      std::vector<std::pair<double, int64_t>> candidates, plain;
      for (int64_t e = 0; e < E; ++e) {
        plain.push_back({s[e], e});
        if (e / (E / G) == groups[0].second || e / (E / G) == groups[1].second) candidates.push_back({s[e], e});
      }
      std::sort(candidates.rbegin(), candidates.rend());
      std::sort(plain.rbegin(), plain.rend());
      std::set<int64_t> expected, plain_set, got, groups_hit;
      for (int64_t i = 0; i < k; ++i) {
        expected.insert(candidates[i].second);
        plain_set.insert(plain[i].second);
      }
      for (int64_t e = 0; e < E; ++e) {
        if (out.routing_map_TE[t * E + e]) {
          got.insert(e);
          groups_hit.insert(e / (E / G));
        }
      }
      EXPECT_EQ(got, expected);
      EXPECT_LE(groups_hit.size(), static_cast<size_t>(g));
      differs_from_plain_topk += got != plain_set;
    }
    EXPECT_GT(differs_from_plain_topk, 0);  // the group limit changed some selections
  }
}

TEST(Router, ExpertBiasSteersSelectionAndMovesBySignRule) {
  const int64_t S = 8, B = 2, T = S * B, H = 8, E = 4, k = 2;
  MoEConfig config = base_config(E, k);
  config.score_function = RouterScoreFunction::kSigmoid;
  config.enable_expert_bias = true;
  config.bias_update_rate = 0.01;
  RouterUnderTest r(config, H, false, 41);
  const std::vector<float> x = random_floats(T * H, 42);
  RouterActivations act;
  // Evaluation forwards do not count tokens: the bias stays 0.
  r.router->forward(x.data(), S, B, false, 0, 0, act);
  r.router->finish_global_batch();
  EXPECT_EQ(r.router->expert_bias(), (std::vector<float>(4, 0.0f)));
  const RouterOutput out1 = r.router->forward(x.data(), S, B, true, 0, 0, act);
  const RouterOutput out2 = r.router->forward(x.data(), S, B, true, 0, 1, act);
  std::vector<float> expected(static_cast<size_t>(E));
  double mean = 0.0;
  for (int64_t e = 0; e < E; ++e) mean += 2.0 * out1.tokens_per_expert_E[e] / E;
  for (int64_t e = 0; e < E; ++e) {
    const double c = out1.tokens_per_expert_E[e] + out2.tokens_per_expert_E[e];
    expected[e] = mean > c ? 0.01f : (mean < c ? -0.01f : 0.0f);
  }
  r.router->finish_global_batch();
  EXPECT_EQ(r.router->expert_bias(), expected);
  EXPECT_NE(expected, (std::vector<float>(4, 0.0f)));

  // A large bias forces expert 2 into every selection; the probs still come from the unbiased scores.
  r.router->expert_bias() = {0.0f, 0.0f, 10.0f, 0.0f};
  const RouterOutput out = r.router->forward(x.data(), S, B, false, 0, 0, act);
  for (int64_t t = 0; t < T; ++t) {
    EXPECT_EQ(out.routing_map_TE[t * E + 2], 1);
    double sum = 0.0;
    for (int64_t e = 0; e < E; ++e) {
      if (out.routing_map_TE[t * E + e]) sum += 1.0 / (1.0 + std::exp(-act.logits_TE[t * E + e]));
    }
    for (int64_t e = 0; e < E; ++e) {
      const double s = 1.0 / (1.0 + std::exp(-act.logits_TE[t * E + e]));
      EXPECT_NEAR(act.probs_TE[t * E + e], out.routing_map_TE[t * E + e] ? s / sum : 0.0, 1e-12);
    }
  }
}

TEST(Router, InputJitterOnlyInTraining) {
  const int64_t S = 4, B = 2, T = S * B, H = 8, E = 4;
  MoEConfig config = base_config(E, 2);
  config.input_jitter_eps = 0.1;
  RouterUnderTest r(config, H, false, 51);
  const std::vector<float> x = random_floats(T * H, 52);
  RouterActivations act;
  r.router->forward(x.data(), S, B, false, 5, 6, act);
  for (int64_t i = 0; i < T * H; ++i) EXPECT_EQ(act.input_TH.data<float>()[i], x[i]);
  r.router->forward(x.data(), S, B, true, 5, 6, act);
  int64_t changed = 0;
  for (int64_t i = 0; i < T * H; ++i) {
    const double ratio = act.input_TH.data<float>()[i] / static_cast<double>(x[i]);
    EXPECT_GE(ratio, 0.9 - 1e-6);
    EXPECT_LE(ratio, 1.1 + 1e-6);
    changed += act.input_TH.data<float>()[i] != x[i];
  }
  EXPECT_GT(changed, T * H / 2);
}

TEST(Router, ForceLoadBalancingReplacesLogitsWithNoise) {
  const int64_t S = 64, B = 2, T = S * B, H = 8, E = 8;
  MoEConfig config = base_config(E, 2);
  config.force_load_balancing = true;
  RouterUnderTest r1(config, H, false, 61), r2(config, H, false, 62);
  const std::vector<float> x = random_floats(T * H, 63);
  RouterActivations a1, a2;
  r1.router->forward(x.data(), S, B, true, 1, 2, a1);
  r2.router->forward(x.data(), S, B, true, 1, 2, a2);
  EXPECT_EQ(a1.logits_TE, a2.logits_TE);  // independent of the gate weight
  double mean = 0.0, var = 0.0;
  for (const double l : a1.logits_TE) mean += l / (T * E);
  for (const double l : a1.logits_TE) var += (l - mean) * (l - mean) / (T * E);
  EXPECT_NEAR(mean, 0.0, 0.15);
  EXPECT_NEAR(var, 1.0, 0.2);
}

// A sequence shard [s0, s0 + S') fed with token_offset = s0 * B draws the same jitter factors and forced logits as
// those rows of the whole micro-batch (the counter RNG is keyed by the one-process element index).
TEST(Router, ShardDrawsTheOneProcessRandomNumbers) {
  const int64_t S = 6, B = 2, T = S * B, H = 8, E = 4, s0 = 2, S_shard = 3;
  for (const bool force : {false, true}) {
    MoEConfig config = base_config(E, 2);
    config.input_jitter_eps = 0.1;
    config.force_load_balancing = force;
    RouterUnderTest r(config, H, false, 71);
    const std::vector<float> x = random_floats(T * H, 72);
    RouterActivations full, shard;
    r.router->forward(x.data(), S, B, true, 5, 6, full);
    r.router->forward(x.data() + s0 * B * H, S_shard, B, true, 5, 6, shard, s0 * B);
    for (int64_t i = 0; i < S_shard * B * H; ++i) {
      ASSERT_EQ(shard.input_TH.data<float>()[i], full.input_TH.data<float>()[s0 * B * H + i]) << i;
    }
    for (int64_t i = 0; i < S_shard * B * E; ++i) {
      ASSERT_EQ(shard.logits_TE[static_cast<size_t>(i)], full.logits_TE[static_cast<size_t>(s0 * B * E + i)]) << i;
    }
  }
}

TEST(Router, ParametersAreSummedOverTensorParallelAndCarryTheModule) {
  std::vector<Param> params;
  TopKRouter router(base_config(4, 2), 8, true, "decoder.layers.2.", params, parallel::ParallelState::single_process(),
                    2);
  ASSERT_EQ(params.size(), 2u);
  for (const Param& p : params) {
    EXPECT_TRUE(p.grad_sum_over_tp) << p.name;
    EXPECT_FALSE(p.is_expert) << p.name;
    EXPECT_EQ(p.module, 2) << p.name;
  }
}

TEST(Router, BadConfigurationThrows) {
  std::vector<Param> params;
  MoEConfig config = base_config(4, 5);
  EXPECT_THROW(TopKRouter(config, 8, false, "", params), ConfigError);
  config = base_config(6, 2);
  config.num_groups = 4;
  config.group_topk = 2;
  EXPECT_THROW(TopKRouter(config, 8, false, "", params), ConfigError);
}

// ---- backward against central finite differences (router dtype fp64) ----

struct FdCase {
  const char* name;
  MoEConfig config;
  bool warmup = false;  // run another micro-batch first (global aux counts)
  double tolerance = 2e-5;
};

// objective = sum_te G_te probs_te + aux_scale * (sum_i coeff_i * loss_i + cz * z).
double objective(RouterUnderTest& r, const FdCase& c, const std::vector<float>& x, const std::vector<float>& x_warm,
                 const std::vector<double>& G, const double aux_scale, const int64_t S, const int64_t B,
                 RouterActivations& act) {
  const std::vector<float> bias = r.router->expert_bias();
  r.router->finish_global_batch();
  r.router->expert_bias() = bias;  // keep the selection bias fixed across evaluations
  if (c.warmup) r.router->forward(x_warm.data(), S, B, true, 9, 1, act);
  const RouterOutput out = r.router->forward(x.data(), S, B, true, 9, 2, act);
  double f = 0.0;
  for (size_t i = 0; i < G.size(); ++i) f += G[i] * act.probs_TE[i];
  double aux = c.config.z_loss_coeff * out.z_loss;
  for (size_t i = 0; i < out.load_balancing_losses.size(); ++i) {
    aux += c.config.aux_loss_coeffs[i] * out.load_balancing_losses[i];
  }
  return f + aux_scale * aux;
}

std::vector<FdCase> fd_cases() {
  std::vector<FdCase> cases;
  const std::vector<LB> all = {LB::kAuxLoss, LB::kSeqAuxLoss, LB::kGlobalAuxLoss};
  {
    FdCase c{"softmax_post_all_losses", base_config(6, 2), true};
    c.config.load_balancing_types = all;
    c.config.aux_loss_coeffs = {0.1, 0.2, 0.3};
    c.config.z_loss_coeff = 0.05;
    cases.push_back(c);
  }
  {
    FdCase c{"softmax_pre_capacity_probs", base_config(6, 2)};
    c.config.pre_softmax = true;
    c.config.load_balancing_types = all;
    c.config.aux_loss_coeffs = {0.1, 0.2, 0.3};
    c.config.z_loss_coeff = 0.02;
    c.config.capacity_factor = 0.75;
    cases.push_back(c);
  }
  {
    FdCase c{"sigmoid_groups_bias_scaling_capacity_pad", base_config(8, 2), true};
    c.config.score_function = RouterScoreFunction::kSigmoid;
    c.config.num_groups = 4;
    c.config.group_topk = 2;
    c.config.enable_expert_bias = true;
    c.config.topk_scaling_factor = 2.5;
    c.config.load_balancing_types = all;
    c.config.aux_loss_coeffs = {0.1, 0.2, 0.3};
    c.config.z_loss_coeff = 0.03;
    c.config.capacity_factor = 1.0;
    c.config.drop_policy = TokenDropPolicy::kPosition;
    c.config.pad_expert_input_to_capacity = true;
    cases.push_back(c);
  }
  {
    FdCase c{"sqrtsoftplus_top3", base_config(6, 3)};
    c.config.score_function = RouterScoreFunction::kSqrtSoftplus;
    c.config.load_balancing_types = {LB::kSeqAuxLoss, LB::kAuxLoss};
    c.config.aux_loss_coeffs = {0.2, 0.1};
    c.config.z_loss_coeff = 0.01;
    cases.push_back(c);
  }
  {
    FdCase c{"sigmoid_top1", base_config(6, 1)};
    c.config.score_function = RouterScoreFunction::kSigmoid;
    c.config.aux_loss_coeffs = {0.3};
    cases.push_back(c);
  }
  {
    FdCase c{"sinkhorn_top2_capacity", base_config(6, 2)};
    c.config.load_balancing_types = {LB::kSinkhorn};
    c.config.z_loss_coeff = 0.02;
    c.config.capacity_factor = 1.0;
    cases.push_back(c);
  }
  {
    FdCase c{"sinkhorn_top1", base_config(6, 1)};
    c.config.load_balancing_types = {LB::kSinkhorn};
    cases.push_back(c);
  }
  {
    // jittered input is rounded to fp32 after the perturbation: a looser tolerance for dx
    FdCase c{"softmax_jitter", base_config(6, 2)};
    c.config.input_jitter_eps = 0.05;
    c.config.aux_loss_coeffs = {0.2};
    c.config.z_loss_coeff = 0.01;
    c.tolerance = 2e-3;
    cases.push_back(c);
  }
  return cases;
}

TEST(RouterBackward, MatchesFiniteDifferences) {
  const int64_t S = 4, B = 2, T = S * B, H = 5;
  const double aux_scale = 0.7, h = 1e-4;
  for (const FdCase& c : fd_cases()) {
    SCOPED_TRACE(c.name);
    const int64_t E = c.config.num_experts;
    RouterUnderTest r(c.config, H, true, 71);
    if (c.config.enable_expert_bias) {
      const std::vector<float> b = random_floats(E, 72, 0.05f);
      r.router->expert_bias() = b;
    }
    std::vector<float> x = random_floats(T * H, 73);
    const std::vector<float> x_warm = random_floats(T * H, 74);
    std::vector<double> G(static_cast<size_t>(T * E));
    {
      const std::vector<float> g = random_floats(T * E, 75);
      std::copy(g.begin(), g.end(), G.begin());
    }
    RouterActivations act;
    objective(r, c, x, x_warm, G, aux_scale, S, B, act);
    const std::vector<uint8_t> base_map = act.output.routing_map_TE;
    const std::vector<uint8_t> base_selected = act.selected_TE;
    EXPECT_GT(count_ones(base_map), 0);
    if (c.config.capacity_factor.has_value()) {
      EXPECT_LT(count_ones(base_map), count_ones(base_selected));  // tokens were dropped
    }
    std::vector<float> dprobs(static_cast<size_t>(T * E));
    for (int64_t i = 0; i < T * E; ++i) dprobs[i] = base_map[i] ? static_cast<float>(G[i]) : 0.0f;
    r.zero_grads();
    std::vector<float> dx(static_cast<size_t>(T * H), 0.0f);
    r.router->backward(dx.data(), dprobs.data(), aux_scale, act);

    auto check = [&](float* value, const double analytic, const char* what, const int64_t index, const double tol) {
      const float saved = *value;
      *value = static_cast<float>(saved + h);
      const double up = static_cast<double>(*value);
      RouterActivations a;
      const double f_plus = objective(r, c, x, x_warm, G, aux_scale, S, B, a);
      const bool stable_plus = a.selected_TE == base_selected && a.output.routing_map_TE == base_map;
      *value = static_cast<float>(saved - h);
      const double down = static_cast<double>(*value);
      const double f_minus = objective(r, c, x, x_warm, G, aux_scale, S, B, a);
      const bool stable_minus = a.selected_TE == base_selected && a.output.routing_map_TE == base_map;
      *value = saved;
      ASSERT_TRUE(stable_plus && stable_minus) << what << "[" << index << "]: selection changed, pick other inputs";
      const double fd = (f_plus - f_minus) / (up - down);
      EXPECT_NEAR(analytic, fd, tol * (1.0 + std::abs(fd))) << what << "[" << index << "]";
    };
    const float* dw = r.weight->grad.data<float>();
    for (int64_t i = 0; i < E * H; ++i) check(r.weight->value.data<float>() + i, dw[i], "dW", i, 2e-5);
    const float* db = r.bias->grad.data<float>();
    for (int64_t i = 0; i < E; ++i) check(r.bias->value.data<float>() + i, db[i], "db", i, 2e-5);
    for (int64_t i = 0; i < T * H; ++i) check(x.data() + i, dx[i], "dx", i, c.tolerance);
  }
}

}  // namespace
}  // namespace moecore
