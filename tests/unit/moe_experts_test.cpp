// Routed experts (GroupedMLP, SequentialMLP) and shared experts against a naive per-row reference in double
// precision written here (fc1, activation, prob, fc2 and their hand-derived gradients; the reference itself is
// checked against central finite differences), grouped == sequential in outputs and every gradient with uneven
// token counts including experts with zero tokens, deferred weight gradients (--delay-wgrad-compute) == undeferred,
// parameter registration, and bad input.
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "kernel_test_util.h"
#include "moecore/moe/experts.h"
#include "moecore/moe/moe_layer.h"
#include "moecore/ops/convert.h"
#include "moecore/ops/precision.h"
#include "moecore/ops/quantization.h"

namespace moecore {
namespace {

using test::random_vector;

constexpr int64_t kH = 24, kF = 20;

// Tensor views of a test's vectors, rows of width W; ref() lets a view stand for an output argument.
Tensor view(const std::vector<float>& v, const int64_t W) {
  return Tensor::from_blob(v.data(), {static_cast<int64_t>(v.size()) / W, W});
}
Tensor& ref(Tensor&& t) { return t; }
const std::vector<int64_t> kTokensPerExpert{37, 0, 130, 1, 0, 9};  // uneven, two experts idle

// ---- double reference ----------------------------------------------------------------------------------------

double sigmoid(const double z) { return 1.0 / (1.0 + std::exp(-z)); }

// act[f] from the fc1 row (width 2F with SwiGLU: [gate | up]).
std::vector<double> ref_act(const Activation a, const std::vector<double>& fc1, const int64_t F) {
  std::vector<double> out(static_cast<size_t>(F));
  for (int64_t f = 0; f < F; ++f) {
    const double x = fc1[f];
    switch (a) {
      case Activation::kSwiGLU: out[f] = x * sigmoid(x) * fc1[F + f]; break;
      case Activation::kGelu: out[f] = 0.5 * x * (1.0 + std::erf(x / std::sqrt(2.0))); break;
      case Activation::kSquaredReLU: out[f] = x > 0 ? x * x : 0.0; break;
    }
  }
  return out;
}

std::vector<double> ref_act_backward(const Activation a, const std::vector<double>& dact,
                                     const std::vector<double>& fc1, const int64_t F) {
  std::vector<double> d(fc1.size(), 0.0);
  for (int64_t f = 0; f < F; ++f) {
    const double x = fc1[f];
    switch (a) {
      case Activation::kSwiGLU: {
        const double s = sigmoid(x);
        d[f] = dact[f] * fc1[F + f] * (s + x * s * (1.0 - s));
        d[F + f] = dact[f] * x * s;
        break;
      }
      case Activation::kGelu:
        d[f] =
            dact[f] * (0.5 * (1.0 + std::erf(x / std::sqrt(2.0))) + x * std::exp(-0.5 * x * x) / std::sqrt(2.0 * M_PI));
        break;
      case Activation::kSquaredReLU: d[f] = x > 0 ? dact[f] * 2.0 * x : 0.0; break;
    }
  }
  return d;
}

// y = W x + b for W [O, I] row-major.
std::vector<double> ref_linear(const std::vector<double>& W, const std::vector<double>* b, const std::vector<double>& x,
                               const int64_t O, const int64_t I) {
  std::vector<double> y(static_cast<size_t>(O));
  for (int64_t o = 0; o < O; ++o) {
    double s = b ? (*b)[o] : 0.0;
    for (int64_t i = 0; i < I; ++i) s += W[o * I + i] * x[i];
    y[o] = s;
  }
  return y;
}

struct RefMLP {  // one MLP's weights in double
  std::vector<double> w1, b1, w2, b2;
  bool bias = false;
};

struct RefRowGrads {
  std::vector<double> y, dx;
  double dp = 0.0;
};

// One routed row: forward and (given dy) backward, accumulating parameter gradients into g.
RefRowGrads ref_row(const RefMLP& m, RefMLP& g, const Activation a, const bool probs_on_input, const int64_t H,
                    const int64_t F, const std::vector<double>& x, const double p, const std::vector<double>& dy) {
  const int64_t F1 = a == Activation::kSwiGLU ? 2 * F : F;
  std::vector<double> xs = x;
  if (probs_on_input) {
    for (double& v : xs) v *= p;
  }
  const auto fc1 = ref_linear(m.w1, m.bias ? &m.b1 : nullptr, xs, F1, H);
  const auto act = ref_act(a, fc1, F);
  std::vector<double> h = act;
  if (!probs_on_input) {
    for (double& v : h) v *= p;
  }
  RefRowGrads out;
  // Megatron: with probs between activation and fc2 the fc2 bias is scaled by p too (y = W2 h + p b2).
  const double bias_scale = probs_on_input ? 1.0 : p;
  out.y = ref_linear(m.w2, nullptr, h, H, F);
  if (m.bias) {
    for (int64_t o = 0; o < H; ++o) out.y[o] += bias_scale * m.b2[o];
  }
  // Backward.
  std::vector<double> dh(static_cast<size_t>(F), 0.0);
  for (int64_t o = 0; o < H; ++o) {
    for (int64_t f = 0; f < F; ++f) {
      dh[f] += m.w2[o * F + f] * dy[o];
      g.w2[o * F + f] += dy[o] * h[f];
    }
    if (m.bias) {
      g.b2[o] += bias_scale * dy[o];
      if (!probs_on_input) out.dp += dy[o] * m.b2[o];
    }
  }
  std::vector<double> dact = dh;
  if (!probs_on_input) {
    for (int64_t f = 0; f < F; ++f) {
      out.dp += dh[f] * act[f];
      dact[f] = dh[f] * p;
    }
  }
  const auto dfc1 = ref_act_backward(a, dact, fc1, F);
  std::vector<double> dxs(static_cast<size_t>(H), 0.0);
  for (int64_t o = 0; o < F1; ++o) {
    for (int64_t i = 0; i < H; ++i) {
      dxs[i] += m.w1[o * H + i] * dfc1[o];
      g.w1[o * H + i] += dfc1[o] * xs[i];
    }
    if (m.bias) g.b1[o] += dfc1[o];
  }
  out.dx = dxs;
  if (probs_on_input) {
    for (int64_t i = 0; i < H; ++i) {
      out.dp += dxs[i] * x[i];
      out.dx[i] = dxs[i] * p;
    }
  }
  return out;
}

RefMLP zero_like(const RefMLP& m) {
  RefMLP z;
  z.w1.assign(m.w1.size(), 0.0);
  z.b1.assign(m.b1.size(), 0.0);
  z.w2.assign(m.w2.size(), 0.0);
  z.b2.assign(m.b2.size(), 0.0);
  z.bias = m.bias;
  return z;
}

// ---- helpers ----------------------------------------------------------------------------------------------------

struct ExpertSetup {
  ModelConfig model;
  MoEConfig moe;
};

ExpertSetup make_setup(const Activation a, const bool bias, const bool probs_on_input, const bool grouped,
                       const int64_t num_experts = static_cast<int64_t>(kTokensPerExpert.size())) {
  ExpertSetup s;
  s.model.num_layers = 4;
  s.model.hidden_size = kH;
  s.model.ffn_hidden_size = 2 * kF;
  s.model.activation = a;
  s.model.add_bias_linear = bias;
  s.moe.num_experts = num_experts;
  s.moe.ffn_hidden_size = kF;
  s.moe.topk = probs_on_input ? 1 : 2;
  s.moe.apply_probs_on_input = probs_on_input;
  s.moe.grouped_gemm = grouped;
  s.moe.shared_expert_intermediate_size = 16;
  return s;
}

Param* find_or_null(ParamStore& params, const std::string& name) {
  for (Param& p : params) {
    if (p.name == name) return &p;
  }
  return nullptr;
}

// Fills every value and gradient with reproducible random numbers (gradients nonzero to check accumulation).
void randomize(ParamStore& params, const uint64_t seed) {
  uint64_t s = seed;
  for (Param& p : params) {
    const auto v = random_vector<float>(static_cast<size_t>(p.value.numel()), ++s, -0.4f, 0.4f);
    std::copy(v.begin(), v.end(), p.value.data<float>());
    const auto g = random_vector<float>(static_cast<size_t>(p.grad.numel()), ++s);
    std::copy(g.begin(), g.end(), p.grad.data<float>());
  }
}

std::vector<double> to_double(const Tensor& t) {
  return std::vector<double>(t.data<float>(), t.data<float>() + t.numel());
}

// |got - want| <= atol + rtol * |want| for every element.
void expect_close(const float* got, const std::vector<double>& want, const double rtol, const double atol,
                  const std::string& what) {
  int reported = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    const double err = std::abs(static_cast<double>(got[i]) - want[i]);
    if (err > atol + rtol * std::abs(want[i]) && reported++ < 3) {
      ADD_FAILURE() << what << "[" << i << "]: got " << got[i] << " want " << want[i];
    }
  }
}

struct ExpertRun {
  std::vector<float> y, dx, dprobs;
  std::map<std::string, std::vector<float>> grads;
};

struct ExpertInputs {
  std::vector<int64_t> tokens_per_expert;
  std::vector<float> x, probs, dy, dx0;
  int64_t R = 0;
};

ExpertInputs make_inputs(const uint64_t seed, const std::vector<int64_t>& tokens_per_expert = kTokensPerExpert) {
  ExpertInputs in;
  in.tokens_per_expert = tokens_per_expert;
  for (const int64_t n : tokens_per_expert) in.R += n;
  in.x = random_vector<float>(static_cast<size_t>(in.R * kH), seed);
  in.probs = random_vector<float>(static_cast<size_t>(in.R), seed + 1, 0.05f, 1.0f);
  in.dy = random_vector<float>(static_cast<size_t>(in.R * kH), seed + 2);
  in.dx0 = random_vector<float>(static_cast<size_t>(in.R * kH), seed + 3);
  return in;
}

ExpertRun run_experts(const ExpertSetup& s, ParamStore& params, ExpertMLP& experts, const ExpertInputs& in) {
  ExpertRun run;
  run.y.assign(static_cast<size_t>(in.R * kH), 7.0f);  // overwritten
  ExpertActivations saved;
  const Tensor y = experts.forward(view(in.x, kH), view(in.probs, 1).view({in.R}), in.tokens_per_expert, saved);
  std::copy_n(y.data<float>(), y.numel(), run.y.begin());
  run.dx = in.dx0;
  run.dprobs.assign(static_cast<size_t>(in.R), 123.0f);  // overwritten
  experts.backward(ref(view(run.dx, kH)), ref(view(run.dprobs, 1).view({in.R})), view(in.dy, kH), saved);
  (void)s;
  for (Param& p : params)
    run.grads[p.name] = std::vector<float>(p.grad.data<float>(), p.grad.data<float>() + p.grad.numel());
  return run;
}

std::string expert_name(const int64_t e, const std::string& leaf) {
  return "decoder.layers.1.mlp.experts.local_experts." + std::to_string(e) + "." + leaf;
}

// The double reference of every expert's rows: outputs, dx (on top of in.dx0), dprobs and each expert's gradients.
struct ReferenceRun {
  std::vector<double> y, dx, dprobs;
  std::vector<RefMLP> grads;
};

ReferenceRun reference_run(ParamStore& params, const Activation a, const bool bias, const bool poi,
                           const ExpertInputs& in) {
  const int64_t E = static_cast<int64_t>(in.tokens_per_expert.size());
  std::vector<RefMLP> mlps(static_cast<size_t>(E));
  ReferenceRun ref;
  ref.grads.resize(static_cast<size_t>(E));
  for (int64_t e = 0; e < E; ++e) {
    RefMLP& m = mlps[e];
    m.bias = bias;
    m.w1 = to_double(find_or_null(params, expert_name(e, "linear_fc1.weight"))->value);
    m.w2 = to_double(find_or_null(params, expert_name(e, "linear_fc2.weight"))->value);
    if (bias) {
      m.b1 = to_double(find_or_null(params, expert_name(e, "linear_fc1.bias"))->value);
      m.b2 = to_double(find_or_null(params, expert_name(e, "linear_fc2.bias"))->value);
    }
    ref.grads[e] = zero_like(m);
  }
  int64_t r = 0;
  for (int64_t e = 0; e < E; ++e) {
    for (int64_t j = 0; j < in.tokens_per_expert[e]; ++j, ++r) {
      const std::vector<double> x(in.x.begin() + r * kH, in.x.begin() + (r + 1) * kH);
      const std::vector<double> dy(in.dy.begin() + r * kH, in.dy.begin() + (r + 1) * kH);
      const RefRowGrads row = ref_row(mlps[e], ref.grads[e], a, poi, kH, kF, x, in.probs[r], dy);
      ref.y.insert(ref.y.end(), row.y.begin(), row.y.end());
      for (int64_t h = 0; h < kH; ++h) ref.dx.push_back(in.dx0[r * kH + h] + row.dx[h]);
      ref.dprobs.push_back(row.dp);
    }
  }
  return ref;
}

// A run against the reference (gradients on top of the starting values grad0); idle experts' gradients unchanged.
void expect_matches_reference(const ExpertRun& run, const ReferenceRun& ref,
                              const std::map<std::string, std::vector<float>>& grad0, const ExpertInputs& in,
                              const bool bias, const std::string& impl) {
  expect_close(run.y.data(), ref.y, 1e-4, 1e-5, impl + "y");
  expect_close(run.dx.data(), ref.dx, 1e-4, 1e-5, impl + "dx");
  expect_close(run.dprobs.data(), ref.dprobs, 1e-4, 1e-5, impl + "dprobs");
  for (int64_t e = 0; e < static_cast<int64_t>(in.tokens_per_expert.size()); ++e) {
    auto check = [&](const std::string& leaf, const std::vector<double>& g) {
      const std::string name = expert_name(e, leaf);
      const std::vector<float>& got = run.grads.at(name);
      const std::vector<float>& start = grad0.at(name);
      std::vector<double> want(g.size());
      for (size_t i = 0; i < g.size(); ++i) want[i] = start[i] + g[i];
      expect_close(got.data(), want, 1e-4, 1e-5, impl + name);
      if (in.tokens_per_expert[e] == 0) {
        EXPECT_EQ(got, start) << impl << name << " of an idle expert changed";
      }
    };
    check("linear_fc1.weight", ref.grads[e].w1);
    check("linear_fc2.weight", ref.grads[e].w2);
    if (bias) {
      check("linear_fc1.bias", ref.grads[e].b1);
      check("linear_fc2.bias", ref.grads[e].b2);
    }
  }
}

// ---- tests ------------------------------------------------------------------------------------------------------

TEST(ExpertsTest, RegistersMegatronNamesShapesAndInits) {
  for (const bool bias : {false, true}) {
    for (const Activation a : {Activation::kSwiGLU, Activation::kGelu}) {
      ExpertSetup s = make_setup(a, bias, false, true);
      ParamStore params;
      auto experts = make_experts(s.moe, s.model, "decoder.layers.1.", params);
      const int64_t E = s.moe.num_experts, F1 = a == Activation::kSwiGLU ? 2 * kF : kF;
      ASSERT_EQ(static_cast<int64_t>(params.size()), E * (bias ? 4 : 2));
      for (int64_t e = 0; e < E; ++e) {
        const Param* w1 = find_or_null(params, expert_name(e, "linear_fc1.weight"));
        const Param* w2 = find_or_null(params, expert_name(e, "linear_fc2.weight"));
        ASSERT_NE(w1, nullptr);
        ASSERT_NE(w2, nullptr);
        EXPECT_EQ(w1->value.shape(), (std::vector<int64_t>{F1, kH}));
        EXPECT_EQ(w2->value.shape(), (std::vector<int64_t>{kH, kF}));
        EXPECT_EQ(w1->init, InitKind::kNormal);
        EXPECT_EQ(w2->init, InitKind::kScaledNormal);
        EXPECT_FALSE(w1->no_weight_decay);
        EXPECT_FALSE(w2->no_weight_decay);
        EXPECT_EQ(w1->grad.shape(), w1->value.shape());
        const Param* b1 = find_or_null(params, expert_name(e, "linear_fc1.bias"));
        const Param* b2 = find_or_null(params, expert_name(e, "linear_fc2.bias"));
        EXPECT_EQ(b1 != nullptr, bias);
        EXPECT_EQ(b2 != nullptr, bias);
        if (bias) {
          EXPECT_EQ(b1->value.shape(), (std::vector<int64_t>{F1}));
          EXPECT_EQ(b2->value.shape(), (std::vector<int64_t>{kH}));
          EXPECT_EQ(b1->init, InitKind::kZeros);
          EXPECT_EQ(b2->init, InitKind::kZeros);
          EXPECT_TRUE(b1->no_weight_decay);
          EXPECT_TRUE(b2->no_weight_decay);
        }
      }
    }
  }
}

// The reference's hand-derived gradients agree with central differences of its own forward.
TEST(ExpertsTest, ReferenceGradientsMatchFiniteDifferences) {
  for (const Activation a : {Activation::kSwiGLU, Activation::kGelu, Activation::kSquaredReLU}) {
    for (const bool poi : {false, true}) {
      RefMLP m;
      m.bias = true;
      const int64_t F1 = a == Activation::kSwiGLU ? 2 * kF : kF;
      m.w1 = test::convert_vector<double>(random_vector<float>(static_cast<size_t>(F1 * kH), 1, -0.4f, 0.4f));
      m.b1 = test::convert_vector<double>(random_vector<float>(static_cast<size_t>(F1), 2, -0.4f, 0.4f));
      m.w2 = test::convert_vector<double>(random_vector<float>(static_cast<size_t>(kH * kF), 3, -0.4f, 0.4f));
      m.b2 = test::convert_vector<double>(random_vector<float>(static_cast<size_t>(kH), 4, -0.4f, 0.4f));
      const auto x = test::convert_vector<double>(random_vector<float>(static_cast<size_t>(kH), 5));
      const auto dy = test::convert_vector<double>(random_vector<float>(static_cast<size_t>(kH), 6));
      const double p = 0.37;
      RefMLP g = zero_like(m);
      const RefRowGrads row = ref_row(m, g, a, poi, kH, kF, x, p, dy);
      auto objective = [&](const RefMLP& mm, const std::vector<double>& xx, const double pp) {
        RefMLP scratch = zero_like(mm);
        const auto y = ref_row(mm, scratch, a, poi, kH, kF, xx, pp, dy).y;
        double s = 0.0;
        for (int64_t o = 0; o < kH; ++o) s += y[o] * dy[o];
        return s;
      };
      const double eps = 1e-6;
      EXPECT_NEAR(row.dp, (objective(m, x, p + eps) - objective(m, x, p - eps)) / (2 * eps), 1e-6);
      for (const int64_t i : {0, 5, 23}) {
        auto xp = x, xm = x;
        xp[i] += eps;
        xm[i] -= eps;
        EXPECT_NEAR(row.dx[i], (objective(m, xp, p) - objective(m, xm, p)) / (2 * eps), 1e-6);
      }
      for (const int64_t i : {int64_t{0}, int64_t{17}, F1 * kH - 1}) {
        RefMLP mp = m, mm = m;
        mp.w1[i] += eps;
        mm.w1[i] -= eps;
        EXPECT_NEAR(g.w1[i], (objective(mp, x, p) - objective(mm, x, p)) / (2 * eps), 1e-6);
      }
      for (const int64_t i : {int64_t{1}, F1 - 1}) {
        RefMLP mp = m, mm = m;
        mp.b1[i] += eps;
        mm.b1[i] -= eps;
        EXPECT_NEAR(g.b1[i], (objective(mp, x, p) - objective(mm, x, p)) / (2 * eps), 1e-6);
      }
      for (const int64_t i : {int64_t{3}, kH * kF - 1}) {
        RefMLP mp = m, mm = m;
        mp.w2[i] += eps;
        mm.w2[i] -= eps;
        EXPECT_NEAR(g.w2[i], (objective(mp, x, p) - objective(mm, x, p)) / (2 * eps), 1e-6);
      }
    }
  }
}

// Both implementations against the double reference, and against each other, for every activation, with and
// without bias, and with probs on the input; experts 1 and 4 get no rows.
TEST(ExpertsTest, GroupedAndSequentialMatchReferenceAndEachOther) {
  for (const Activation a : {Activation::kSwiGLU, Activation::kGelu, Activation::kSquaredReLU}) {
    for (const bool bias : {false, true}) {
      for (const bool poi : {false, true}) {
        SCOPED_TRACE(to_string(a) + (bias ? " bias" : " no-bias") + (poi ? " probs-on-input" : ""));
        const ExpertInputs in = make_inputs(100);
        std::map<bool, ExpertRun> runs;
        std::map<std::string, std::vector<float>> grad0;
        ParamStore ref_params;
        for (const bool grouped : {false, true}) {
          const ExpertSetup s = make_setup(a, bias, poi, grouped);
          ParamStore params;
          auto experts = make_experts(s.moe, s.model, "decoder.layers.1.", params);
          randomize(params, 42);  // same values and starting gradients for both
          if (!grouped) {
            for (const Param& p : params)
              grad0[p.name] = std::vector<float>(p.grad.data<float>(), p.grad.data<float>() + p.grad.numel());
          }
          runs[grouped] = run_experts(s, params, *experts, in);
          if (grouped) ref_params = std::move(params);
        }

        // Grouped == sequential, everywhere.
        const ExpertRun& seq = runs[false];
        const ExpertRun& grp = runs[true];
        auto same = [](const std::vector<float>& u, const std::vector<float>& v, const std::string& what) {
          ASSERT_EQ(u.size(), v.size()) << what;
          for (size_t i = 0; i < u.size(); ++i) {
            ASSERT_NEAR(u[i], v[i], 1e-6 * (1.0 + std::abs(v[i]))) << what << "[" << i << "]";
          }
        };
        same(grp.y, seq.y, "y");
        same(grp.dx, seq.dx, "dx");
        same(grp.dprobs, seq.dprobs, "dprobs");
        for (const auto& [name, g] : seq.grads) same(grp.grads.at(name), g, name);

        const ReferenceRun ref = reference_run(ref_params, a, bias, poi, in);
        for (const auto& [grouped, run] : runs) {
          expect_matches_reference(run, ref, grad0, in, bias, grouped ? "grouped " : "sequential ");
        }
      }
    }
  }
}

// --no-moe-memory-efficient-permutation: the probability scales the experts' output, p (W2 act(W1 x + b1) + b2),
// the same function as the default W2 (act p) + p b2, so both implementations match the same double reference.
TEST(ExpertsTest, ProbabilitiesOnTheOutputMatchTheReference) {
  for (const Activation a : {Activation::kSwiGLU, Activation::kGelu}) {
    for (const bool bias : {false, true}) {
      for (const bool grouped : {false, true}) {
        SCOPED_TRACE(to_string(a) + (bias ? " bias" : " no-bias") + (grouped ? " grouped" : " sequential"));
        const ExpertInputs in = make_inputs(100);
        ExpertSetup s = make_setup(a, bias, false, grouped);
        s.moe.memory_efficient_permutation = false;
        ParamStore params;
        auto experts = make_experts(s.moe, s.model, "decoder.layers.1.", params);
        randomize(params, 42);
        std::map<std::string, std::vector<float>> grad0;
        for (const Param& p : params)
          grad0[p.name] = std::vector<float>(p.grad.data<float>(), p.grad.data<float>() + p.grad.numel());
        const ExpertRun run = run_experts(s, params, *experts, in);
        const ReferenceRun ref = reference_run(params, a, bias, false, in);
        expect_matches_reference(run, ref, grad0, in, bias, grouped ? "grouped " : "sequential ");
      }
    }
  }
}

// Experts with more rows than one tile (GroupedMLP cuts them into tiles of at most 256 rows) next to small and idle
// ones: the double reference's result, and bit for bit the same on 1 and 2 threads (tiles depend on the routing
// only, and every output has one writer).
TEST(ExpertsTest, GroupedSplitsBigExpertsIntoTilesIndependentlyOfThreads) {
  const std::vector<int64_t> tokens{600, 3, 0, 257, 40};
  const int threads = omp_get_max_threads();
  for (const Activation a : {Activation::kSwiGLU, Activation::kGelu}) {
    for (const bool bias : {false, true}) {
      for (const bool poi : {false, true}) {
        SCOPED_TRACE(to_string(a) + (bias ? " bias" : " no-bias") + (poi ? " probs-on-input" : ""));
        const ExpertSetup s = make_setup(a, bias, poi, true, static_cast<int64_t>(tokens.size()));
        const ExpertInputs in = make_inputs(200, tokens);
        std::map<int, ExpertRun> runs;
        ParamStore params;
        std::map<std::string, std::vector<float>> grad0;
        for (const int n : {1, 2}) {
          params = ParamStore();
          auto experts = make_experts(s.moe, s.model, "decoder.layers.1.", params);
          randomize(params, 43);
          for (const Param& p : params)
            grad0[p.name] = std::vector<float>(p.grad.data<float>(), p.grad.data<float>() + p.grad.numel());
          omp_set_num_threads(n);
          runs[n] = run_experts(s, params, *experts, in);
          omp_set_num_threads(threads);
        }
        EXPECT_EQ(runs[1].y, runs[2].y);
        EXPECT_EQ(runs[1].dx, runs[2].dx);
        EXPECT_EQ(runs[1].dprobs, runs[2].dprobs);
        EXPECT_EQ(runs[1].grads, runs[2].grads);
        expect_matches_reference(runs[2], reference_run(params, a, bias, poi, in), grad0, in, bias, "grouped ");
      }
    }
  }
}

// ---- --delay-wgrad-compute ----------------------------------------------------------------------------------------

// The gradients of every parameter.
std::map<std::string, std::vector<float>> grads_of(const ParamStore& params) {
  std::map<std::string, std::vector<float>> out;
  for (const Param& p : params)
    out[p.name] = std::vector<float>(p.grad.data<float>(), p.grad.data<float>() + p.grad.numel());
  return out;
}

// fp32 values of a tensor of any floating dtype.
std::vector<float> values_of(const Tensor& t) {
  Tensor f32({t.numel()}, DType::kF32);
  ops::convert(f32, t.view({t.numel()}));
  return std::vector<float>(f32.data<float>(), f32.data<float>() + f32.numel());
}

// A forward and backward of `experts` with activations in the storage dtype of the live precision scope, the weight
// gradients deferred or not. A deferred callable runs after the scopes `scoped` opens have closed, with the caller's
// dy dropped (it keeps its own), once the data gradients are checked to leave every parameter gradient as it was.
template <typename Scopes>
ExpertRun run_deferrable(const ParamStore& params, ExpertMLP& experts, const ExpertInputs& in, const bool defer,
                         const Scopes& scoped) {
  ExpertRun run;
  std::function<void()> deferred;
  ExpertActivations saved;
  Tensor dx, dprobs;
  {
    const auto scopes = scoped();
    const DType storage = ops::activation_storage_dtype();
    const auto stored = [&](const std::vector<float>& v) {
      Tensor t({in.R, kH}, storage);
      ops::convert(t, view(v, kH));
      return t;
    };
    const Tensor x = stored(in.x), probs = view(in.probs, 1).view({in.R}).clone();
    Tensor dy = stored(in.dy);
    dx = stored(in.dx0);
    dprobs = Tensor({in.R}, DType::kF32);
    for (float& v : dprobs.span<float>()) v = 123.0f;  // overwritten
    run.y = values_of(experts.forward(x, probs, in.tokens_per_expert, saved));
    const std::map<std::string, std::vector<float>> before = grads_of(params);
    experts.backward(dx, dprobs, dy, saved, defer ? &deferred : nullptr);
    if (defer) {
      EXPECT_TRUE(static_cast<bool>(deferred));
      EXPECT_EQ(grads_of(params), before) << "the data gradients changed a parameter gradient";
    }
  }
  if (deferred) deferred();
  run.dx = values_of(dx);
  run.dprobs = values_of(dprobs);
  run.grads = grads_of(params);
  return run;
}

// The precisions the grouped experts' backward is checked in: fp32, bf16 as rounded fp32 activations and as bf16
// ones, FP8 (the per-expert path), FP8 on bf16 activations.
struct PrecisionMode {
  std::string name;
  DType activation;
  ops::ActivationStorage storage;
  bool quantized;

