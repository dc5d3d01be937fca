// The step's kept 16-bit weight casts (ops/weight_casts.h): one exact cast per model parameter inside a scope, none
// outside it or for other tensors, a fresh one in the next scope after the weight changed; and the native 16-bit
// GEMMs of the linear layer, the fused output layer + loss and the grouped experts read the kept casts and write the
// same bits as without them.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "lowp_test_values.h"
#include "moecore/kernels/cpu/gemm_lowp.h"
#include "moecore/ops/ops.h"
#include "moecore/ops/precision.h"
#include "moecore/ops/weight_casts.h"

namespace moecore::ops {
namespace {

using test::as_dtype;
using test::random_values;

bool same_bits(const Tensor& a, const Tensor& b) {
  return a.nbytes() == b.nbytes() && std::memcmp(a.data<std::byte>(), b.data<std::byte>(), a.nbytes()) == 0;
}

TEST(OpsWeightCasts, KeepsOneExactCastPerParameterWithinTheScope) {
  Tensor w = random_values({48, 40}, DType::kBF16, 1, MemCategory::kParams);
  const Tensor other = random_values({48, 40}, DType::kBF16, 2);
  EXPECT_FALSE(weight_casts_live());
  EXPECT_FALSE(cached_weight_cast(w, DType::kBF16).defined()) << "no scope: the caller casts";
  {
    const ScopedWeightCasts scope;
    const Tensor first = cached_weight_cast(w, DType::kBF16);
    ASSERT_TRUE(first.defined());
    ASSERT_EQ(first.dtype(), DType::kBF16);
    ASSERT_EQ(first.numel(), w.numel());
    for (int64_t i = 0; i < w.numel(); ++i) {  // a bf16 value's bits are the upper half of its fp32 bits
      uint32_t bits = 0;
      std::memcpy(&bits, w.data<float>() + i, sizeof bits);
      ASSERT_EQ(first.data<uint16_t>()[i], static_cast<uint16_t>(bits >> 16)) << "element " << i;
    }
    EXPECT_TRUE(cached_weight_cast(w, DType::kBF16).shares_storage(first)) << "the second call reads the first cast";
    EXPECT_FALSE(cached_weight_cast(other, DType::kBF16).defined()) << "not a parameter";
    EXPECT_EQ(weight_casts_kept(), 1);
    {
      const ScopedWeightCasts nested;
      EXPECT_TRUE(cached_weight_cast(w, DType::kBF16).shares_storage(first)) << "a nested scope reads the outer's";
    }
    EXPECT_EQ(weight_casts_kept(), 1) << "the outermost scope owns the casts";
    EXPECT_THROW(cached_weight_cast(w, DType::kF32), std::invalid_argument);
  }
  EXPECT_EQ(weight_casts_kept(), 0);
  // The optimizer changes the weight between steps: the next step's scope casts the new values.
  w.data<float>()[5] = 3.0f;
  const ScopedWeightCasts next;
  const Tensor cast = cached_weight_cast(w, DType::kBF16);
  EXPECT_EQ(cast.data<uint16_t>()[5], uint16_t{0x4040});  // 3.0 in bf16
}

// Every output of the three ops on the native GEMMs, without a scope and inside one (bf16 activations and weights
// that are parameters holding bf16 values), must agree bit for bit, and the scope must have kept the weights' casts.
// A carry hands a scope's casts on as stale; the ones the optimizer refreshes (rewriting them with its update) start
// the next scope, read there without a new cast; the others are freed by drop_stale and cast afresh.
TEST(OpsWeightCasts, CarryStartsTheNextScopeWithTheRefreshedCasts) {
  Tensor updated = random_values({32, 24}, DType::kBF16, 3, MemCategory::kParams);
  Tensor untouched = random_values({16, 8}, DType::kBF16, 4, MemCategory::kParams);
  WeightCastCarry carry;
  Tensor first_updated, first_untouched;
  {
    const ScopedWeightCasts step(&carry);
    first_updated = cached_weight_cast(updated, DType::kBF16);
    first_untouched = cached_weight_cast(untouched, DType::kBF16);
  }
  EXPECT_EQ(weight_casts_kept(), 0);
  EXPECT_EQ(carry.stale(), 2);
  EXPECT_EQ(carry.fresh(), 0);
  EXPECT_FALSE(carry.refresh(updated, DType::kF16).defined()) << "no fp16 cast was kept";
  // The optimizer's update of one weight, writing its cast in the same pass (ops::adamw_step's model_bf16).
  const int64_t n = updated.numel();
  Tensor main = updated.clone(), grad = random_values({32, 24}, DType::kF32, 5);
  Tensor exp_avg({n}, DType::kF32), exp_avg_sq({n}, DType::kF32);
  AdamWHyper hyper;
  hyper.lr = 0.05;
  Tensor cast = carry.refresh(updated, DType::kBF16);
  ASSERT_TRUE(cast.shares_storage(first_updated));
  adamw_step(main, grad, exp_avg, exp_avg_sq, hyper, &updated, DType::kBF16, nullptr, &cast);
  EXPECT_FALSE(carry.refresh(updated, DType::kBF16).defined()) << "refreshed once";
  EXPECT_EQ(carry.fresh(), 1);
  carry.drop_stale();
  EXPECT_EQ(carry.stale(), 0);
  untouched.data<float>()[0] = 2.0f;  // changed without the carry's knowledge: its cast is gone
  {
    const ScopedWeightCasts step(&carry);
    EXPECT_EQ(carry.fresh(), 0) << "the scope took the fresh casts";
    EXPECT_EQ(weight_casts_kept(), 1);
    const Tensor next_updated = cached_weight_cast(updated, DType::kBF16);
    EXPECT_TRUE(next_updated.shares_storage(first_updated)) << "read without a new cast";
    Tensor fresh_cast({n}, DType::kBF16);
    convert(fresh_cast, updated.view({n}));
    EXPECT_TRUE(same_bits(next_updated, fresh_cast)) << "the refreshed bits are the updated weight's cast";
    const Tensor next_untouched = cached_weight_cast(untouched, DType::kBF16);
    EXPECT_FALSE(next_untouched.shares_storage(first_untouched));
    EXPECT_EQ(next_untouched.data<uint16_t>()[0], uint16_t{0x4000});  // 2.0 in bf16
  }
  EXPECT_EQ(carry.stale(), 2);
}

TEST(OpsWeightCasts, NativeGemmsReadTheKeptCastsBitForBit) {
  constexpr DType dtype = DType::kBF16;
  if (!kernels::cpu::lowp_native_available(kernels::LowpType::kBF16)) GTEST_SKIP() << "no native bf16 GEMM here";
  const kernels::cpu::ScopedLowpGemmPath native(kernels::cpu::LowpGemmPath::kNative);
  const ScopedActivationDType precision(dtype);
  constexpr int64_t T = 70, H = 48, V = 96, E = 3, F = 32;
  const std::vector<int64_t> offsets_E1 = {0, 30, 30, T};  // expert 1 without rows
  const Tensor w_VH = random_values({V, H}, dtype, 3, MemCategory::kParams);
  const Tensor wq_OH = random_values({2 * H, H}, dtype, 4, MemCategory::kParams);
  std::vector<Tensor> w1, w2;
  for (int64_t e = 0; e < E; ++e) {
    w1.push_back(random_values({2 * F, H}, dtype, static_cast<uint32_t>(10 + e), MemCategory::kParams));
    w2.push_back(random_values({H, F}, dtype, static_cast<uint32_t>(20 + e), MemCategory::kParams));
  }
  const Tensor x_TH = as_dtype(random_values({T, H}, dtype, 5), dtype);
  const Tensor dy_TO = as_dtype(random_values({T, 2 * H}, dtype, 6), dtype);
  const Tensor dy_TH = as_dtype(random_values({T, H}, dtype, 7), dtype);
  const Tensor probs_T = random_values({T}, dtype, 8);
  std::vector<int32_t> targets_T(T);
  for (int64_t t = 0; t < T; ++t) targets_T[static_cast<size_t>(t)] = static_cast<int32_t>((t * 37) % V);
  Tensor dlosses_T({T}, DType::kF32);
  for (int64_t t = 0; t < T; ++t) dlosses_T.data<float>()[t] = 1.0f / static_cast<float>(T);

  struct Outputs {
    std::vector<Tensor> all;
  };
  const auto run = [&] {
    Outputs out;
    Tensor y_TO({T, 2 * H}, dtype), dx_TH = Tensor::zeros({T, H}, dtype), dwq_OH = Tensor::zeros({2 * H, H});
    linear_forward(y_TO, x_TH, wq_OH);
    linear_backward(&dx_TH, &dwq_OH, nullptr, dy_TO, &x_TH, wq_OH);
    Tensor losses_T({T}, DType::kF32), dxo_TH = Tensor::zeros({T, H}, dtype), dw_VH = Tensor::zeros({V, H});
    linear_cross_entropy(losses_T, x_TH, w_VH, targets_T, 32, &dlosses_T, &dxo_TH, &dw_VH, nullptr);
    std::vector<const Tensor*> w1p, w2p;
    std::vector<Tensor> dw1(static_cast<size_t>(E)), dw2(static_cast<size_t>(E));
    std::vector<Tensor*> dw1p, dw2p;
    for (int64_t e = 0; e < E; ++e) {
      const auto i = static_cast<size_t>(e);
      w1p.push_back(&w1[i]);
      w2p.push_back(&w2[i]);
      dw1[i] = Tensor::zeros({2 * F, H});
      dw2[i] = Tensor::zeros({H, F});
      dw1p.push_back(&dw1[i]);
      dw2p.push_back(&dw2[i]);
    }
    const GroupedMlpParams params{w1p, {}, w2p, {}};
    const GroupedMlpSpec spec{Activation::kSwiGLU, false};
    Tensor ye_TH({T, H}, dtype), fc1_TF1({T, 2 * F}, dtype), h_TF({T, F}, dtype);
    grouped_mlp_forward(ye_TH, fc1_TF1, nullptr, &h_TF, nullptr, x_TH, probs_T, params, offsets_E1, spec);
    Tensor dxe_TH = Tensor::zeros({T, H}, dtype), dprobs_T({T}, DType::kF32);
    grouped_mlp_backward(dxe_TH, dprobs_T, {dw1p, {}, dw2p, {}}, dy_TH, x_TH, nullptr, fc1_TF1, nullptr, &h_TF, probs_T,
                         params, offsets_E1, spec);
    out.all = {y_TO, dx_TH, dwq_OH, losses_T, dxo_TH, dw_VH, ye_TH, fc1_TF1, h_TF, dxe_TH, dprobs_T};
    for (int64_t e = 0; e < E; ++e) {
      out.all.push_back(dw1[static_cast<size_t>(e)]);
      out.all.push_back(dw2[static_cast<size_t>(e)]);
    }
    return out;
  };
  const Outputs plain = run();
  Outputs kept;
  {
    const ScopedWeightCasts scope;
    kept = run();
    EXPECT_EQ(weight_casts_kept(), 2 + 2 * E) << "the linear, output and expert weights' casts";
  }
  ASSERT_EQ(plain.all.size(), kept.all.size());
  for (size_t i = 0; i < plain.all.size(); ++i) EXPECT_TRUE(same_bits(plain.all[i], kept.all[i])) << "output " << i;
}

}  // namespace
}  // namespace moecore::ops
