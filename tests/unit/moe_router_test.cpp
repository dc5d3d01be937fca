// TopKRouter behaviours of Megatron's router.py, hand-computed examples, and the backward of the
// whole router against central finite differences in float64.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <span>
#include <vector>

#include "moecore/model/config.h"
#include "moecore/moe/router.h"
#include "moecore/ops/routing.h"

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

// The saved logits as doubles (either router dtype), and the top-k selection as a dense [T, E] 0/1 map.
std::vector<double> logits_of(const RouterActivations& saved) {
  const Tensor& l = saved.logits_TE;
  std::vector<double> out(static_cast<size_t>(l.numel()));
  for (int64_t i = 0; i < l.numel(); ++i) {
    out[static_cast<size_t>(i)] =
        l.dtype() == DType::kF32 ? static_cast<double>(l.data<float>()[i]) : l.data<double>()[i];
  }
  return out;
}
std::vector<uint8_t> selected_of(const RouterActivations& saved) {
  const int64_t E = saved.logits_TE.dim(1), k = saved.selected_TK.dim(1);
  std::vector<uint8_t> out(static_cast<size_t>(saved.logits_TE.numel()), 0);
  const int32_t* idx = saved.selected_TK.data<int32_t>();
  for (int64_t i = 0; i < saved.selected_TK.numel(); ++i) out[static_cast<size_t>((i / k) * E + idx[i])] = 1;
  return out;
}

// A 1-D view of n floats of x from `offset` (n < 0: the rest): the router's token rows.
Tensor in(const std::vector<float>& x, const int64_t offset = 0, const int64_t n = -1) {
  const int64_t count = n < 0 ? static_cast<int64_t>(x.size()) - offset : n;
  return Tensor::from_blob(const_cast<float*>(x.data()) + offset, {count});
}
std::vector<uint8_t> map_of(const RouterOutput& out) {
  const std::span<const uint8_t> map = out.routing_map_TE.span<uint8_t>();
  return {map.begin(), map.end()};
}
void run_backward(TopKRouter& router, std::vector<float>& dx, const std::vector<float>& dprobs, const double scale,
                  const RouterActivations& act, const RouterOutput& out) {
  Tensor dx_TH = Tensor::from_blob(dx.data(), {static_cast<int64_t>(dx.size())});
  router.backward(&dx_TH, in(dprobs), scale, act, out);
}

std::vector<float> bias_of(const TopKRouter& router) {
  const std::span<const float> bias = router.expert_bias();
  return {bias.begin(), bias.end()};
}

struct RouterUnderTest {
  ParamStore params;
  std::unique_ptr<TopKRouter> router;
  Param* weight = nullptr;
  Param* bias = nullptr;

