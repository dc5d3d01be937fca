// Softmax cross-entropy: hand-computed values, fast kernel vs the naive reference, backward vs float64 finite
// differences, in-place backward, the out-of-range target error, and the fused pass against the sequence of kernels
// it replaces (16-bit rounding of the logits and the gradient included), also on 16-bit logits.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <stdexcept>
#include <string>
#include <vector>

#include "moecore/kernels/cpu/convert.h"
#include "moecore/kernels/cpu/loss.h"
#include "moecore/tensor/dtype.h"
#include "unit/kernel_test_util.h"

namespace moecore::kernels {
namespace {

using test::max_rel_error;
using test::random_vector;

template <typename T>
struct LossResult {
  std::vector<T> losses, lse, dlogits;
};

template <typename T, bool kFast>
LossResult<T> run(const std::vector<T>& logits, const std::vector<int32_t>& targets, const std::vector<T>& dlosses,
                  int64_t V) {
  const auto n_tokens = static_cast<int64_t>(targets.size());
  LossResult<T> r{std::vector<T>(n_tokens), std::vector<T>(n_tokens), std::vector<T>(logits.size())};
  if constexpr (kFast) {
    cpu::cross_entropy_forward(r.losses.data(), r.lse.data(), logits.data(), targets.data(), n_tokens, V);
    cpu::cross_entropy_backward(r.dlogits.data(), dlosses.data(), logits.data(), r.lse.data(), targets.data(), n_tokens,
                                V);
  } else {
    ref::cross_entropy_forward(r.losses.data(), r.lse.data(), logits.data(), targets.data(), n_tokens, V);
    ref::cross_entropy_backward(r.dlogits.data(), dlosses.data(), logits.data(), r.lse.data(), targets.data(), n_tokens,
                                V);
  }
  return r;
}

std::vector<int32_t> random_targets(int64_t n_tokens, int64_t V, uint64_t seed) {
  const std::vector<double> u = random_vector<double>(n_tokens, seed, 0.0, 1.0);
  std::vector<int32_t> targets(n_tokens);
  for (int64_t t = 0; t < n_tokens; ++t) targets[t] = static_cast<int32_t>(u[t] * static_cast<double>(V));
  return targets;
}

template <typename T, bool kFast>
void expect_hand_computed(double tol) {
  // Token 0: logits [1, 2, 3], target 2; token 1: logits [0.5, -1, 2], target 0.
  const std::vector<T> logits = {1, 2, 3, 0.5, -1, 2};
  const std::vector<int32_t> targets = {2, 0};
  const std::vector<T> dlosses = {1.0, 0.25};
  const LossResult<T> r = run<T, kFast>(logits, targets, dlosses, 3);
  const double lse0 = std::log(std::exp(1.0) + std::exp(2.0) + std::exp(3.0));
  const double lse1 = std::log(std::exp(0.5) + std::exp(-1.0) + std::exp(2.0));
  EXPECT_NEAR(r.losses[0], lse0 - 3.0, tol);
  EXPECT_NEAR(r.losses[1], lse1 - 0.5, tol);
  EXPECT_NEAR(r.lse[0], lse0, tol);
  EXPECT_NEAR(r.lse[1], lse1, tol);
  const std::vector<double> expected_dlogits = {std::exp(1.0 - lse0),         std::exp(2.0 - lse0),
                                                std::exp(3.0 - lse0) - 1.0,   0.25 * (std::exp(0.5 - lse1) - 1.0),
                                                0.25 * std::exp(-1.0 - lse1), 0.25 * std::exp(2.0 - lse1)};
  for (size_t i = 0; i < expected_dlogits.size(); ++i) EXPECT_NEAR(r.dlogits[i], expected_dlogits[i], tol) << i;
}

TEST(CrossEntropyTest, HandComputed) {
  expect_hand_computed<double, true>(1e-14);
  expect_hand_computed<double, false>(1e-14);
  expect_hand_computed<float, true>(1e-6);
  expect_hand_computed<float, false>(1e-6);
}

template <typename T>
void expect_cpu_matches_ref(double tol) {
  const int64_t n_tokens = 37, V = 5003;
  std::vector<T> logits = random_vector<T>(n_tokens * V, 1, T(-8), T(8));
  for (int64_t v = 0; v < V; ++v) logits[5 * V + v] += T(1000);  // stability: exp would overflow unshifted
  const std::vector<int32_t> targets = random_targets(n_tokens, V, 2);
  const std::vector<T> dlosses = random_vector<T>(n_tokens, 3, T(0.1), T(2));
  const LossResult<T> fast = run<T, true>(logits, targets, dlosses, V);
  const LossResult<T> naive = run<T, false>(logits, targets, dlosses, V);
  EXPECT_LT(max_rel_error(fast.losses, naive.losses), tol);
  EXPECT_LT(max_rel_error(fast.lse, naive.lse), tol);
  // Probabilities are ~1/V: judge them relative to the largest gradient entry of the row, not to 1e-6.
  EXPECT_LT(max_rel_error(fast.dlogits, naive.dlogits, 1e-4), tol);
}

TEST(CrossEntropyTest, CpuMatchesRefFloat) { expect_cpu_matches_ref<float>(1e-5); }
TEST(CrossEntropyTest, CpuMatchesRefDouble) { expect_cpu_matches_ref<double>(1e-12); }

template <bool kFast>
void expect_backward_matches_finite_differences() {
  const int64_t n_tokens = 4, V = 7;
  const std::vector<double> logits = random_vector<double>(n_tokens * V, 10, -3.0, 3.0);
  const std::vector<int32_t> targets = random_targets(n_tokens, V, 11);
  const std::vector<double> dlosses = random_vector<double>(n_tokens, 12, 0.5, 1.5);
  const LossResult<double> analytic = run<double, kFast>(logits, targets, dlosses, V);
  const std::vector<double> numeric = test::numeric_grad(
      [&](const std::vector<double>& x) {
        return test::weighted_sum(run<double, kFast>(x, targets, dlosses, V).losses, dlosses);
      },
      logits);
  // Central differences of an O(10) loss carry ~1e-9 absolute rounding error.
  EXPECT_LT(max_rel_error(analytic.dlogits, numeric, 1e-2), 1e-6);
}

TEST(CrossEntropyTest, BackwardMatchesFiniteDifferences) {
  expect_backward_matches_finite_differences<true>();
  expect_backward_matches_finite_differences<false>();
}

template <typename T, bool kFast>
void expect_in_place_backward() {
  const int64_t n_tokens = 9, V = 1001;
  const std::vector<T> logits = random_vector<T>(n_tokens * V, 20, T(-5), T(5));
  const std::vector<int32_t> targets = random_targets(n_tokens, V, 21);
  const std::vector<T> dlosses = random_vector<T>(n_tokens, 22, T(0.5), T(1.5));
  const LossResult<T> separate = run<T, kFast>(logits, targets, dlosses, V);
  std::vector<T> in_place = logits;
  if constexpr (kFast) {
    cpu::cross_entropy_backward(in_place.data(), dlosses.data(), in_place.data(), separate.lse.data(), targets.data(),
                                n_tokens, V);
  } else {
    ref::cross_entropy_backward(in_place.data(), dlosses.data(), in_place.data(), separate.lse.data(), targets.data(),
                                n_tokens, V);
  }
  EXPECT_EQ(in_place, separate.dlogits);
}

TEST(CrossEntropyTest, InPlaceBackward) {
  expect_in_place_backward<float, true>();
  expect_in_place_backward<double, true>();
  expect_in_place_backward<float, false>();
  expect_in_place_backward<double, false>();
}

TEST(CrossEntropyTest, OutOfRangeTargetThrowsNamingTargetAndV) {
  const std::vector<float> logits = random_vector<float>(2 * 7, 30);
  std::vector<float> losses(2), lse(2), dlogits(2 * 7);
  const std::vector<float> dlosses = {1.0f, 1.0f};
  for (const int32_t bad : {7, -1}) {
    const std::vector<int32_t> targets = {3, bad};
    const std::string expected = "target " + std::to_string(bad);
    try {
      cpu::cross_entropy_forward(losses.data(), lse.data(), logits.data(), targets.data(), 2, 7);
      ADD_FAILURE() << "no exception for target " << bad;
    } catch (const std::out_of_range& e) {
      EXPECT_NE(std::string(e.what()).find(expected), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("V=7"), std::string::npos) << e.what();
    }
    EXPECT_THROW(
        cpu::cross_entropy_backward(dlogits.data(), dlosses.data(), logits.data(), lse.data(), targets.data(), 2, 7),
        std::out_of_range);
    EXPECT_THROW(ref::cross_entropy_forward(losses.data(), lse.data(), logits.data(), targets.data(), 2, 7),
                 std::out_of_range);
  }
}

// Logits for the fused pass's tests: random in [-8, 8]; with `special`, the first rows also hold what rounding treats
// apart (NaN, infinities, fp32 denormals, values halfway between two bf16 or fp16 values, negative zero), one kind a
// row so that the other rows keep finite losses. NaNs with low payload bits set included: an unchecked bf16 rounding
// carry would make them an infinity or a zero.
std::vector<float> fused_test_logits(const int64_t n_tokens, const int64_t V, const bool special) {
  std::vector<float> logits = random_vector<float>(n_tokens * V, 41, -8.0f, 8.0f);
  if (!special) return logits;
  const float kinds[] = {std::nanf(""),
                         std::bit_cast<float>(0xff800001u),
                         std::bit_cast<float>(0x7fffffffu),
                         INFINITY,
                         -INFINITY,
                         1.0e-39f,
                         -3.0e-40f,
                         std::bit_cast<float>(0x3f808000u),
                         std::bit_cast<float>(0x3f818000u),
                         1.0f + 0x1p-11f,
                         -0.0f};
  for (int64_t t = 0; t < n_tokens && t < static_cast<int64_t>(std::size(kinds)); ++t) {
    for (int64_t v = t % 3; v < V; v += 5) logits[t * V + v] = kinds[t];
  }
  return logits;
}

// The output layer's sequence on one device's kernels K: logits rounded to the format, forward, backward, the
// gradient rounded (or encoded to 16-bit bits); against cross_entropy_fused of the same kernels, bit for bit. V is
// not a multiple of any vector width, or below one; targets include the first and the last class.
template <typename K>
void expect_fused_is_the_sequence(const ActivationRounding rounding, const bool backward, const bool bits16,
                                  const int64_t V, const bool special) {
  constexpr int64_t kTokens = 13;
  const std::vector<float> logits = fused_test_logits(kTokens, V, special);
  std::vector<int32_t> targets = random_targets(kTokens, V, 42);
  targets[kTokens - 1] = static_cast<int32_t>(V - 1);
  targets[kTokens - 2] = 0;
  // Every other special row's target is one of its special values: the loss reads it rounded (a NaN's payload too).
  for (int64_t t = 0; special && t < kTokens - 2; t += 2) targets[static_cast<size_t>(t)] = static_cast<int32_t>(t % 3);
  const std::vector<float> dlosses = random_vector<float>(kTokens, 43, 0.1f, 1.0f);
  const auto round = [&](float* data, const int64_t n) {
    if (rounding == ActivationRounding::kBF16) K::round_bf16(data, n);
    if (rounding == ActivationRounding::kF16) K::round_fp16(data, n);
  };
  // The sequence.
  std::vector<float> rounded = logits, losses(kTokens), lse(kTokens), dlogits(kTokens * V);
  std::vector<uint16_t> dlogits16(kTokens * V);
  round(rounded.data(), kTokens * V);
  K::cross_entropy_forward(losses.data(), lse.data(), rounded.data(), targets.data(), kTokens, V);
  if (backward) {
    K::cross_entropy_backward(dlogits.data(), dlosses.data(), rounded.data(), lse.data(), targets.data(), kTokens, V);
    if (bits16) {
      rounding == ActivationRounding::kBF16 ? K::encode_bf16(dlogits16.data(), dlogits.data(), kTokens * V)
                                            : K::encode_fp16(dlogits16.data(), dlogits.data(), kTokens * V);
    } else {
      round(dlogits.data(), kTokens * V);
    }
  }
  // The fused pass.
  std::vector<float> fused = logits, fused_losses(kTokens), fused_lse(kTokens);
  std::vector<uint16_t> fused16(bits16 ? kTokens * V : 0);
  K::cross_entropy_fused(fused_losses.data(), fused_lse.data(), fused.data(), backward ? dlosses.data() : nullptr,
                         bits16 ? fused16.data() : nullptr, targets.data(), rounding, kTokens, V);
  const auto same_bits = [](const auto& a, const auto& b) {
    return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(a[0])) == 0;
  };
  EXPECT_TRUE(same_bits(fused_losses, losses)) << "losses";
  EXPECT_TRUE(same_bits(fused_lse, lse)) << "lse";
  if (!backward || bits16) {
    EXPECT_TRUE(same_bits(fused, rounded)) << "logits kept, rounded";
  }
  if (backward && bits16) {
    EXPECT_TRUE(same_bits(fused16, dlogits16)) << "16-bit gradient";
  }
  if (backward && !bits16) {
    EXPECT_TRUE(same_bits(fused, dlogits)) << "gradient over the logits";
  }
}

struct CpuKernels {
  template <typename... A>
  static void cross_entropy_forward(A... a) {
    cpu::cross_entropy_forward(a...);
  }
  template <typename... A>
  static void cross_entropy_backward(A... a) {
    cpu::cross_entropy_backward(a...);
  }
  template <typename... A>
  static void cross_entropy_fused(A... a) {
    cpu::cross_entropy_fused(a...);
  }
  template <typename... A>
  static void cross_entropy_fused16(A... a) {
    cpu::cross_entropy_fused16(a...);
  }
  static void round_bf16(float* d, int64_t n) { cpu::round_bf16(d, n); }
  static void round_fp16(float* d, int64_t n) { cpu::round_fp16(d, n); }
  static void encode_bf16(uint16_t* o, const float* i, int64_t n) { cpu::encode_bf16(o, i, n); }
  static void encode_fp16(uint16_t* o, const float* i, int64_t n) { cpu::encode_fp16(o, i, n); }
};
struct RefKernels {
  template <typename... A>
  static void cross_entropy_forward(A... a) {
    ref::cross_entropy_forward(a...);
  }
  template <typename... A>
  static void cross_entropy_backward(A... a) {
    ref::cross_entropy_backward(a...);
  }
  template <typename... A>
  static void cross_entropy_fused(A... a) {
    ref::cross_entropy_fused(a...);
  }
  template <typename... A>
  static void cross_entropy_fused16(A... a) {
    ref::cross_entropy_fused16(a...);
  }
  static void round_bf16(float* d, int64_t n) { ref::round_bf16(d, n); }
  static void round_fp16(float* d, int64_t n) { ref::round_fp16(d, n); }
  static void encode_bf16(uint16_t* o, const float* i, int64_t n) { ref::encode_bf16(o, i, n); }
  static void encode_fp16(uint16_t* o, const float* i, int64_t n) { ref::encode_fp16(o, i, n); }
};

TEST(CrossEntropyTest, FusedPassIsTheSequenceOfKernels) {
  for (const auto rounding : {ActivationRounding::kNone, ActivationRounding::kBF16, ActivationRounding::kF16}) {
    for (const bool backward : {false, true}) {
      for (const bool bits16 : {false, true}) {
        if (bits16 && (rounding == ActivationRounding::kNone || !backward)) continue;
        SCOPED_TRACE("rounding " + std::to_string(static_cast<int>(rounding)) + (backward ? ", backward" : "") +
                     (bits16 ? ", 16-bit gradient" : ""));
        for (const int64_t V : {1000, 1003, 13}) {
          for (const bool special : {false, true}) {
            SCOPED_TRACE("V " + std::to_string(V) + (special ? ", special values" : ""));
            expect_fused_is_the_sequence<CpuKernels>(rounding, backward, bits16, V, special);
            expect_fused_is_the_sequence<RefKernels>(rounding, backward, bits16, V, special);
          }
        }
      }
    }
  }
}

TEST(CrossEntropyTest, FusedPassRefusesWhatItCannotRound) {
  std::vector<double> logits(6, 0.0), losses(2), lse(2);
  const std::vector<int32_t> targets = {0, 1};
  EXPECT_THROW(cpu::cross_entropy_fused<double>(losses.data(), lse.data(), logits.data(), nullptr, nullptr,
                                                targets.data(), ActivationRounding::kBF16, 2, 3),
               std::invalid_argument);
  std::vector<float> flogits(6, 0.0f), flosses(2), flse(2), dlosses(2, 1.0f);
  std::vector<uint16_t> bits(6);
  EXPECT_THROW(cpu::cross_entropy_fused<float>(flosses.data(), flse.data(), flogits.data(), dlosses.data(), bits.data(),
                                               targets.data(), ActivationRounding::kNone, 2, 3),
               std::invalid_argument);
  const std::vector<int32_t> bad = {0, 3};
  EXPECT_THROW(cpu::cross_entropy_fused<float>(flosses.data(), flse.data(), flogits.data(), nullptr, nullptr,
                                               bad.data(), ActivationRounding::kNone, 2, 3),
               std::out_of_range);
  EXPECT_THROW(ref::cross_entropy_fused<float>(flosses.data(), flse.data(), flogits.data(), nullptr, nullptr,
                                               bad.data(), ActivationRounding::kNone, 2, 3),
               std::out_of_range);
}

// On 16-bit logits (the native GEMM's output): the same losses, lse and 16-bit gradient as cross_entropy_fused on the
// widened logits, bit for bit, on each kernel set; the fast and the reference pass agree too.
template <typename K>
void expect_fused16_is_fused(const ActivationRounding format, const bool backward) {
  constexpr int64_t kTokens = 7, kV = 1003;
  const std::vector<float> values = random_vector<float>(kTokens * kV, 51, -6.0f, 6.0f);
  const std::vector<int32_t> targets = random_targets(kTokens, kV, 52);
  const std::vector<float> dlosses = random_vector<float>(kTokens, 53, 0.1f, 1.0f);
  std::vector<uint16_t> bits(kTokens * kV);
  format == ActivationRounding::kBF16 ? K::encode_bf16(bits.data(), values.data(), kTokens * kV)
                                      : K::encode_fp16(bits.data(), values.data(), kTokens * kV);
  std::vector<float> widened(kTokens * kV), losses(kTokens), lse(kTokens), losses16(kTokens), lse16(kTokens);
  format == ActivationRounding::kBF16 ? cpu::decode_bf16(widened.data(), bits.data(), kTokens * kV)
                                      : cpu::decode_fp16(widened.data(), bits.data(), kTokens * kV);
  std::vector<uint16_t> want = bits, got = bits;
  K::cross_entropy_fused(losses.data(), lse.data(), widened.data(), backward ? dlosses.data() : nullptr,
                         backward ? want.data() : nullptr, targets.data(), format, kTokens, kV);
  K::cross_entropy_fused16(losses16.data(), lse16.data(), got.data(), backward ? dlosses.data() : nullptr,
                           targets.data(), format, kTokens, kV);
  EXPECT_EQ(losses16, losses);
  EXPECT_EQ(lse16, lse);
  EXPECT_EQ(got, want) << (backward ? "the 16-bit gradient" : "the logits, untouched");
}

TEST(CrossEntropyTest, FusedPassOn16BitLogitsIsTheFusedPass) {
  for (const auto format : {ActivationRounding::kBF16, ActivationRounding::kF16}) {
    for (const bool backward : {false, true}) {
      SCOPED_TRACE(std::string(format == ActivationRounding::kBF16 ? "bf16" : "fp16") + (backward ? ", backward" : ""));
      expect_fused16_is_fused<CpuKernels>(format, backward);
      expect_fused16_is_fused<RefKernels>(format, backward);
    }
  }
  constexpr int64_t kTokens = 5, kV = 300;
  std::vector<uint16_t> fast(kTokens * kV), ref_bits;
  cpu::encode_bf16(fast.data(), random_vector<float>(kTokens * kV, 54, -4.0f, 4.0f).data(), kTokens * kV);
  ref_bits = fast;
  const std::vector<int32_t> targets = random_targets(kTokens, kV, 55);
  const std::vector<float> dlosses(kTokens, 1.0f);
  std::vector<float> l_fast(kTokens), s_fast(kTokens), l_ref(kTokens), s_ref(kTokens);
  cpu::cross_entropy_fused16(l_fast.data(), s_fast.data(), fast.data(), dlosses.data(), targets.data(),
                             ActivationRounding::kBF16, kTokens, kV);
  ref::cross_entropy_fused16(l_ref.data(), s_ref.data(), ref_bits.data(), dlosses.data(), targets.data(),
                             ActivationRounding::kBF16, kTokens, kV);
  EXPECT_LT(max_rel_error(l_fast, l_ref), 1e-5);
  // The gradients: fp32 softmax values within 1e-5 relative of each other round to bf16 values at most one bf16 ulp
  // apart.
  for (int64_t i = 0; i < kTokens * kV; ++i) {
    const float f = bf16_to_fp32(fast[static_cast<size_t>(i)]), r = bf16_to_fp32(ref_bits[static_cast<size_t>(i)]);
    EXPECT_LE(std::abs(f - r), std::abs(r) / 128 + 1e-30f) << i;
  }
}

TEST(CrossEntropyTest, FusedPassOn16BitLogitsNeedsItsFormat) {
  std::vector<uint16_t> bits(6, 0);
  std::vector<float> losses(2), lse(2);
  const std::vector<int32_t> targets = {0, 1};
  EXPECT_THROW(cpu::cross_entropy_fused16(losses.data(), lse.data(), bits.data(), nullptr, targets.data(),
                                          ActivationRounding::kNone, 2, 3),
               std::invalid_argument);
  EXPECT_THROW(ref::cross_entropy_fused16(losses.data(), lse.data(), bits.data(), nullptr, targets.data(),
                                          ActivationRounding::kNone, 2, 3),
               std::invalid_argument);
}

}  // namespace
}  // namespace moecore::kernels
