// AdamW: a two-step sequence computed here from torch.optim.AdamW's update written out in double, the first-step
// identity (update = lr * g / (|g| + eps) without decay), fast kernel vs the naive reference, and step validation.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <vector>

#include "moecore/kernels/cpu/adamw.h"
#include "moecore/kernels/cpu/convert.h"
#include "moecore/tensor/dtype.h"
#include "unit/kernel_test_util.h"

namespace moecore::kernels {
namespace {

using test::max_rel_error;
using test::random_vector;

struct State {
  std::vector<double> param, exp_avg, exp_avg_sq;
};

// torch.optim.AdamW single-tensor step, in torch's order of operations.
void torch_adamw_step(State& s, const std::vector<double>& grad, const AdamWHyper& hp) {
  const double bias_correction1 = 1.0 - std::pow(hp.beta1, static_cast<double>(hp.step));
  const double bias_correction2 = 1.0 - std::pow(hp.beta2, static_cast<double>(hp.step));
  const double step_size = hp.lr / bias_correction1;
  const double bias_correction2_sqrt = std::sqrt(bias_correction2);
  for (size_t i = 0; i < grad.size(); ++i) {
    s.param[i] *= 1.0 - hp.lr * hp.weight_decay;
    s.exp_avg[i] += (grad[i] - s.exp_avg[i]) * (1.0 - hp.beta1);  // lerp_(grad, 1 - beta1)
    s.exp_avg_sq[i] = s.exp_avg_sq[i] * hp.beta2 + (1.0 - hp.beta2) * grad[i] * grad[i];
    const double denom = std::sqrt(s.exp_avg_sq[i]) / bias_correction2_sqrt + hp.eps;
    s.param[i] -= step_size * s.exp_avg[i] / denom;
  }
}

template <typename T, bool kFast>
void step(std::vector<T>& param, const std::vector<T>& grad, std::vector<T>& exp_avg, std::vector<T>& exp_avg_sq,
          const AdamWHyper& hp) {
  const auto n = static_cast<int64_t>(param.size());
  if constexpr (kFast) {
    cpu::adamw_step(param.data(), grad.data(), exp_avg.data(), exp_avg_sq.data(), n, hp);
  } else {
    ref::adamw_step(param.data(), grad.data(), exp_avg.data(), exp_avg_sq.data(), n, hp);
  }
}

template <typename T, bool kFast>
void expect_two_steps_match_torch_formula(double tol) {
  const std::vector<double> p0 = {0.5, -1.25, 2.0};
  const std::vector<std::vector<double>> grads = {{0.1, -0.3, 0.02}, {-0.2, 0.4, 0.05}};
  AdamWHyper hp;
  hp.lr = 0.01;
  hp.beta1 = 0.9;
  hp.beta2 = 0.95;
  hp.eps = 1e-8;
  hp.weight_decay = 0.1;
  State expected{p0, {0, 0, 0}, {0, 0, 0}};
  std::vector<T> param(p0.begin(), p0.end()), exp_avg(3, T(0)), exp_avg_sq(3, T(0));
  for (int64_t s = 1; s <= 2; ++s) {
    hp.step = s;
    const std::vector<T> grad(grads[s - 1].begin(), grads[s - 1].end());
    torch_adamw_step(expected, grads[s - 1], hp);
    step<T, kFast>(param, grad, exp_avg, exp_avg_sq, hp);
    for (size_t i = 0; i < 3; ++i) {
      EXPECT_NEAR(param[i], expected.param[i], tol * std::abs(expected.param[i])) << "step " << s << " i " << i;
      EXPECT_NEAR(exp_avg[i], expected.exp_avg[i], tol * std::abs(expected.exp_avg[i]));
      EXPECT_NEAR(exp_avg_sq[i], expected.exp_avg_sq[i], tol * std::abs(expected.exp_avg_sq[i]));
    }
  }
}

TEST(AdamWTest, TwoStepsMatchTorchFormula) {
  expect_two_steps_match_torch_formula<double, true>(1e-14);
  expect_two_steps_match_torch_formula<double, false>(1e-14);
  expect_two_steps_match_torch_formula<float, true>(1e-6);
  expect_two_steps_match_torch_formula<float, false>(1e-6);
}

// On step 1 the bias-corrected moments are g and g^2, so without weight decay p moves by lr * g / (|g| + eps).
TEST(AdamWTest, FirstStepMovesByLrTimesSign) {
  const std::vector<double> grad = {0.3, -2.0, 1e-3};
  std::vector<double> param = {1.0, 2.0, 3.0}, exp_avg(3, 0.0), exp_avg_sq(3, 0.0);
  AdamWHyper hp;
  hp.lr = 0.05;
  step<double, true>(param, grad, exp_avg, exp_avg_sq, hp);
  const std::vector<double> p0 = {1.0, 2.0, 3.0};
  for (size_t i = 0; i < 3; ++i) EXPECT_NEAR(param[i], p0[i] - hp.lr * grad[i] / (std::abs(grad[i]) + hp.eps), 1e-15);
}

template <typename T>
void expect_cpu_matches_ref(double tol) {
  const int64_t n = 100003;
  std::vector<T> p_fast = random_vector<T>(n, 1), m_fast = random_vector<T>(n, 2, T(-0.1), T(0.1));
  std::vector<T> v_fast = random_vector<T>(n, 3, T(0), T(0.01));
  std::vector<T> p_ref = p_fast, m_ref = m_fast, v_ref = v_fast;
  AdamWHyper hp;
  hp.lr = 3e-3;
  hp.weight_decay = 0.05;
  for (int64_t s = 1; s <= 5; ++s) {
    hp.step = s;
    const std::vector<T> grad = random_vector<T>(n, 10 + s);
    step<T, true>(p_fast, grad, m_fast, v_fast, hp);
    step<T, false>(p_ref, grad, m_ref, v_ref, hp);
  }
  // m = b1 m + (1 - b1) g cancels to values far below its summands (|m| <= ~0.5): judge it at their scale.
  EXPECT_LT(max_rel_error(p_fast, p_ref, 1e-3), tol);
  EXPECT_LT(max_rel_error(m_fast, m_ref, 0.05), tol);
  EXPECT_LT(max_rel_error(v_fast, v_ref, 1e-5), tol);
}

TEST(AdamWTest, CpuMatchesRefFloat) { expect_cpu_matches_ref<float>(1e-5); }
TEST(AdamWTest, CpuMatchesRefDouble) { expect_cpu_matches_ref<double>(1e-12); }

TEST(AdamWTest, StepZeroThrows) {
  std::vector<float> p(4, 1.0f), g(4, 1.0f), m(4, 0.0f), v(4, 0.0f);
  AdamWHyper hp;
  hp.step = 0;
  EXPECT_THROW(cpu::adamw_step(p.data(), g.data(), m.data(), v.data(), 4, hp), std::invalid_argument);
  EXPECT_THROW(ref::adamw_step(p.data(), g.data(), m.data(), v.data(), 4, hp), std::invalid_argument);
}

// grad_scale is the gradients scaled first (clipping), and `model` the updated parameters copied and rounded, bit
// for bit, on both kernel sets.
template <bool kFast>
void expect_fused_clip_and_model_copy() {
  constexpr int64_t n = 70001;  // several chunks and threads, a ragged end
  const std::vector<float> grad = random_vector<float>(n, 61, -3.0f, 3.0f);
  const std::vector<float> p0 = random_vector<float>(n, 62), m0 = random_vector<float>(n, 63);
  const std::vector<float> v0 = random_vector<float>(n, 64, 0.0f, 1.0f);
  AdamWHyper hp;
  hp.lr = 1e-2;
  hp.weight_decay = 0.1;
  hp.step = 4;
  for (const auto rounding : {ActivationRounding::kNone, ActivationRounding::kBF16, ActivationRounding::kF16}) {
    std::vector<float> scaled = grad;
    for (float& g : scaled) g *= 0.3f;
    std::vector<float> p = p0, m = m0, v = v0;
    step<float, kFast>(p, scaled, m, v, hp);
    std::vector<float> model_want = p;
    if (rounding == ActivationRounding::kBF16)
      kFast ? cpu::round_bf16(model_want.data(), n) : ref::round_bf16(model_want.data(), n);
    if (rounding == ActivationRounding::kF16)
      kFast ? cpu::round_fp16(model_want.data(), n) : ref::round_fp16(model_want.data(), n);
    AdamWHyper fused_hp = hp;
    fused_hp.grad_scale = 0.3f;
    std::vector<float> fp = p0, fm = m0, fv = v0, model(n, 0.0f);
    if constexpr (kFast) {
      cpu::adamw_step(fp.data(), grad.data(), fm.data(), fv.data(), n, fused_hp, model.data(), rounding);
    } else {
      ref::adamw_step(fp.data(), grad.data(), fm.data(), fv.data(), n, fused_hp, model.data(), rounding);
    }
    EXPECT_EQ(fp, p);
    EXPECT_EQ(fm, m);
    EXPECT_EQ(fv, v);
    EXPECT_EQ(model, model_want) << "rounding " << static_cast<int>(rounding);
  }
}

TEST(AdamWTest, GradScaleAndModelCopyAreTheSeparatePasses) {
  expect_fused_clip_and_model_copy<true>();
  expect_fused_clip_and_model_copy<false>();
}

// grad_to_zero: the same update bit for bit, and every gradient element zero afterwards (several chunks and threads,
// a ragged end; with and without the model copy).
template <bool kFast>
void expect_consumed_gradient_is_zero() {
  constexpr int64_t n = 70001;
  const std::vector<float> grad = random_vector<float>(n, 71, -3.0f, 3.0f);
  const std::vector<float> p0 = random_vector<float>(n, 72), m0 = random_vector<float>(n, 73);
  const std::vector<float> v0 = random_vector<float>(n, 74, 0.0f, 1.0f);
  AdamWHyper hp;
  hp.lr = 1e-2;
  hp.weight_decay = 0.1;
  hp.step = 3;
  hp.grad_scale = 0.5f;
  for (const bool with_model : {false, true}) {
    std::vector<float> p = p0, m = m0, v = v0, model(n, 0.0f);
    std::vector<float> cp = p0, cm = m0, cv = v0, cmodel(n, 0.0f), consumed = grad;
    float* const model_out = with_model ? model.data() : nullptr;
    float* const cmodel_out = with_model ? cmodel.data() : nullptr;
    const ActivationRounding rounding = with_model ? ActivationRounding::kBF16 : ActivationRounding::kNone;
    if constexpr (kFast) {
      cpu::adamw_step(p.data(), grad.data(), m.data(), v.data(), n, hp, model_out, rounding);
      cpu::adamw_step(cp.data(), consumed.data(), cm.data(), cv.data(), n, hp, cmodel_out, rounding, consumed.data());
    } else {
      ref::adamw_step(p.data(), grad.data(), m.data(), v.data(), n, hp, model_out, rounding);
      ref::adamw_step(cp.data(), consumed.data(), cm.data(), cv.data(), n, hp, cmodel_out, rounding, consumed.data());
    }
    EXPECT_EQ(cp, p);
    EXPECT_EQ(cm, m);
    EXPECT_EQ(cv, v);
    EXPECT_EQ(cmodel, model);
    EXPECT_EQ(consumed, std::vector<float>(n, 0.0f)) << "with_model " << with_model;
  }
}

TEST(AdamWTest, ConsumedGradientIsZeroAndTheUpdateUnchanged) {
  expect_consumed_gradient_is_zero<true>();
  expect_consumed_gradient_is_zero<false>();
}

// The 16-bit model weights written in the update loop round as fp32_to_bf16 / fp32_to_fp16 (ties to even, carries
// into the exponent, overflow to infinity, NaNs kept NaN and quiet, fp16 subnormals) into an output that is not 16-byte
// aligned, and their bf16 bits (model_bf16) are those values' upper halves. With lr 0 and no decay the parameters keep
// their values (a signalling NaN comes out quiet), so the special values reach the rounding.
void expect_model_weights_round_special_values(const bool fast, const ActivationRounding rounding) {
  const std::vector<uint32_t> special_bits = {
      0x3f808000u, 0x3f818000u, 0x3f80ffffu, 0xbf808001u, 0x7f7fffffu, 0xff7fffffu, 0x7f800000u, 0xff800000u,
      0x7f800001u, 0xffc00000u, 0x7fbfffffu, 0x00000001u, 0x80008000u, 0x00000000u, 0x80000000u, 0x3f801000u,
      0x3f803000u, 0x477ff000u, 0x477fefffu, 0x33800000u, 0xb3c00000u, 0x387fc000u, 0x80000001u, 0xff812345u};
  std::vector<float> p0 = random_vector<float>(9001, 75);  // several chunks, a ragged end
  for (size_t i = 0; i < p0.size(); i += 7) p0[i] = std::bit_cast<float>(special_bits[(i / 7) % special_bits.size()]);
  const int64_t n = static_cast<int64_t>(p0.size());
  const std::vector<float> grad = random_vector<float>(n, 76, -3.0f, 3.0f);
  AdamWHyper hp;
  hp.lr = 0.0;
  hp.step = 2;
  const bool bf16 = rounding == ActivationRounding::kBF16;
  std::vector<float> p = p0, m(n, 0.0f), v(n, 0.0f), model_buffer(n + 1, 0.0f);
  std::vector<uint16_t> bits_buffer(n + 1, 0);  // the weights' bf16 bits, also at an odd offset
  const auto step = fast ? cpu::adamw_step<float> : ref::adamw_step<float>;
  step(p.data(), grad.data(), m.data(), v.data(), n, hp, model_buffer.data() + 1, rounding, nullptr,
       bf16 ? bits_buffer.data() + 1 : nullptr);
  for (int64_t i = 0; i < n; ++i) {
    ASSERT_TRUE(p[i] == p0[i] || (std::isnan(p[i]) && std::isnan(p0[i]))) << "element " << i;
    const float want = bf16 ? bf16_to_fp32(fp32_to_bf16(p[i])) : fp16_to_fp32(fp32_to_fp16(p[i]));
    ASSERT_EQ(std::bit_cast<uint32_t>(model_buffer[i + 1]), std::bit_cast<uint32_t>(want))
        << "element " << i << (fast ? " fast" : " ref") << (bf16 ? " bf16" : " fp16");
    if (bf16) {
      ASSERT_EQ(bits_buffer[i + 1], fp32_to_bf16(p[i])) << "element " << i << (fast ? " fast" : " ref");
    }
  }
  EXPECT_EQ(model_buffer[0], 0.0f);
  EXPECT_EQ(bits_buffer[0], 0);
}

TEST(AdamWTest, SixteenBitModelWeightsRoundSpecialValuesIntoUnalignedOutput) {
  for (const bool fast : {true, false}) {
    expect_model_weights_round_special_values(fast, ActivationRounding::kBF16);
    expect_model_weights_round_special_values(fast, ActivationRounding::kF16);
  }
  const int64_t n = 4;
  std::vector<float> p(n, 1.0f), grad(n, 1.0f), m(n, 0.0f), v(n, 0.0f), model(n);
  std::vector<uint16_t> bits(n);
  AdamWHyper hp;
  EXPECT_THROW(cpu::adamw_step<float>(p.data(), grad.data(), m.data(), v.data(), n, hp, model.data(),
                                      ActivationRounding::kF16, nullptr, bits.data()),
               std::invalid_argument)
      << "bf16 bits of fp16 weights";
}

// Every vector path of the 16-bit model update that this CPU has (the tests above run the best one) gives the same
// bits: the update, the model copy and its bits, the consumed gradients, the special values.
TEST(AdamWTest, EveryModelUpdatePathGivesTheSameBits) {
  using cpu::AdamWModelPath;
  EXPECT_TRUE(cpu::adamw_model_path_supported(AdamWModelPath::kPortable));
  for (const AdamWModelPath path : {AdamWModelPath::kPortable, AdamWModelPath::kAvx2}) {
    if (!cpu::adamw_model_path_supported(path)) {
      EXPECT_THROW(cpu::ScopedAdamWModelPath{path}, std::invalid_argument);
      continue;
    }
    const cpu::ScopedAdamWModelPath scoped(path);
    ASSERT_EQ(cpu::adamw_model_path(), path);
    SCOPED_TRACE("path " + std::to_string(static_cast<int>(path)));
    expect_fused_clip_and_model_copy<true>();
    expect_consumed_gradient_is_zero<true>();
    expect_model_weights_round_special_values(true, ActivationRounding::kBF16);
    expect_model_weights_round_special_values(true, ActivationRounding::kF16);
  }
}

}  // namespace
}  // namespace moecore::kernels