  RouterUnderTest(const MoEConfig& config, const int64_t H, const bool add_bias, const uint32_t seed) {
    router = std::make_unique<TopKRouter>(config, H, add_bias, "decoder.layers.0.", params);
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
  const RouterOutput out = r.router->forward(in(x), S, B, true, 3, 4, act);
  EXPECT_EQ(out.probs_TE.shape(), (std::vector<int64_t>{T, E}));
  EXPECT_EQ(map_of(out).size(), static_cast<size_t>(T * E));
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
      EXPECT_EQ(map_of(out)[t * E + e] != 0, p[t * E + e] > 0);
      selected += map_of(out)[t * E + e];
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
  const RouterOutput o64 = r64.router->forward(in(x), S, B, false, 0, 0, a64);
  const RouterOutput o32 = r32.router->forward(in(x), S, B, false, 0, 0, a32);
  EXPECT_EQ(map_of(o64), map_of(o32));
  for (int64_t i = 0; i < T * E; ++i) {
    EXPECT_NEAR(logits_of(a32)[i], logits_of(a64)[i], 1e-6 * (1 + std::abs(logits_of(a64)[i])));
    EXPECT_EQ(logits_of(a32)[i], static_cast<double>(static_cast<float>(logits_of(a32)[i])));
    EXPECT_NEAR(o32.probs_TE.data<float>()[i], o64.probs_TE.data<float>()[i], 1e-6);
  }
}

// The fp32 router computes its logits and their gradients with fp32 GEMMs (as Megatron's fp32 router_gating_linear),
// the fp64 one in double: the same routing, and every gradient the same to fp32 precision, with and without input
// jitter; gradients accumulate onto what dx and the parameter gradients already hold.
TEST(Router, Fp32BackwardMatchesFp64ToFloatPrecision) {
  const int64_t S = 8, B = 2, T = S * B, H = 24, E = 16;
  for (const double jitter : {0.0, 0.05}) {
    SCOPED_TRACE(jitter > 0 ? "jitter" : "no jitter");
    MoEConfig config = base_config(E, 2);
    config.input_jitter_eps = jitter;
    config.load_balancing_types = {LB::kAuxLoss, LB::kSeqAuxLoss};
    config.aux_loss_coeffs = {0.1, 0.05};
    config.z_loss_coeff = 0.01;
    RouterUnderTest r64(config, H, true, 31);
    config.router_dtype = RouterDType::kFP32;
    RouterUnderTest r32(config, H, true, 31);
    const std::vector<float> x = random_floats(T * H, 32);
    const std::vector<float> dprobs = random_floats(T * E, 33);
    const std::vector<float> dx0 = random_floats(T * H, 34);
    const std::vector<float> dw0 = random_floats(E * H, 35), db0 = random_floats(E, 36);
    std::map<bool, std::vector<float>> dx, dw, db;
    std::map<bool, RouterOutput> outs;
    for (const bool fp32 : {false, true}) {
      RouterUnderTest& r = fp32 ? r32 : r64;
      std::copy(dw0.begin(), dw0.end(), r.weight->grad.data<float>());
      std::copy(db0.begin(), db0.end(), r.bias->grad.data<float>());
      RouterActivations act;
      outs[fp32] = r.router->forward(in(x), S, B, true, 3, 4, act);
      dx[fp32] = dx0;
      run_backward(*r.router, dx[fp32], dprobs, 0.5, act, outs[fp32]);
      dw[fp32].assign(r.weight->grad.data<float>(), r.weight->grad.data<float>() + E * H);
      db[fp32].assign(r.bias->grad.data<float>(), r.bias->grad.data<float>() + E);
    }
    ASSERT_EQ(map_of(outs[true]), map_of(outs[false]));
    auto close = [](const std::vector<float>& got, const std::vector<float>& want, const std::vector<float>& start,
                    const char* what) {
      double moved = 0.0;
      for (size_t i = 0; i < want.size(); ++i) {
        EXPECT_NEAR(got[i], want[i], 2e-5 * (1.0 + std::abs(want[i]))) << what << "[" << i << "]";
        moved += std::abs(want[i] - start[i]);
      }
      EXPECT_GT(moved, 1e-3) << what << " got no gradient";
    };
    close(dx[true], dx[false], dx0, "dx");
    close(dw[true], dw[false], dw0, "dW");
    close(db[true], db[false], db0, "db");
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
  const RouterOutput o_post = post.router->forward(in(x), 1, 1, false, 0, 0, act);
  const RouterOutput o_pre = pre.router->forward(in(x), 1, 1, false, 0, 0, act);
  // post: softmax over the selected logits {2, 1}; pre: softmax over all four, no renormalisation.
  EXPECT_NEAR(o_post.probs_TE.data<float>()[1], 0.7310585786300049, 1e-7);
  EXPECT_NEAR(o_post.probs_TE.data<float>()[0], 0.2689414213699951, 1e-7);
  EXPECT_NEAR(o_pre.probs_TE.data<float>()[1], 0.6439142598879722, 1e-7);
  EXPECT_NEAR(o_pre.probs_TE.data<float>()[0], 0.23688281808991013, 1e-7);
  for (const RouterOutput* o : {&o_post, &o_pre}) {
    EXPECT_EQ(map_of(*o), (std::vector<uint8_t>{1, 1, 0, 0}));
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
  const RouterOutput out = r.router->forward(in(x), 1, 1, false, 0, 0, act);
  EXPECT_EQ(map_of(out), (std::vector<uint8_t>{0, 1, 0, 1}));
  EXPECT_NEAR(out.probs_TE.data<float>()[3], 1.3636363636363638, 2e-7);
  EXPECT_NEAR(out.probs_TE.data<float>()[1], 1.1363636363636365, 2e-7);
  // k = 1: the raw score, not renormalised.
  config.topk = 1;
  config.topk_scaling_factor.reset();
  RouterUnderTest r1(config, E, false, 1);
  set_identity(*r1.weight, E);
  const RouterOutput out1 = r1.router->forward(in(x), 1, 1, false, 0, 0, act);
  EXPECT_NEAR(out1.probs_TE.data<float>()[3], 0.9, 1e-7);
}

// Non-zero gate and inputs with unbalanced routing: every loss against Megatron's formula evaluated by hand,
// loss = E / (k T^2) * sum_e (sum_t s_te) * c_e (seq: per sequence, averaged over B; global: the first micro-batch's
// counts), with s the softmax or the sum-normalised sigmoid scores and c the top-k counts of s.
TEST(Router, AuxLossesMatchHandComputedValues) {
  const int64_t E = 4, k = 2, S = 2, B = 2, T = S * B;
  // Identity gate: logits == x. Tokens t = s * B + b.
  const std::vector<float> x = {2.0f,  1.0f, 0.0f,  -1.0f,  // t0 (s0, b0): top-2 {0, 1}
                                0.5f,  1.5f, -0.5f, 0.0f,   // t1 (s0, b1): top-2 {1, 0}
                                -1.0f, 0.0f, 3.0f,  1.0f,   // t2 (s1, b0): top-2 {2, 3}
                                1.0f,  2.0f, 0.0f,  0.5f};  // t3 (s1, b1): top-2 {1, 0}
  for (const RouterScoreFunction fn : {RouterScoreFunction::kSoftmax, RouterScoreFunction::kSigmoid}) {
    SCOPED_TRACE(to_string(fn));
    MoEConfig config = base_config(E, k);
    config.score_function = fn;
    config.load_balancing_types = {LB::kAuxLoss, LB::kSeqAuxLoss, LB::kGlobalAuxLoss};
    config.aux_loss_coeffs = {0.01, 0.02, 0.03};
    RouterUnderTest r(config, E, false, 1);
    set_identity(*r.weight, E);
    std::vector<double> s_TE(static_cast<size_t>(T * E));
    for (int64_t t = 0; t < T; ++t) {
      double sum = 0.0;
      for (int64_t e = 0; e < E; ++e) {
        const double v = x[t * E + e];
        s_TE[t * E + e] = fn == RouterScoreFunction::kSoftmax ? std::exp(v) : 1.0 / (1.0 + std::exp(-v));
        sum += s_TE[t * E + e];
      }
      for (int64_t e = 0; e < E; ++e) s_TE[t * E + e] /= sum;
    }
    const std::vector<std::vector<int64_t>> top = {{0, 1}, {1, 0}, {2, 3}, {1, 0}};
    std::vector<double> c_E(E, 0.0), c_BE(B * E, 0.0);
    for (int64_t t = 0; t < T; ++t) {
      for (const int64_t e : top[t]) {
        c_E[e] += 1;
        c_BE[(t % B) * E + e] += 1;
      }
    }
    double aux = 0.0, seq = 0.0;
    for (int64_t e = 0; e < E; ++e) {
      double column = 0.0;
      for (int64_t t = 0; t < T; ++t) column += s_TE[t * E + e];
      aux += column * c_E[e];
    }
    for (int64_t j = 0; j < B * E; ++j) {
      double column = 0.0;
      for (int64_t si = 0; si < S; ++si) column += s_TE[si * B * E + j];
      seq += column * c_BE[j];
    }
    aux *= static_cast<double>(E) / (k * T * T);
    seq *= static_cast<double>(E) / (k * S * S) / B;
    EXPECT_GT(aux, 1.03);  // unbalanced: a formula that ignores the counts or the scores gives another value
    EXPECT_GT(std::abs(seq - aux), 0.05);
    RouterActivations act;
    const RouterOutput out = r.router->forward(in(x), S, B, true, 0, 0, act);
    // The scores are fp32 numbers (Megatron's compute_routing_scores_for_aux_loss): relative 1e-7.
    EXPECT_NEAR(out.load_balancing_losses[0], aux, 1e-7 * aux);
    EXPECT_NEAR(out.load_balancing_losses[1], seq, 1e-7 * seq);
    EXPECT_NEAR(out.load_balancing_losses[2], aux, 1e-7 * aux);
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
  const RouterOutput out = r.router->forward(in(x), S, 1, true, 0, 0, act);
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
  const double first = r.router->forward(in(xa), S, B, true, 0, 0, act).load_balancing_losses[0];
  // The scores are fp32 numbers (Megatron's compute_routing_scores_for_aux_loss): relative 1e-7.
  EXPECT_NEAR(first, loss_of(Pa, ca), 1e-7);
  const double second = r.router->forward(in(xb), S, B, true, 0, 1, act).load_balancing_losses[0];
  std::vector<double> averaged(static_cast<size_t>(E));
  for (int64_t e = 0; e < E; ++e) averaged[e] = (ca[e] + cb[e]) / 2;
  EXPECT_NEAR(second, loss_of(Pb, averaged), 1e-7);
  EXPECT_GT(std::abs(second - loss_of(Pb, cb)), 1e-6);  // the counts of micro-batch A matter
  // Evaluation forwards do not accumulate.
  r.router->forward(in(xa), S, B, false, 0, 2, act);
  r.router->finish_global_batch();
  const double after_reset = r.router->forward(in(xb), S, B, true, 0, 3, act).load_balancing_losses[0];
  EXPECT_NEAR(after_reset, loss_of(Pb, cb), 1e-7);
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
    const RouterOutput out = r.router->forward(in(x), S, B, true, 0, 0, act);
    std::vector<float> dx(static_cast<size_t>(T * H), 0.0f);
    run_backward(*r.router, dx, zero_dprobs, 1.0, act, out);
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

TEST(Router, CapacityDropping) {
  const int64_t S = 8, B = 2, T = S * B, H = 8, E = 4, k = 2;
  const std::vector<float> x = random_floats(T * H, 21);
  for (const TokenDropPolicy policy : {TokenDropPolicy::kProbs, TokenDropPolicy::kPosition}) {
    MoEConfig config = base_config(E, k);
    config.capacity_factor = 0.5;  // C = ceil(T * k / E * 0.5) = 4
    config.drop_policy = policy;
    RouterUnderTest r(config, H, true, 22);
    r.bias->value.data<float>()[0] = 3.0f;  // expert 0 is everyone's favourite: tokens must be dropped
    RouterActivations act;
    const RouterOutput out = r.router->forward(in(x), S, B, true, 0, 0, act);
    EXPECT_EQ(out.capacity, 4);
    EXPECT_EQ(count_ones(selected_of(act)), T * k);
    const int64_t routed = count_ones(map_of(out));
    EXPECT_LT(routed, T * k);
    const float* probs = out.probs_TE.data<float>();
    int64_t slots = 0;
    for (int64_t e = 0; e < E; ++e) {
      int64_t column = 0;
      double min_kept = 1e9, max_dropped = -1e9;
      int64_t last_kept = -1, first_dropped = T;
      for (int64_t t = 0; t < T; ++t) {
        const size_t i = static_cast<size_t>(t * E + e);
        column += map_of(out)[i];
        EXPECT_LE(map_of(out)[i], selected_of(act)[i]);
        if (!map_of(out)[i]) {
          EXPECT_EQ(probs[i], 0.0f);
        }
        if (map_of(out)[i]) {
          min_kept = std::min(min_kept, static_cast<double>(probs[i]));
          last_kept = t;
        } else if (selected_of(act)[i]) {
          first_dropped = std::min(first_dropped, t);
          // the prob the token would have had: post-softmax over its two selected logits
          double other = 0.0;
          for (int64_t j = 0; j < E; ++j) {
            if (j != e && selected_of(act)[t * E + j]) other = logits_of(act)[t * E + j];
          }
          max_dropped = std::max(max_dropped, 1.0 / (1.0 + std::exp(other - logits_of(act)[i])));
        }
      }
      EXPECT_LE(column, 4);
      if (policy == TokenDropPolicy::kProbs) {
        EXPECT_GE(min_kept, max_dropped);
      } else {
        EXPECT_LT(last_kept, first_dropped);
      }
      EXPECT_EQ(out.tokens_per_expert_E[e], column);
      slots += column;
    }
    EXPECT_EQ(slots, routed);
  }
}

// Megatron's apply_router_token_dropping with pad_to_capacity: the routing map is the capacity mask itself, so every
// expert gets exactly C real tokens; those it did not select carry probability 0 (the earliest such tokens: ties of
// the capacity top-k go to the earlier token). The kept selected tokens are those of the dropping run.
TEST(Router, PaddingToCapacityRoutesRealTokensWithProbabilityZero) {
  const int64_t S = 8, B = 2, T = S * B, H = 8, E = 4, k = 2, C = 4;
  const std::vector<float> x = random_floats(T * H, 21);
  for (const TokenDropPolicy policy : {TokenDropPolicy::kProbs, TokenDropPolicy::kPosition}) {
    MoEConfig config = base_config(E, k);
    config.capacity_factor = 0.5;
    config.drop_policy = policy;
    RouterUnderTest dropping(config, H, true, 22);
    config.pad_expert_input_to_capacity = true;
    RouterUnderTest padding(config, H, true, 22);
    dropping.bias->value.data<float>()[0] = padding.bias->value.data<float>()[0] = 3.0f;
    RouterActivations a_drop, a_pad;
    const RouterOutput drop = dropping.router->forward(in(x), S, B, true, 0, 0, a_drop);
    const RouterOutput pad = padding.router->forward(in(x), S, B, true, 0, 0, a_pad);
    EXPECT_EQ(pad.capacity, C);
    EXPECT_EQ(pad.tokens_per_expert_E, std::vector<int64_t>(E, C));
    int64_t padded_rows = 0;
    for (int64_t e = 0; e < E; ++e) {
      int64_t column = 0, kept = 0;
      std::vector<int64_t> padding_tokens, unselected;
      for (int64_t t = 0; t < T; ++t) {
        const size_t i = static_cast<size_t>(t * E + e);
        column += map_of(pad)[i];
        EXPECT_EQ(map_of(pad)[i] && selected_of(a_pad)[i], map_of(drop)[i] != 0) << t << "," << e;
        EXPECT_EQ(pad.probs_TE.data<float>()[i], drop.probs_TE.data<float>()[i]);
        kept += map_of(drop)[i];
        if (!selected_of(a_pad)[i]) unselected.push_back(t);
        if (map_of(pad)[i] && !selected_of(a_pad)[i]) padding_tokens.push_back(t);
      }
      EXPECT_EQ(column, C);
      ASSERT_GE(static_cast<int64_t>(unselected.size()), C - kept);
      EXPECT_EQ(padding_tokens, std::vector<int64_t>(unselected.begin(), unselected.begin() + (C - kept)));
      padded_rows += C - kept;
    }
    EXPECT_GT(padded_rows, 0);
  }
  // C > T: no dropping, and with padding every token goes to every expert (Megatron's all-ones capacity mask).
  MoEConfig config = base_config(E, k);
  config.capacity_factor = 3.0;  // C = ceil(16 * 2 / 4 * 3) = 24 > T
  config.pad_expert_input_to_capacity = true;
  RouterUnderTest r(config, H, true, 22);
  RouterActivations act;
  const RouterOutput out = r.router->forward(in(x), S, B, true, 0, 0, act);
  EXPECT_EQ(out.capacity, 24);
  EXPECT_EQ(out.tokens_per_expert_E, std::vector<int64_t>(E, T));
  EXPECT_EQ(count_ones(map_of(out)), T * E);
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
    const RouterOutput out = r.router->forward(in(x), S, B, false, 0, 0, act);
    int64_t differs_from_plain_topk = 0;
    for (int64_t t = 0; t < T; ++t) {
      std::vector<double> s(static_cast<size_t>(E));
      double sum = 0.0;
      for (int64_t e = 0; e < E; ++e) {
        const double l = logits_of(act)[t * E + e];
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
        if (map_of(out)[t * E + e]) {
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
  r.router->forward(in(x), S, B, false, 0, 0, act);
  r.router->finish_global_batch();
  EXPECT_EQ(bias_of(*r.router), (std::vector<float>(4, 0.0f)));
  const RouterOutput out1 = r.router->forward(in(x), S, B, true, 0, 0, act);
  const RouterOutput out2 = r.router->forward(in(x), S, B, true, 0, 1, act);
  std::vector<float> expected(static_cast<size_t>(E));
  double mean = 0.0;
  for (int64_t e = 0; e < E; ++e) mean += 2.0 * out1.tokens_per_expert_E[e] / E;
  for (int64_t e = 0; e < E; ++e) {
    const double c = out1.tokens_per_expert_E[e] + out2.tokens_per_expert_E[e];
    expected[e] = mean > c ? 0.01f : (mean < c ? -0.01f : 0.0f);
  }
  r.router->finish_global_batch();
  EXPECT_EQ(bias_of(*r.router), expected);
  EXPECT_NE(expected, (std::vector<float>(4, 0.0f)));

  // A large bias forces expert 2 into every selection; the probs still come from the unbiased scores.
  r.router->set_expert_bias(std::vector<float>{0.0f, 0.0f, 10.0f, 0.0f});
  const RouterOutput out = r.router->forward(in(x), S, B, false, 0, 0, act);
  for (int64_t t = 0; t < T; ++t) {
    EXPECT_EQ(map_of(out)[t * E + 2], 1);
    double sum = 0.0;
    for (int64_t e = 0; e < E; ++e) {
      if (map_of(out)[t * E + e]) sum += 1.0 / (1.0 + std::exp(-logits_of(act)[t * E + e]));
    }
    for (int64_t e = 0; e < E; ++e) {
      const double s = 1.0 / (1.0 + std::exp(-logits_of(act)[t * E + e]));
      // fp32 probabilities (Megatron's topk_routing_with_score_function)
      EXPECT_NEAR(out.probs_TE.data<float>()[t * E + e], map_of(out)[t * E + e] ? s / sum : 0.0, 1e-7);
    }
  }
}

// Megatron's TopKRouter.forward applies apply_input_jitter whatever self.training is: evaluation forwards are
// jittered too, with the same factors as a training forward of the same (seed, key), reproducibly.
TEST(Router, InputJitterInTrainingAndEvaluation) {
  const int64_t S = 4, B = 2, T = S * B, H = 8, E = 4;
  MoEConfig config = base_config(E, 2);
  config.input_jitter_eps = 0.1;
  RouterUnderTest r(config, H, false, 51);
  const std::vector<float> x = random_floats(T * H, 52);
  RouterActivations train, eval, eval_again, eval_other_key;
  r.router->forward(in(x), S, B, true, 5, 6, train);
  const RouterOutput out = r.router->forward(in(x), S, B, false, 5, 6, eval);
  const RouterOutput out_again = r.router->forward(in(x), S, B, false, 5, 6, eval_again);
  r.router->forward(in(x), S, B, false, 5, 7, eval_other_key);
  int64_t changed = 0, differs_by_key = 0;
  for (int64_t i = 0; i < T * H; ++i) {
    const float jittered = eval.input_TH.data<float>()[i];
    const double ratio = jittered / static_cast<double>(x[i]);
    EXPECT_GE(ratio, 0.9 - 1e-6);
    EXPECT_LE(ratio, 1.1 + 1e-6);
    changed += jittered != x[i];
    EXPECT_EQ(jittered, train.input_TH.data<float>()[i]);
    EXPECT_EQ(jittered, eval_again.input_TH.data<float>()[i]);
    differs_by_key += jittered != eval_other_key.input_TH.data<float>()[i];
  }
  EXPECT_GT(changed, T * H / 2);
  EXPECT_GT(differs_by_key, T * H / 2);
  EXPECT_EQ(logits_of(eval), logits_of(train));
  EXPECT_EQ(map_of(out), map_of(out_again));
  // The evaluation logits are those of the jittered input, not of x.
  MoEConfig plain = config;
  plain.input_jitter_eps = 0.0;
  RouterUnderTest r_plain(plain, H, false, 51);
  RouterActivations no_jitter;
  r_plain.router->forward(in(x), S, B, false, 5, 6, no_jitter);
  EXPECT_NE(logits_of(eval), logits_of(no_jitter));
}

TEST(Router, ForceLoadBalancingReplacesLogitsWithNoise) {
  const int64_t S = 64, B = 2, T = S * B, H = 8, E = 8;
  MoEConfig config = base_config(E, 2);
  config.force_load_balancing = true;
  RouterUnderTest r1(config, H, false, 61), r2(config, H, false, 62);
  const std::vector<float> x = random_floats(T * H, 63);
  RouterActivations a1, a2;
  r1.router->forward(in(x), S, B, true, 1, 2, a1);
  r2.router->forward(in(x), S, B, true, 1, 2, a2);
  EXPECT_EQ(logits_of(a1), logits_of(a2));  // independent of the gate weight
  double mean = 0.0, var = 0.0;
  for (const double l : logits_of(a1)) mean += l / (T * E);
  for (const double l : logits_of(a1)) var += (l - mean) * (l - mean) / (T * E);
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
    r.router->forward(in(x), S, B, true, 5, 6, full);
    r.router->forward(in(x, s0 * B * H, S_shard * B * H), S_shard, B, true, 5, 6, shard,
                      TokenRows::contiguous(s0 * B, S_shard * B));
    for (int64_t i = 0; i < S_shard * B * H; ++i) {
      ASSERT_EQ(shard.input_TH.data<float>()[i], full.input_TH.data<float>()[s0 * B * H + i]) << i;
    }
    for (int64_t i = 0; i < S_shard * B * E; ++i) {
      ASSERT_EQ(logits_of(shard)[static_cast<size_t>(i)], logits_of(full)[static_cast<size_t>(s0 * B * E + i)]) << i;
    }
  }
}

// The expert bias is a named buffer (Megatron's mlp.router.expert_bias) in the list the router was given, the router
// using it from its constructor on; the sign-rule update writes that buffer.
TEST(Router, ExpertBiasIsARegisteredBuffer) {
  MoEConfig config = base_config(4, 2);
  config.score_function = RouterScoreFunction::kSigmoid;
  config.enable_expert_bias = true;
  ParamStore params;
  BufferStore buffers;
  TopKRouter router(config, 8, false, "decoder.layers.3.", params, parallel::ParallelState::single_process(), 3,
                    &buffers);
  ASSERT_EQ(buffers.size(), 1u);
  EXPECT_EQ(buffers[0].name, "decoder.layers.3.mlp.router.expert_bias");
  EXPECT_EQ(buffers[0].value.shape(), (std::vector<int64_t>{4}));
  EXPECT_EQ(buffers[0].value.dtype(), DType::kF32);
  EXPECT_EQ(buffers[0].shard.num_shards, 1);
  router.set_expert_bias(std::vector<float>{0.5f, -1.0f, 0.0f, 2.0f});
  EXPECT_EQ(buffers[0].value.data<float>()[1], -1.0f);
  buffers[0].value.data<float>()[2] = 7.0f;
  EXPECT_EQ(bias_of(router), (std::vector<float>{0.5f, -1.0f, 7.0f, 2.0f}));
  // Without expert bias: no buffer, an empty bias.
  ParamStore plain_params;
  BufferStore plain_buffers;
  TopKRouter plain(base_config(4, 2), 8, false, "decoder.layers.3.", plain_params,
                   parallel::ParallelState::single_process(), 3, &plain_buffers);
  EXPECT_TRUE(plain_buffers.empty());
  EXPECT_TRUE(plain.expert_bias().empty());
}

TEST(Router, ParametersAreSummedOverTensorParallelAndCarryTheModule) {
  ParamStore params;
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
  ParamStore params;
  MoEConfig config = base_config(4, 5);
  EXPECT_THROW(TopKRouter(config, 8, false, "", params), ConfigError);
  config = base_config(6, 2);
  config.num_groups = 4;
  config.group_topk = 2;
  EXPECT_THROW(TopKRouter(config, 8, false, "", params), ConfigError);
  config = base_config(6, 1);  // topk // group_topk = 0 experts would score each group
  config.num_groups = 3;
  config.group_topk = 2;
  EXPECT_THROW(TopKRouter(config, 8, false, "", params), ConfigError);
  config.topk = 3;  // not a multiple of group_topk: accepted, as Megatron
  EXPECT_NO_THROW(TopKRouter(config, 8, false, "", params));
}

// Megatron's group_limited_topk scores a group by its top-(topk // group_topk) experts: with topk 3 and group_topk 2
// that is the single best expert of each group (a top-2 sum, or a refusal of 3 % 2 != 0, would differ).
TEST(Router, GroupLimitedTopkUsesFloorDivisionByHand) {
  const int64_t E = 6, k = 3;
  // sigmoid scores per group: g0 = {0.9, 0.05}, g1 = {0.6, 0.55}, g2 = {0.7, 0.1}
  const std::vector<double> scores = {0.9, 0.05, 0.6, 0.55, 0.7, 0.1};
  // group scores (best expert): 0.9, 0.6, 0.7 -> groups {0, 2}; top-3 of {0.9, 0.05, 0.7, 0.1} = experts 0, 4, 5.
  // (top-2 sums 0.95, 1.15, 0.8 would keep groups {1, 0} and pick experts 0, 2, 3.)
  {
    std::vector<double> values = scores;
    ops::TopkRoutingSpec spec;  // softmax without pre-softmax: the selection ranks the values themselves
    spec.num_groups = 3;
    spec.group_topk = 2;
    Tensor idx({1, k}, DType::kI32), probs({1, k}, DType::kF64);
    ops::topk_routing_forward(idx, probs, Tensor::from_blob(values.data(), {1, E}), nullptr, nullptr, spec);
    EXPECT_EQ(std::vector<int32_t>(idx.data<int32_t>(), idx.data<int32_t>() + k), (std::vector<int32_t>{0, 4, 5}));
  }

  MoEConfig config = base_config(E, k);
  config.score_function = RouterScoreFunction::kSigmoid;
  config.num_groups = 3;
  config.group_topk = 2;
  RouterUnderTest r(config, E, false, 1);
  set_identity(*r.weight, E);
  std::vector<float> x(E);
  for (int64_t e = 0; e < E; ++e) x[e] = static_cast<float>(std::log(scores[e] / (1.0 - scores[e])));
  RouterActivations act;
  const RouterOutput out = r.router->forward(in(x), 1, 1, false, 0, 0, act);
  EXPECT_EQ(map_of(out), (std::vector<uint8_t>{1, 0, 0, 0, 1, 1}));
  const float* p = out.probs_TE.data<float>();
  EXPECT_NEAR(p[0], 0.9 / 1.7, 1e-6);
  EXPECT_NEAR(p[4], 0.7 / 1.7, 1e-6);
  EXPECT_NEAR(p[5], 0.1 / 1.7, 1e-6);
}

// Megatron's router computes the logits in fp64 with --moe-router-dtype fp64 but every score function in fp32
// (topk_routing_with_score_function: sigmoid(logits.float()), softmax(logits, dtype=torch.float32); the aux losses'
// compute_routing_scores_for_aux_loss likewise), then normalises and scales in fp32. Compared bit for bit against a
// naive evaluation with exactly those casts; fp64 scores would differ in the last bits.
TEST(Router, Fp64RouterComputesScoresInFp32AsMegatron) {
  const int64_t S = 16, B = 4, T = S * B, H = 16, E = 8, k = 3;
  const float scale = 2.827f;
  const std::vector<float> x = random_floats(T * H, 81);
  auto sigmoid32 = [](const double logit) {
    const double l = static_cast<float>(logit);
    return static_cast<float>(l >= 0 ? 1.0 / (1.0 + std::exp(-l)) : std::exp(l) / (1.0 + std::exp(l)));
  };
  auto softmax32 = [](const std::vector<double>& logits) {  // cast to fp32, softmax, each result rounded to fp32
    std::vector<double> l(logits.size());
    for (size_t i = 0; i < l.size(); ++i) l[i] = static_cast<float>(logits[i]);
    const double max = *std::max_element(l.begin(), l.end());
    double sum = 0.0;
    for (double& v : l) sum += v = std::exp(v - max);
    std::vector<float> out(l.size());
    for (size_t i = 0; i < l.size(); ++i) out[i] = static_cast<float>(l[i] / sum);
    return out;
  };
  auto top = [](const std::vector<double>& v, const int64_t n) {
    std::vector<int64_t> order(v.size());
    for (size_t i = 0; i < v.size(); ++i) order[i] = static_cast<int64_t>(i);
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return v[a] > v[b]; });
    order.resize(static_cast<size_t>(n));
    return order;
  };
  for (const int variant : {0, 1, 2}) {  // sigmoid (+ aux scores), softmax pre, softmax post
    SCOPED_TRACE(variant);
    MoEConfig config = base_config(E, k);
    config.topk_scaling_factor = scale;
    config.score_function = variant == 0 ? RouterScoreFunction::kSigmoid : RouterScoreFunction::kSoftmax;
    config.pre_softmax = variant == 1;
    if (variant == 0) config.aux_loss_coeffs = {0.1};
    RouterUnderTest r(config, H, true, 82);
    RouterActivations act;
    const RouterOutput out = r.router->forward(in(x), S, B, true, 0, 0, act);
    int64_t differs_from_fp64_scores = 0;
    const std::vector<double> act_logits = logits_of(act);
    for (int64_t t = 0; t < T; ++t) {
      std::vector<double> l(act_logits.begin() + t * E, act_logits.begin() + (t + 1) * E);
      for (int64_t e = 0; e < E; ++e) {  // the logits themselves are fp64 (x W^T + b in double)
        double dot = r.bias->value.data<float>()[e];
        for (int64_t h = 0; h < H; ++h)
          dot += static_cast<double>(x[t * H + h]) * r.weight->value.data<float>()[e * H + h];
        ASSERT_NEAR(l[e], dot, 1e-12);
      }
      std::vector<float> expected(E, 0.0f);
      std::vector<double> fp64(E, 0.0);  // the same with scores in fp64
      if (variant == 0) {
        std::vector<double> s(E);
        for (int64_t e = 0; e < E; ++e) s[e] = sigmoid32(l[e]);
        const std::vector<int64_t> idx = top(s, k);
        float sum = 0.0f;
        double sum64 = 0.0;
        for (const int64_t e : idx) {
          sum += static_cast<float>(s[e]);
          sum64 += 1.0 / (1.0 + std::exp(-l[e]));
        }
        for (const int64_t e : idx) {
          expected[e] = static_cast<float>(s[e]) / (sum + 1e-20f) * scale;
          fp64[e] = 1.0 / (1.0 + std::exp(-l[e])) / sum64 * scale;
        }
        // The aux losses' scores the router saved: fp32 sigmoid normalised over all experts in fp32.
        const double* aux = act.aux_scores_TE.data<double>() + t * E;
        float all = 0.0f;
        for (int64_t e = 0; e < E; ++e) all += static_cast<float>(s[e]);
        for (int64_t e = 0; e < E; ++e) {
          ASSERT_EQ(aux[e], static_cast<double>(static_cast<float>(s[e]) / (all + 1e-20f))) << t;
        }
      } else if (variant == 1) {
        const std::vector<float> s = softmax32(l);
        const std::vector<int64_t> idx = top(std::vector<double>(s.begin(), s.end()), k);
        double max = *std::max_element(l.begin(), l.end()), sum64 = 0.0;
        for (const double v : l) sum64 += std::exp(v - max);
        for (const int64_t e : idx) {
          expected[e] = s[e] * scale;
          fp64[e] = std::exp(l[e] - max) / sum64 * scale;
        }
      } else {
        const std::vector<int64_t> idx = top(l, k);  // top-k of the fp64 logits
        std::vector<double> selected;
        for (const int64_t e : idx) selected.push_back(l[e]);
        const std::vector<float> p = softmax32(selected);
        double sum64 = 0.0;
        for (const double v : selected) sum64 += std::exp(v - selected[0]);
        for (size_t i = 0; i < idx.size(); ++i) {
          expected[idx[i]] = p[i] * scale;
          fp64[idx[i]] = std::exp(selected[i] - selected[0]) / sum64 * scale;
        }
      }
      for (int64_t e = 0; e < E; ++e) {
        ASSERT_EQ(out.probs_TE.data<float>()[t * E + e], expected[e]) << t << "," << e;
        differs_from_fp64_scores += static_cast<float>(fp64[e]) != expected[e];
      }
    }
    EXPECT_GT(differs_from_fp64_scores, 0);  // the test can tell fp32 from fp64 scores
  }
}

// Megatron ignores --moe-router-pre-softmax for sigmoid / sqrtsoftplus scores (topk_routing_with_score_function):
// same routing, probabilities, losses and gradients with and without it.
TEST(Router, PreSoftmaxHasNoEffectWithoutSoftmaxScores) {
  const int64_t S = 4, B = 2, T = S * B, H = 8, E = 6;
  const std::vector<float> x = random_floats(T * H, 91);
  const std::vector<float> dprobs = random_floats(T * E, 92);
  for (const RouterScoreFunction fn : {RouterScoreFunction::kSigmoid, RouterScoreFunction::kSqrtSoftplus}) {
    SCOPED_TRACE(to_string(fn));
    MoEConfig config = base_config(E, 2);
    config.score_function = fn;
    config.aux_loss_coeffs = {0.1};
    config.z_loss_coeff = 0.01;
    RouterUnderTest plain(config, H, true, 93);
    config.pre_softmax = true;
    RouterUnderTest pre(config, H, true, 93);
    RouterActivations a_plain, a_pre;
    const RouterOutput o_plain = plain.router->forward(in(x), S, B, true, 0, 0, a_plain);
    const RouterOutput o_pre = pre.router->forward(in(x), S, B, true, 0, 0, a_pre);
    EXPECT_EQ(map_of(o_pre), map_of(o_plain));
    for (int64_t i = 0; i < T * E; ++i) EXPECT_EQ(o_pre.probs_TE.data<float>()[i], o_plain.probs_TE.data<float>()[i]);
    EXPECT_EQ(o_pre.load_balancing_losses, o_plain.load_balancing_losses);
    EXPECT_EQ(o_pre.z_loss, o_plain.z_loss);
    plain.zero_grads();
    pre.zero_grads();
    std::vector<float> dx_plain(static_cast<size_t>(T * H), 0.0f), dx_pre(static_cast<size_t>(T * H), 0.0f);
    run_backward(*plain.router, dx_plain, dprobs, 0.5, a_plain, o_plain);
    run_backward(*pre.router, dx_pre, dprobs, 0.5, a_pre, o_pre);
    EXPECT_EQ(dx_pre, dx_plain);
    for (int64_t i = 0; i < E * H; ++i)
      EXPECT_EQ(pre.weight->grad.data<float>()[i], plain.weight->grad.data<float>()[i]);
  }
}

// ---- backward against central finite differences ----
//
// The router's probabilities and aux scores are fp32 numbers (as Megatron's), too coarse for finite differences. So
// the objective is evaluated by a naive float64 model of Megatron's differentiable routing math on the router's own
// fp64 logits, for the selection of the base point (the finite differences check that the selection stays put); the
// model is checked against the router's forward at the base point, and the router's backward against its finite
// differences.

struct FdCase {
  const char* name;
  MoEConfig config;
  bool warmup = false;  // run another micro-batch first (global aux counts)
  double tolerance = 2e-5;
};

double coeff(const MoEConfig& c, const LB type) {
  for (size_t i = 0; i < c.load_balancing_types.size(); ++i) {
    if (c.load_balancing_types[i] == type) return c.aux_loss_coeffs[i];
  }
  return 0.0;
}

bool sinkhorn(const MoEConfig& c) { return c.load_balancing_types == std::vector<LB>{LB::kSinkhorn}; }

double score(const RouterScoreFunction fn, const double l) {
  return fn == RouterScoreFunction::kSqrtSoftplus ? std::sqrt(l > 20 ? l : std::log1p(std::exp(l)))
                                                  : 1.0 / (1.0 + std::exp(-l));
}

std::vector<double> softmax_of(const std::vector<double>& v) {
  if (v.empty()) return {};
  double max = *std::max_element(v.begin(), v.end()), sum = 0.0;
  std::vector<double> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) sum += out[i] = std::exp(v[i] - max);
  for (double& o : out) o /= sum;
  return out;
}

// Megatron's probs for a fixed selection: sinkhorn act(l) * map (no scaling); softmax over all (pre) or over the
// selected (post); sigmoid / sqrtsoftplus of the selected, normalised when k > 1; then the scaling factor.
std::vector<double> naive_probs(const MoEConfig& c, const std::vector<double>& logits, const std::vector<uint8_t>& sel,
                                const std::vector<uint8_t>& map, const int64_t T) {
  const int64_t E = c.num_experts, k = c.topk;
  const double scale = c.topk_scaling_factor.has_value() && !sinkhorn(c) ? *c.topk_scaling_factor : 1.0;
  std::vector<double> probs(static_cast<size_t>(T * E), 0.0);
  for (int64_t t = 0; t < T; ++t) {
    const std::vector<double> l(logits.begin() + t * E, logits.begin() + (t + 1) * E);
    std::vector<double> a(E, 0.0);
    if (sinkhorn(c) && k == 1) {
      for (int64_t e = 0; e < E; ++e) a[e] = score(RouterScoreFunction::kSigmoid, l[e]);
    } else if (sinkhorn(c) || (c.score_function == RouterScoreFunction::kSoftmax && c.pre_softmax)) {
      a = softmax_of(l);
    } else if (c.score_function == RouterScoreFunction::kSoftmax) {
      std::vector<double> chosen;
      for (int64_t e = 0; e < E; ++e) {
        if (sel[t * E + e]) chosen.push_back(l[e]);
      }
      const std::vector<double> p = softmax_of(chosen);
      for (int64_t e = 0, i = 0; e < E; ++e) {
        if (sel[t * E + e]) a[e] = p[i++];
      }
    } else {
      double sum = 0.0;
      for (int64_t e = 0; e < E; ++e) {
        if (sel[t * E + e]) sum += a[e] = score(c.score_function, l[e]);
      }
      if (k > 1) {
        for (double& v : a) v /= sum + 1e-20;
      }
    }
    for (int64_t e = 0; e < E; ++e) {
      if (map[t * E + e] && sel[t * E + e]) probs[t * E + e] = a[e] * scale;
    }
  }
  return probs;
}

// The aux losses' scores over all experts and their top-k counts per column of [rows, cols] (cols = E: per expert;
// cols = B * E: per (sequence, expert)).
std::vector<double> naive_aux_scores(const MoEConfig& c, const std::vector<double>& logits, const int64_t T) {
  const int64_t E = c.num_experts;
  std::vector<double> scores(static_cast<size_t>(T * E));
  for (int64_t t = 0; t < T; ++t) {
    const std::vector<double> l(logits.begin() + t * E, logits.begin() + (t + 1) * E);
    std::vector<double> s = softmax_of(l);
    if (c.score_function != RouterScoreFunction::kSoftmax) {
      double sum = 0.0;
      for (int64_t e = 0; e < E; ++e) sum += s[e] = score(c.score_function, l[e]);
      for (double& v : s) v /= sum + 1e-20;
    }
    std::copy(s.begin(), s.end(), scores.begin() + t * E);
  }
  return scores;
}

std::vector<double> topk_counts(const MoEConfig& c, const std::vector<double>& scores, const int64_t T,
                                const int64_t cols) {
  const int64_t E = c.num_experts;
  std::vector<double> counts(static_cast<size_t>(cols), 0.0);
  for (int64_t t = 0; t < T; ++t) {
    std::vector<int64_t> order(E);
    for (int64_t e = 0; e < E; ++e) order[e] = e;
    std::stable_sort(order.begin(), order.end(),
                     [&](int64_t a, int64_t b) { return scores[t * E + a] > scores[t * E + b]; });
    for (int64_t i = 0; i < c.topk; ++i) counts[(t * E + order[i]) % cols] += 1;
  }
  return counts;
}

// coeff * E / (k * rows^2) * sum_j (sum_r scores[r, j]) * counts_j over scores viewed as [rows, cols].
double switch_loss(const MoEConfig& c, const std::vector<double>& scores, const std::vector<double>& counts,
                   const int64_t rows, const int64_t cols, const double coefficient) {
  double sum = 0.0;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < cols; ++j) sum += scores[r * cols + j] * counts[j];
  }
  return coefficient * static_cast<double>(c.num_experts) / (static_cast<double>(c.topk) * rows * rows) * sum;
}

// aux_scale * (sum of coefficient * loss over the configured losses + cz * z) on the logits of a micro-batch;
// `warm_logits` (nullable) are those of the earlier micro-batch of the global batch (global aux counts). losses_out
// receives the losses divided by their coefficients, in configuration order, then z / cz.
double naive_aux_objective(const MoEConfig& c, const std::vector<double>& logits,
                           const std::vector<double>* warm_logits, const int64_t S, const int64_t B,
                           const double aux_scale, std::vector<double>* losses_out) {
  const int64_t T = S * B, E = c.num_experts;
  const std::vector<double> scores = naive_aux_scores(c, logits, T);
  std::vector<double> losses;
  double total = 0.0;
  for (const LB type : c.load_balancing_types) {
    const double cf = coeff(c, type);
    double loss = 0.0;
    if (cf > 0 && type == LB::kAuxLoss) {
      loss = switch_loss(c, scores, topk_counts(c, scores, T, E), T, E, cf);
    } else if (cf > 0 && type == LB::kSeqAuxLoss) {
      loss = switch_loss(c, scores, topk_counts(c, scores, T, B * E), S, B * E, cf) / static_cast<double>(B);
    } else if (cf > 0 && type == LB::kGlobalAuxLoss) {
      std::vector<double> counts = topk_counts(c, scores, T, E);
      if (warm_logits != nullptr) {
        const std::vector<double> warm = topk_counts(c, naive_aux_scores(c, *warm_logits, T), T, E);
        for (int64_t e = 0; e < E; ++e) counts[e] = (counts[e] + warm[e]) / 2.0;
      }
      loss = switch_loss(c, scores, counts, T, E, cf);
    }
    total += loss;
    losses.push_back(cf > 0 ? loss / cf : 0.0);
  }
  double z = 0.0;
  for (int64_t t = 0; t < T; ++t) {
    const std::vector<double> l(logits.begin() + t * E, logits.begin() + (t + 1) * E);
    const double max = *std::max_element(l.begin(), l.end());
    double sum = 0.0;
    for (const double v : l) sum += std::exp(v - max);
    const double lse = max + std::log(sum);
    z += lse * lse / static_cast<double>(T);
  }
  total += c.z_loss_coeff * z;
  losses.push_back(c.z_loss_coeff > 0 ? z : 0.0);
  if (losses_out != nullptr) *losses_out = losses;
  return aux_scale * total;
}

// Runs the router (warm-up micro-batch first when asked) and returns the naive objective
// sum_te G_te probs_te + aux_scale * (aux + z) on its logits for the selection (sel, map).
double objective(RouterUnderTest& r, const FdCase& c, const std::vector<float>& x, const std::vector<float>& x_warm,
                 const std::vector<double>& G, const double aux_scale, const int64_t S, const int64_t B,
                 const std::vector<uint8_t>& sel, const std::vector<uint8_t>& map, RouterActivations& act,
                 RouterOutput& out) {
  const std::vector<float> bias = bias_of(*r.router);
  r.router->finish_global_batch();
  r.router->set_expert_bias(bias);  // keep the selection bias fixed across evaluations
  RouterActivations warm;
  if (c.warmup) r.router->forward(in(x_warm), S, B, true, 9, 1, warm);
  out = r.router->forward(in(x), S, B, true, 9, 2, act);
  const std::vector<double> warm_logits = c.warmup ? logits_of(warm) : std::vector<double>{};
  const std::vector<double> probs = naive_probs(c.config, logits_of(act), sel, map, S * B);
  double f = 0.0;
  for (size_t i = 0; i < G.size(); ++i) f += G[i] * probs[i];
  return f + naive_aux_objective(c.config, logits_of(act), c.warmup ? &warm_logits : nullptr, S, B, aux_scale, nullptr);
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
    FdCase c{"sigmoid_groups_bias_scaling_capacity_pad", base_config(8, 3), true};
    c.config.score_function = RouterScoreFunction::kSigmoid;
    c.config.num_groups = 4;
    c.config.group_topk = 2;  // topk 3 is not a multiple of group_topk
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
  // Sinkhorn with a scaling factor: Megatron's sinkhorn routing ignores it, forward and backward alike.
  {
    FdCase c{"sinkhorn_top2_capacity_scaling", base_config(6, 2)};
    c.config.load_balancing_types = {LB::kSinkhorn};
    c.config.z_loss_coeff = 0.02;
    c.config.capacity_factor = 1.0;
    c.config.topk_scaling_factor = 2.5;
    cases.push_back(c);
  }
  {
    FdCase c{"sinkhorn_top1_scaling", base_config(6, 1)};
    c.config.load_balancing_types = {LB::kSinkhorn};
    c.config.topk_scaling_factor = 3.0;
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
      r.router->set_expert_bias(b);
    }
    std::vector<float> x = random_floats(T * H, 73);
    const std::vector<float> x_warm = random_floats(T * H, 74);
    std::vector<double> G(static_cast<size_t>(T * E));
    {
      const std::vector<float> g = random_floats(T * E, 75);
      std::copy(g.begin(), g.end(), G.begin());
    }
    // The base point: its selection, and the naive model against the router's forward there.
    RouterActivations act;
    RouterOutput out;
    const std::vector<uint8_t> none(static_cast<size_t>(T * E), 0);
    objective(r, c, x, x_warm, G, aux_scale, S, B, none, none, act, out);
    const std::vector<uint8_t> base_map = map_of(out);
    const std::vector<uint8_t> base_selected = selected_of(act);
    EXPECT_GT(count_ones(base_map), 0);
    if (c.config.capacity_factor.has_value() && !c.config.pad_expert_input_to_capacity) {
      EXPECT_LT(count_ones(base_map), count_ones(base_selected));  // tokens were dropped
    }
    const std::vector<double> naive = naive_probs(c.config, logits_of(act), base_selected, base_map, T);
    for (int64_t i = 0; i < T * E; ++i) {
      EXPECT_NEAR(out.probs_TE.data<float>()[i], naive[i], 1e-6 * (1.0 + std::abs(naive[i]))) << "probs " << i;
    }
    {
      RouterActivations warm;
      if (c.warmup) {  // replay the warm-up micro-batch for the naive global aux counts
        r.router->finish_global_batch();
        r.router->forward(in(x_warm), S, B, true, 9, 1, warm);
        r.router->forward(in(x), S, B, true, 9, 2, act);
      }
      std::vector<double> losses;
      const std::vector<double> warm_logits = c.warmup ? logits_of(warm) : std::vector<double>{};
      naive_aux_objective(c.config, logits_of(act), c.warmup ? &warm_logits : nullptr, S, B, 1.0, &losses);
      for (size_t i = 0; i < out.load_balancing_losses.size(); ++i) {
        EXPECT_NEAR(out.load_balancing_losses[i], losses[i], 1e-6 * losses[i]) << "loss " << i;
      }
      EXPECT_NEAR(out.z_loss, losses.back(), 1e-12 * (1.0 + losses.back()));
    }
    objective(r, c, x, x_warm, G, aux_scale, S, B, base_selected, base_map, act, out);
    std::vector<float> dprobs(static_cast<size_t>(T * E));
    for (int64_t i = 0; i < T * E; ++i) dprobs[i] = base_map[i] ? static_cast<float>(G[i]) : 0.0f;
    r.zero_grads();
    std::vector<float> dx(static_cast<size_t>(T * H), 0.0f);
    run_backward(*r.router, dx, dprobs, aux_scale, act, out);

    auto check = [&](float* value, const double analytic, const char* what, const int64_t index, const double tol) {
      const float saved = *value;
      RouterActivations a;
      RouterOutput o;
      *value = static_cast<float>(saved + h);
      const double up = static_cast<double>(*value);
      const double f_plus = objective(r, c, x, x_warm, G, aux_scale, S, B, base_selected, base_map, a, o);
      const bool stable_plus = selected_of(a) == base_selected && map_of(o) == base_map;
      *value = static_cast<float>(saved - h);
      const double down = static_cast<double>(*value);
      const double f_minus = objective(r, c, x, x_warm, G, aux_scale, S, B, base_selected, base_map, a, o);
      const bool stable_minus = selected_of(a) == base_selected && map_of(o) == base_map;
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
