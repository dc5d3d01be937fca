// The message of a training run stopped by a non-finite loss or gradient norm: the iteration's values, the cause
// (non-finite weights from the optimizer step, a diverging loss, an overflow with a steady loss) and advice to match.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>

#include "moecore/model/norm_overflow.h"
#include "moecore/tensor/finite_check.h"
#include "moecore/train/nonfinite_diagnosis.h"

namespace moecore {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();

NonFiniteDiagnosis base() {
  NonFiniteDiagnosis d;
  d.num_layers = 2;
  d.lr = 1e-3;
  d.adam_eps = 1e-8;
  d.weight_decay = 0.01;
  d.clip_grad = 1.0;
  return d;
}

TEST(NonFiniteDiagnosis, AdamEpsZeroMadeTheWeightsNaN) {
  NonFiniteDiagnosis d = base();
  d.adam_eps = 0.0;
  d.step = {2, kNaN, std::nullopt, 1e-3};
  d.previous_losses = {4.85};
  d.previous_grad_norm = 3.5;
  d.scan.first_weight = NonFiniteTensor{-1, "embedding.word_embeddings.weight (NaN at element 5)"};
  EXPECT_EQ(describe_nonfinite(d),
            "lm loss is NaN at iteration 2 (lm loss nan, learning rate 0.001): the optimizer step of iteration 1 "
            "turned finite gradients (grad norm 3.5) into non-finite weights (first: embedding.word_embeddings.weight "
            "(NaN at element 5)); with --adam-eps 0 Adam's update m / (sqrt(v) + eps) is 0 / 0 wherever a gradient "
            "element has been 0: use a positive --adam-eps (Megatron's default 1e-8)");
}

TEST(NonFiniteDiagnosis, NonFiniteWeightsWithAPositiveEpsPointAtTheOptimizerFlags) {
  NonFiniteDiagnosis d = base();
  d.step = {5, kInf, std::nullopt, 1e-3};
  d.previous_losses = {4.0, 3.9, 3.8, 3.7};
  d.previous_grad_norm = 0.5;
  d.scan.first_weight = NonFiniteTensor{1, "decoder.layers.1.mlp.linear_fc1.weight (Inf at element 0)"};
  const std::string message = describe_nonfinite(d);
  EXPECT_EQ(message.find("lm loss is Inf at iteration 5"), 0u) << message;
  EXPECT_NE(message.find("the optimizer step of iteration 4 turned finite gradients (grad norm 0.5)"),
            std::string::npos)
      << message;
  EXPECT_NE(message.find("check the optimizer flags (--lr 0.001, --adam-eps 1e-08, --weight-decay 0.01)"),
            std::string::npos)
      << message;
}

TEST(NonFiniteDiagnosis, AGrowingLossIsDivergenceAndAdvisesALowerLr) {
  // The --lr 1e4 case: iteration 2 printed a loss of 2.75e9, iteration 3 overflowed the gradients.
  NonFiniteDiagnosis d = base();
  d.lr = 1e4;
  d.step = {3, 3.1e10, kInf, 1e4};
  d.previous_losses = {4.85, 2.75e9};
  d.scan.last_grad = NonFiniteTensor{2, "output_layer.weight (Inf at element 3)"};
  EXPECT_EQ(describe_nonfinite(d),
            "grad norm is not finite at iteration 3 (lm loss 3.1e+10, grad norm inf, learning rate 1e+04): the loss "
            "grew from 4.85 at iteration 1 to 3.1e+10 at iteration 3, so training diverged; the backward pass first "
            "produced non-finite gradients in the output layer (output_layer.weight (Inf at element 3)); lower --lr "
            "(now 1e+04)");
  d.clip_grad = 0.0;
  EXPECT_NE(describe_nonfinite(d).find("lower --lr (now 1e+04) and clip the gradients (--clip-grad 1.0)"),
            std::string::npos);
}

TEST(NonFiniteDiagnosis, TheLastFiniteLossCountsWhenTheCurrentOneIsNot) {
  NonFiniteDiagnosis d = base();
  d.step = {4, kNaN, std::nullopt, 1e-3};
  d.previous_losses = {5.0, 40.0, 900.0};  // iterations 1..3
  const std::string message = describe_nonfinite(d);
  EXPECT_NE(message.find("the loss grew from 5 at iteration 1 to 900 at iteration 3, so training diverged"),
            std::string::npos)
      << message;
}

TEST(NonFiniteDiagnosis, ASteadyLossMeansOneBatchOverflowed) {
  NonFiniteDiagnosis d = base();
  d.step = {3, 4.1, -kNaN, 1e-3};  // printed "nan", not "-nan"
  d.previous_losses = {4.3, 4.2};
  d.scan.largest_weight = 0.9;
  d.scan.last_grad = NonFiniteTensor{0, "decoder.layers.0.mlp.linear_fc2.weight (NaN at element 9)"};
  EXPECT_EQ(describe_nonfinite(d),
            "grad norm is not finite at iteration 3 (lm loss 4.1, grad norm nan, learning rate 0.001): the weights "
            "are finite and the loss had not grown (4.2 at iteration 2), so this batch overflowed the forward or "
            "backward pass; the backward pass first produced non-finite gradients in decoder layer 0 "
            "(decoder.layers.0.mlp.linear_fc2.weight (NaN at element 9)); check the data and the model's scale flags");
}

TEST(NonFiniteDiagnosis, LargeFiniteWeightsWithASteadyLossPointAtTheLr) {
  // Adam with --lr 1e4 moves weights by ~1e4 per step: the softmax saturates (loss ln V, zero gradients) until the
  // backward overflows, so the loss never grew.
  NonFiniteDiagnosis d = base();
  d.lr = 1e4;
  d.step = {6, 10.83, kNaN, 5e3};
  d.previous_losses = {10.83, 10.83, 10.83, 10.83, 10.83};
  d.scan.largest_weight = 3.5e4;
  d.scan.last_grad = NonFiniteTensor{2, "decoder.final_layernorm.weight (NaN at element 2)"};
  EXPECT_EQ(describe_nonfinite(d),
            "grad norm is not finite at iteration 6 (lm loss 10.83, grad norm nan, learning rate 5000): the weights "
            "are finite but grew large (largest |w| 3.5e+04, initialized with std 0.02), so the updates overflowed "
            "the model; the backward pass first produced non-finite gradients in the output layer "
            "(decoder.final_layernorm.weight (NaN at element 2)); lower --lr (now 1e+04)");
  // Weights of a normal size (RMSNorm weights are 1) do not count as grown.
  d.scan.largest_weight = 1.5;
  EXPECT_NE(describe_nonfinite(d).find("the loss had not grown"), std::string::npos);
}

TEST(NonFiniteDiagnosis, TheFirstIterationOfARun) {
  NonFiniteDiagnosis d = base();
  d.step = {1, kNaN, std::nullopt, 0.0};
  EXPECT_NE(describe_nonfinite(d).find("the weights are finite, so the forward or backward pass of the initial model "
                                       "overflowed"),
            std::string::npos);
  d.scan.first_weight = NonFiniteTensor{-1, "embedding.word_embeddings.weight (Inf at element 2)"};
  EXPECT_NE(describe_nonfinite(d).find("the weights were not finite before the first update of this run"),
            std::string::npos);
  EXPECT_NE(describe_nonfinite(d).find("check --init-method-std"), std::string::npos);
  // Weights that came from --load point at the checkpoint; under --fp16 at fp16's range.
  d.loaded_from = "ckpt/hf";
  d.fp16 = true;
  EXPECT_NE(describe_nonfinite(d).find("they come from --load ckpt/hf: check its values (a weight beyond fp16's 65504 "
                                       "becomes Inf under --fp16)"),
            std::string::npos);
  d.loaded_from.clear();
  d.fp16 = false;
  // A run resumed at iteration 100: its first iteration is 101, and no losses of this run came before.
  d.step.iteration = 101;
  d.scan.first_weight.reset();
  EXPECT_NE(describe_nonfinite(d).find("lm loss is NaN at iteration 101"), std::string::npos);
}

// A norm whose sum of squares overflowed outputs zeros: the loss is a finite ln V, and the message names the norm
// with advice for where the large weights came from.
TEST(NonFiniteDiagnosis, ANormOverflowNamesTheNormWithAFiniteLoss) {
  NonFiniteDiagnosis d = base();
  d.init_method_std = 0.02;
  const NormOverflow overflow{.module = 1,
                              .name = "decoder.layers.1.input_layernorm",
                              .layernorm = false,
                              .dtype = DType::kF32,
                              .largest_input = 3.4e20};
  d.step = {3, 10.83, std::nullopt, 1e-3, overflow};
  d.previous_losses = {10.9, 10.85};
  d.scan.largest_weight = 2.5e19;
  EXPECT_STREQ(NonFiniteStep(d.step).what(),
               "iteration 3: decoder.layers.1.input_layernorm's sum of squares overflowed fp32 (input rows with |x| "
               "up to 3.4e+20)");
  EXPECT_EQ(describe_nonfinite(d),
            "iteration 3: decoder.layers.1.input_layernorm's sum of squares overflowed fp32 (input rows with |x| up "
            "to 3.4e+20): the norm outputs zeros there, so the lm loss (10.83) stays finite but training learns "
            "nothing; the weights grew during training (largest |w| 2.5e+19, initialized with std 0.02): lower --lr "
            "(now 0.001)");

  // The first iteration of a run: the initial weights, or the loaded ones.
  d.previous_losses.clear();
  d.step.iteration = 1;
  d.step.norm_overflow->layernorm = true;
  d.init_method_std = 1e20;
  d.scan.largest_weight = 4e20;
  EXPECT_EQ(describe_nonfinite(d),
            "iteration 1: decoder.layers.1.input_layernorm's variance overflowed fp32 (input rows with |x| up to "
            "3.4e+20): the norm outputs zeros there, so the lm loss (10.83) stays finite but training learns nothing; "
            "the initial weights are too large (largest |w| 4e+20): check --init-method-std (now 1e+20)");
  d.loaded_from = "ckpt/hf";
  EXPECT_NE(describe_nonfinite(d).find("the weights come from --load ckpt/hf (largest |w| 4e+20): check its values"),
            std::string::npos);
  // A LayerNorm whose mean overflowed outputs NaN: the loss is not finite, and the norm is still the cause named.
  d.step.lm_loss = kNaN;
  EXPECT_NE(describe_nonfinite(d).find("3.4e+20): its output is not usable (lm loss nan); the weights come from"),
            std::string::npos)
      << describe_nonfinite(d);
}

TEST(FiniteCheck, FindsTheFirstNonFiniteElementInEveryFloatingDtype) {
  Tensor f32({2, 3}, DType::kF32);
  EXPECT_EQ(first_nonfinite(f32), std::nullopt);
  f32.data<float>()[4] = -std::numeric_limits<float>::infinity();
  f32.data<float>()[5] = std::nanf("");
  ASSERT_TRUE(first_nonfinite(f32).has_value());
  EXPECT_EQ(first_nonfinite(f32)->index, 4);
  EXPECT_EQ(nonfinite_name(first_nonfinite(f32)->value), "-Inf");
  try {
    require_finite(f32, "w");
    ADD_FAILURE() << "a non-finite tensor must be rejected";
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "w holds a non-finite value (-Inf) at element 4");
  }

  Tensor f64({3}, DType::kF64);
  f64.data<double>()[2] = std::nan("");
  EXPECT_EQ(first_nonfinite(f64)->index, 2);
  EXPECT_EQ(nonfinite_name(first_nonfinite(f64)->value), "NaN");

  // bf16 0x7FC0 is a NaN, 0x7F80 +Inf; fp16 0x7C00 +Inf; 0x3C00 is fp16 1.0 (finite).
  Tensor bf16({2}, DType::kBF16);
  bf16.data<uint16_t>()[1] = 0x7F80;
  EXPECT_EQ(first_nonfinite(bf16)->index, 1);
  EXPECT_EQ(nonfinite_name(first_nonfinite(bf16)->value), "Inf");
  Tensor f16({2}, DType::kF16);
  f16.data<uint16_t>()[0] = 0x3C00;
  EXPECT_EQ(first_nonfinite(f16), std::nullopt);
  f16.data<uint16_t>()[1] = 0x7C00;
  EXPECT_EQ(first_nonfinite(f16)->index, 1);

  // Integer tensors are never non-finite.
  Tensor i64({1}, DType::kI64);
  EXPECT_EQ(first_nonfinite(i64), std::nullopt);
}

}  // namespace
}  // namespace moecore