  // The scopes of a run in this mode, for run_deferrable.
  auto scopes(const quant::QuantizedLinearConfig& fp8) const {
    return [this, &fp8] {
      return std::pair{std::make_unique<ops::ScopedActivationDType>(activation, Device::kCPU, storage),
                       std::make_unique<ops::ScopedLinearQuantization>(quantized ? &fp8 : nullptr)};
    };
  }
};

const std::vector<PrecisionMode> kPrecisionModes = {{"fp32", DType::kF32, ops::ActivationStorage::kF32, false},
                                                    {"bf16 in fp32", DType::kBF16, ops::ActivationStorage::kF32, false},
                                                    {"bf16", DType::kBF16, ops::ActivationStorage::k16Bit, false},
                                                    {"fp8", DType::kF32, ops::ActivationStorage::kF32, true},
                                                    {"fp8 bf16", DType::kBF16, ops::ActivationStorage::k16Bit, true}};

// GroupedMLP with its weight gradients deferred (run later, outside the backward's scopes) gives the undeferred
// backward's dx, dprobs and parameter gradients bit for bit: in fp32, in bf16 (rounded fp32 activations and bf16
// ones: the fused op in its parts) and under FP8 (the per-expert path, its weight-gradient loop deferred), with the
// probability after the activation or on the input, with and without memory-efficient permutation.
TEST(ExpertsTest, DeferredWeightGradientsAreTheUndeferredOnesBitForBit) {
  const quant::QuantizedLinearConfig fp8;
  for (const PrecisionMode& mode : kPrecisionModes) {
    for (const Activation a : {Activation::kSwiGLU, Activation::kGelu}) {
      for (const bool poi : {false, true}) {
        for (const bool efficient : {true, false}) {
          if (poi && !efficient) continue;  // the probabilities are on the output there
          SCOPED_TRACE(mode.name + " " + to_string(a) + (poi ? " probs-on-input" : "") +
                       (efficient ? "" : " no-memory-efficient-permutation"));
          ExpertSetup s = make_setup(a, true, poi, true);
          s.moe.memory_efficient_permutation = efficient;
          const ExpertInputs in = make_inputs(300);
          std::map<bool, ExpertRun> runs;
          for (const bool defer : {false, true}) {
            ParamStore params;
            auto experts = make_experts(s.moe, s.model, "decoder.layers.1.", params);
            randomize(params, 44);
            runs[defer] = run_deferrable(params, *experts, in, defer, mode.scopes(fp8));
          }
          EXPECT_EQ(runs[true].y, runs[false].y);
          EXPECT_EQ(runs[true].dx, runs[false].dx);
          EXPECT_EQ(runs[true].dprobs, runs[false].dprobs);
          EXPECT_EQ(runs[true].grads, runs[false].grads);
        }
      }
    }
  }
}

// Param::grad_zero (set by the step's zero_grad): the grouped experts' first backward writes the weight gradients
// instead of adding to them and clears the flags of every expert with rows (an idle expert keeps its flag and its zero
// gradient), so a second micro-batch adds to what the first wrote. Two micro-batches from zeroed gradients with the
// flags set give the gradients of the same two without them, bit for bit: fp32, bf16 in fp32 and in bf16 (the native
// path's overwrite), FP8 (the per-expert path, which only clears them), the weight gradients deferred or not.
TEST(ExpertsTest, GradientsKnownZeroAreWrittenOnceThenAccumulated) {
  const quant::QuantizedLinearConfig fp8;
  for (const PrecisionMode& mode : kPrecisionModes) {
    for (const bool defer : {false, true}) {
      SCOPED_TRACE(mode.name + (defer ? " deferred" : ""));
      const ExpertSetup s = make_setup(Activation::kSwiGLU, true, false, true);
      const ExpertInputs in = make_inputs(300);
      std::map<bool, ExpertRun> runs;
      for (const bool flagged : {false, true}) {
        ParamStore params;
        auto experts = make_experts(s.moe, s.model, "decoder.layers.1.", params);
        randomize(params, 45);
        for (Param& p : params) {
          p.grad.zero_();
          p.grad_zero = flagged;
        }
        const auto scopes = mode.scopes(fp8);
        run_deferrable(params, *experts, in, defer, scopes);
        for (int64_t e = 0; e < static_cast<int64_t>(in.tokens_per_expert.size()); ++e) {
          const bool idle = in.tokens_per_expert[static_cast<size_t>(e)] == 0;
          for (const std::string leaf :
               {"linear_fc1.weight", "linear_fc1.bias", "linear_fc2.weight", "linear_fc2.bias"}) {
            const Param* p = find_or_null(params, expert_name(e, leaf));
            ASSERT_NE(p, nullptr);
            EXPECT_EQ(p->grad_zero, flagged && idle) << p->name << (idle ? " (idle)" : "");
          }
        }
        runs[flagged] = run_deferrable(params, *experts, in, defer, scopes);
      }
      EXPECT_EQ(runs[true].grads, runs[false].grads);
    }
  }
}

// SequentialMLP refuses to defer its weight gradients (the configuration needs --moe-grouped-gemm), before it
// computes anything.
TEST(ExpertsTest, SequentialExpertsRefuseToDeferWeightGradients) {
  const ExpertSetup s = make_setup(Activation::kSwiGLU, false, false, false);
  ParamStore params;
  auto experts = make_experts(s.moe, s.model, "decoder.layers.1.", params);
  randomize(params, 9);
  const ExpertInputs in = make_inputs(11);
  ExpertActivations saved;
  experts->forward(view(in.x, kH), view(in.probs, 1).view({in.R}), in.tokens_per_expert, saved);
  std::vector<float> dx = in.dx0, dprobs(static_cast<size_t>(in.R), 123.0f);
  const std::map<std::string, std::vector<float>> before = grads_of(params);
  std::function<void()> deferred;
  try {
    experts->backward(ref(view(dx, kH)), ref(view(dprobs, 1).view({in.R})), view(in.dy, kH), saved, &deferred);
    ADD_FAILURE() << "SequentialMLP deferred its weight gradients";
  } catch (const std::logic_error& e) {
    EXPECT_STREQ(e.what(), "deferred weight gradients need the grouped experts (--moe-grouped-gemm)");
  }
  EXPECT_FALSE(static_cast<bool>(deferred));
  EXPECT_EQ(dx, in.dx0);
  EXPECT_EQ(dprobs, std::vector<float>(static_cast<size_t>(in.R), 123.0f));
  EXPECT_EQ(grads_of(params), before);
}

// Zero-row experts with zero starting gradients: their gradients are present, the right shape, and exactly zero.
TEST(ExpertsTest, IdleExpertsKeepPresentZeroGradients) {
  for (const bool grouped : {false, true}) {
    const ExpertSetup s = make_setup(Activation::kSwiGLU, true, false, grouped);
    ParamStore params;
    auto experts = make_experts(s.moe, s.model, "decoder.layers.1.", params);
    randomize(params, 5);
    for (Param& p : params) p.grad.zero_();
    const ExpertInputs in = make_inputs(7);
    run_experts(s, params, *experts, in);
    for (const int64_t e : {1, 4}) {
      for (const std::string leaf : {"linear_fc1.weight", "linear_fc1.bias", "linear_fc2.weight", "linear_fc2.bias"}) {
        const Param* p = find_or_null(params, expert_name(e, leaf));
        ASSERT_NE(p, nullptr);
        ASSERT_TRUE(p->grad.defined());
        EXPECT_EQ(p->grad.shape(), p->value.shape());
        for (const float g : p->grad.span<const float>()) ASSERT_EQ(g, 0.0f) << leaf;
      }
    }
    const Param* busy = find_or_null(params, expert_name(2, "linear_fc1.weight"));
    double norm = 0.0;
    for (const float g : busy->grad.span<const float>()) norm += std::abs(g);
    EXPECT_GT(norm, 0.0);
  }
}

TEST(ExpertsTest, ParametersAreExpertParametersOfTheirModule) {
  ExpertSetup s = make_setup(Activation::kSwiGLU, true, false, false);
  ParamStore params;
  auto experts =
      make_experts(s.moe, s.model, "decoder.layers.1.", params, parallel::ParallelState::single_process(), 1);
  ASSERT_FALSE(params.empty());
  for (const Param& p : params) {
    EXPECT_TRUE(p.is_expert) << p.name;
    EXPECT_FALSE(p.grad_sum_over_tp) << p.name;
    EXPECT_EQ(p.module, 1) << p.name;
    EXPECT_EQ(p.shard.full_shape, p.value.shape()) << p.name;  // one process: whole tensors
  }
}

TEST(ExpertsTest, BadInputThrows) {
  ExpertSetup s = make_setup(Activation::kGelu, false, false, true);
  ParamStore params;
  auto experts = make_experts(s.moe, s.model, "decoder.layers.1.", params);
  std::vector<float> x(kH), p(1, 1.0f);
  ExpertActivations saved;
  EXPECT_THROW(experts->forward(view(x, kH), view(p, 1).view({1}), {1, 0}, saved), std::invalid_argument);
  EXPECT_THROW(experts->forward(view(x, kH), view(p, 1).view({1}), {1, 0, 0, 0, -1, 1}, saved), std::invalid_argument);
  s.moe.ffn_hidden_size = 0;
  ParamStore more;
  EXPECT_THROW(make_experts(s.moe, s.model, "x.", more), ConfigError);
}

// ---- shared experts ---------------------------------------------------------------------------------------------

TEST(SharedExpertsTest, RegistersParameters) {
  for (const bool gate : {false, true}) {
    ExpertSetup s = make_setup(Activation::kSwiGLU, false, false, false);
    s.moe.shared_expert_gate = gate;
    ParamStore params;
    SharedExpertMLP shared(s.moe, s.model, "decoder.layers.1.", params);
    ASSERT_EQ(params.size(), gate ? 3u : 2u);
    const Param* w1 = find_or_null(params, "decoder.layers.1.mlp.shared_experts.linear_fc1.weight");
    const Param* w2 = find_or_null(params, "decoder.layers.1.mlp.shared_experts.linear_fc2.weight");
    ASSERT_NE(w1, nullptr);
    ASSERT_NE(w2, nullptr);
    EXPECT_EQ(w1->value.shape(), (std::vector<int64_t>{32, kH}));
    EXPECT_EQ(w2->value.shape(), (std::vector<int64_t>{kH, 16}));
    EXPECT_EQ(w1->init, InitKind::kNormal);
    EXPECT_EQ(w2->init, InitKind::kScaledNormal);
    const Param* wg = find_or_null(params, "decoder.layers.1.mlp.shared_experts.gate_weight");
    EXPECT_EQ(wg != nullptr, gate);
    if (gate) {
      EXPECT_EQ(wg->value.shape(), (std::vector<int64_t>{1, kH}));
      EXPECT_EQ(wg->init, InitKind::kNormal);
      EXPECT_TRUE(wg->grad_sum_over_tp);  // replicated over TP, each TP rank sees its sequence shard
    }
    EXPECT_FALSE(w1->grad_sum_over_tp);
    EXPECT_FALSE(w1->is_expert);
  }
}

// Megatron's SharedExpertMLP asserts add_bias_linear == False (shared_experts.py): a MoE layer with shared experts
// and --add-bias-linear is refused with one line naming the flags.
TEST(SharedExpertsTest, MoELayerRefusesLinearBias) {
  ExpertSetup s = make_setup(Activation::kGelu, true, false, false);
  s.model.moe = s.moe;
  s.model.moe.moe_layer_pattern = std::vector<bool>(static_cast<size_t>(s.model.num_layers), true);
  ParamStore params;
  try {
    MoELayer layer(s.model, "decoder.layers.0.", params, parallel::ParallelState::single_process(), 0);
    ADD_FAILURE() << "no ConfigError for shared experts with --add-bias-linear";
  } catch (const ConfigError& e) {
    EXPECT_STREQ(e.what(),
                 "--moe-shared-expert-intermediate-size requires --disable-bias-linear: shared experts have no bias "
                 "(as Megatron)");
  }
  s.model.add_bias_linear = false;
  ParamStore no_bias_params;
  EXPECT_NO_THROW(MoELayer(s.model, "decoder.layers.0.", no_bias_params, parallel::ParallelState::single_process(), 0));
}

TEST(SharedExpertsTest, MatchesReferenceWithAndWithoutGate) {
  const int64_t T = 13, S = 16;
  for (const Activation a : {Activation::kSwiGLU, Activation::kGelu, Activation::kSquaredReLU}) {
    for (const bool gate : {false, true}) {
      SCOPED_TRACE(to_string(a) + (gate ? " gate" : " no gate"));
      // SharedExpertMLP itself ignores add_bias_linear (no bias); MoELayer refuses the combination (next test).
      ExpertSetup s = make_setup(a, true, false, false);
      s.moe.shared_expert_gate = gate;
      ParamStore params;
      SharedExpertMLP shared(s.moe, s.model, "decoder.layers.1.", params);
      randomize(params, 77);
      std::map<std::string, std::vector<float>> grad0;
      for (const Param& p : params)
        grad0[p.name] = std::vector<float>(p.grad.data<float>(), p.grad.data<float>() + p.grad.numel());
      const auto x = random_vector<float>(static_cast<size_t>(T * kH), 1);
      const auto out0 = random_vector<float>(static_cast<size_t>(T * kH), 2);
      const auto dout = random_vector<float>(static_cast<size_t>(T * kH), 3);
      const auto dx0 = random_vector<float>(static_cast<size_t>(T * kH), 4);
      auto out = out0;
      SharedExpertActivations saved;
      shared.forward(ref(view(out, kH)), view(x, kH), saved);
      auto dx = dx0;
      shared.backward(ref(view(dx, kH)), view(dout, kH), view(x, kH), saved);

      const std::string pre = "decoder.layers.1.mlp.shared_experts.";
      RefMLP m;
      m.w1 = to_double(find_or_null(params, pre + "linear_fc1.weight")->value);
      m.w2 = to_double(find_or_null(params, pre + "linear_fc2.weight")->value);
      RefMLP g = zero_like(m);
      std::vector<double> wg(static_cast<size_t>(kH), 0.0), dwg(static_cast<size_t>(kH), 0.0);
      if (gate) wg = to_double(find_or_null(params, pre + "gate_weight")->value);
      std::vector<double> out_ref, dx_ref;
      for (int64_t t = 0; t < T; ++t) {
        const std::vector<double> xt(x.begin() + t * kH, x.begin() + (t + 1) * kH);
        std::vector<double> dyt(dout.begin() + t * kH, dout.begin() + (t + 1) * kH);
        double gt = 1.0, z = 0.0;
        if (gate) {
          for (int64_t h = 0; h < kH; ++h) z += xt[h] * wg[h];
          gt = sigmoid(z);
        }
        // out = g * mlp(x): the MLP sees dy * g (prob 1, no bias).
        std::vector<double> dmlp = dyt;
        for (double& v : dmlp) v *= gt;
        RefMLP scratch = zero_like(m);
        const RefRowGrads plain = ref_row(m, scratch, a, false, kH, S, xt, 1.0, dyt);  // mlp(x) itself
        const RefRowGrads row = ref_row(m, g, a, false, kH, S, xt, 1.0, dmlp);
        std::vector<double> dxt = row.dx;
        if (gate) {
          double dg = 0.0;
          for (int64_t h = 0; h < kH; ++h) dg += dyt[h] * plain.y[h];
          const double dz = dg * gt * (1.0 - gt);
          for (int64_t h = 0; h < kH; ++h) {
            dxt[h] += dz * wg[h];
            dwg[h] += dz * xt[h];
          }
        }
        for (int64_t h = 0; h < kH; ++h) {
          out_ref.push_back(out0[t * kH + h] + gt * plain.y[h]);
          dx_ref.push_back(dx0[t * kH + h] + dxt[h]);
        }
      }
      expect_close(out.data(), out_ref, 1e-4, 1e-5, "out");
      expect_close(dx.data(), dx_ref, 1e-4, 1e-5, "dx");
      auto check = [&](const std::string& leaf, const std::vector<double>& d) {
        const Param* p = find_or_null(params, pre + leaf);
        const std::vector<float>& start = grad0.at(pre + leaf);
        std::vector<double> want(d.size());
        for (size_t i = 0; i < d.size(); ++i) want[i] = start[i] + d[i];
        expect_close(p->grad.data<float>(), want, 1e-4, 1e-5, leaf);
      };
      check("linear_fc1.weight", g.w1);
      check("linear_fc2.weight", g.w2);
      if (gate) check("gate_weight", dwg);
    }
  }
}

}  // namespace
}  // namespace moecore
