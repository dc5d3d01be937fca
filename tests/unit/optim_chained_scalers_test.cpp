// Megatron's chained optimizers under loss scaling: the dense and the routed-expert gradients are unscaled by their
// own scaler's 1 / scale and checked for Inf / NaN separately (each scaler updates on its own overflow).
#include <gtest/gtest.h>

#include <limits>
#include <string>
#include <vector>

#include "moecore/optim/ddp.h"
#include "moecore/optim/distributed_optimizer.h"
#include "moecore/optim/grad_scaler.h"
#include "moecore/parallel/parallel_state.h"

namespace moecore {
namespace {

ParamStore dense_and_expert() {
  ParamStore params;
  for (const bool expert : {false, true}) {
    Param p = make_param(expert ? "decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"
                                : "decoder.layers.0.self_attention.linear_qkv.weight",
                         {6, 4}, InitKind::kNormal);
    p.module = 0;
    p.is_expert = expert;
    init_param(p, 3, 0.5, 4);
    params.push_back(std::move(p));
  }
  return params;
}

class ChainedScalers : public ::testing::TestWithParam<bool> {};  // the distributed optimizer or not

TEST_P(ChainedScalers, EachGroupUnscaledAndCheckedByItsOwnScaler) {
  ParamStore params = dense_and_expert();
  DdpOptions options;
  options.use_distributed_optimizer = GetParam();
  DistributedDataParallel ddp(params, parallel::ParallelState::single_process(), options);
  DistributedAdamW optimizer(ddp, params, AdamWOptions{0.9, 0.95, 1e-8, 0.0});
  const auto fill = [&](const float dense, const float expert) {
    ddp.before_forward(0);
    ddp.zero_grad();
    ddp.set_last_microbatch(true);
    for (Param& p : params) {
      for (int64_t i = 0; i < p.grad.numel(); ++i) p.grad.data<float>()[i] = p.is_expert ? expert : dense;
    }
    ddp.after_backward(0);
    ddp.finish_grad_sync();
  };
  fill(2.0f, 8.0f);
  DistributedAdamW::NonFiniteGrads found = optimizer.unscale_grads_and_check_for_nan(0.5f, 0.25f);
  EXPECT_FALSE(found.dense);
  EXPECT_FALSE(found.expert);
  for (const Param& p : params) {
    for (int64_t i = 0; i < p.grad.numel(); ++i) ASSERT_EQ(p.grad.data<float>()[i], p.is_expert ? 2.0f : 1.0f);
  }
  fill(1.0f, std::numeric_limits<float>::infinity());
  found = optimizer.unscale_grads_and_check_for_nan(1.0f, 1.0f);
  EXPECT_FALSE(found.dense);
  EXPECT_TRUE(found.expert);
  fill(std::numeric_limits<float>::quiet_NaN(), 1.0f);
  found = optimizer.unscale_grads_and_check_for_nan(1.0f, 1.0f);
  EXPECT_TRUE(found.dense);
  EXPECT_FALSE(found.expert);
  fill(1.0f, std::numeric_limits<float>::infinity());
  EXPECT_TRUE(optimizer.unscale_grads_and_check_for_nan(1.0f));  // one scaler: either group
}

INSTANTIATE_TEST_SUITE_P(Optimizer, ChainedScalers, ::testing::Bool());

// Megatron's dynamic scalers diverge when one group overflows and the other does not: the overflowing one backs off
// once its hysteresis is spent, the other counts towards growth.
TEST(ChainedScalers, ScalersUpdateIndependently) {
  DynamicLossScaleOptions options;
  options.initial_scale = 1024.0;
  options.growth_interval = 2;
  options.hysteresis = 1;
  LossScalers scalers{GradScaler::dynamic(options), GradScaler::dynamic(options)};
  for (int i = 0; i < 2; ++i) {
    scalers.dense->update(false);
    scalers.expert->update(true);
  }
  EXPECT_EQ(scalers.dense->scale(), 2048.0f);
  EXPECT_EQ(scalers.expert->scale(), 256.0f);
  EXPECT_EQ(scalers.backward_scale(), 2048.0f);  // ChainedOptimizer.get_loss_scale: the first optimizer's
}

}  // namespace
}  // namespace moecore
