// The training state of a one-process tiny MoE model (a dense and an MoE layer, 4 experts, gated shared expert,
// expert bias, untied output layer): the router's expert bias is a named buffer, every key is present in order with
// its global shape, scalars hold the progress / scheduler / seed, and after one AdamW step on known gradients the
// moment entries hold Adam's first-step moments (1 - beta1) g and (1 - beta2) g^2.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "moecore/config/arguments.h"
#include "moecore/train/training_setup.h"
#include "moecore/train/training_state.h"
#include "unit/training_state_fixture.h"

namespace moecore {
namespace {

constexpr const char* kExpertBias = "decoder.layers.1.mlp.router.expert_bias";

TrainingArgs tiny_moe_args(const bool distributed_optimizer = false) {
  std::vector<std::string> flags = test::training_state_flags();
  flags.insert(flags.end(), {"--lr-decay-iters", "10"});
  if (distributed_optimizer) flags.emplace_back("--use-distributed-optimizer");
  const TrainingArgs args = parse_train_args(flags);
  return with_padded_vocabulary(args, build_vocabulary(args));
}

// A gradient value for element f of parameter `name` (a multiple of 1/64, some zero).
float grad_value(const std::string& name, const int64_t f) {
  return static_cast<float>((f * 7 + static_cast<int64_t>(name.size()) * 3) % 17 - 8) / 64.0f;
}

TEST(ModelBuffers, ExpertBiasIsANamedBufferTheRouterUpdates) {
  const TrainingArgs args = tiny_moe_args();
  GPTModel model(args.model, 7);
  ASSERT_EQ(model.named_buffers().size(), 1u);  // the dense layer 0 has none
  const Buffer& bias = model.named_buffers()[0];
  EXPECT_EQ(bias.name, kExpertBias);
  EXPECT_EQ(bias.value.shape(), (std::vector<int64_t>{4}));
  EXPECT_EQ(bias.value.dtype(), DType::kF32);
  EXPECT_EQ(bias.shard.num_shards, 1);
  EXPECT_EQ(bias.shard.full_shape, (std::vector<int64_t>{4}));
  EXPECT_EQ(model.expert_bias(0), nullptr);
  EXPECT_EQ(model.expert_bias(1), &bias);
  EXPECT_EQ(&model.buffer(kExpertBias), &bias);
  EXPECT_THROW((void)model.buffer("decoder.layers.0.mlp.router.expert_bias"), std::out_of_range);
  for (const float b : bias.value.span<float>()) EXPECT_EQ(b, 0.0f);

  // A training forward counts tokens per expert; the once-per-global-batch sign rule moves the registered buffer.
  const int64_t B = 2, S = 16;
  std::vector<int32_t> tokens(B * S), labels(B * S);
  for (int64_t i = 0; i < B * S; ++i) {
    tokens[static_cast<size_t>(i)] = static_cast<int32_t>((i * 37 + 11) % 250);
    labels[static_cast<size_t>(i)] = static_cast<int32_t>((i * 53 + 5) % 250);
  }
  std::unique_ptr<MicroBatchContext> ctx;
  model.forward(ctx, tokens.data(), labels.data(), nullptr, B, S, ForwardOptions{});
  model.finish_global_batch();
  int moved = 0;
  for (const float b : bias.value.span<float>()) moved += std::abs(b) == 1e-3f ? 1 : 0;
  EXPECT_GT(moved, 0) << "the sign rule (rate 1e-3) did not reach the named buffer";
}

TEST(TrainingState, KeysInOrderWithGlobalShapes) {
  const TrainingArgs args = tiny_moe_args();
  const ModelAndOptimizer mo = build_model_and_optimizer(args, parallel::ParallelState::single_process());
  const LRSchedule schedule(lr_schedule_config(args));
  const StateDict state = training_state(*mo.model, *mo.optimizer, schedule, TrainingProgress{}, args.seed);

  std::vector<std::string> want;
  for (const Param& p : mo.model->params()) want.push_back(p.name);
  want.emplace_back(kExpertBias);
  for (const Param& p : mo.model->params()) want.push_back("optimizer.state.exp_avg." + p.name);
  for (const Param& p : mo.model->params()) want.push_back("optimizer.state.exp_avg_sq." + p.name);
  for (const char* key :
       {"optimizer.step", "lr_scheduler.max_lr", "lr_scheduler.lr_warmup_steps", "lr_scheduler.num_steps",
        "lr_scheduler.lr_decay_style", "lr_scheduler.lr_decay_steps", "lr_scheduler.min_lr", "lr_scheduler.start_wd",
        "lr_scheduler.end_wd", "lr_scheduler.wd_incr_steps", "lr_scheduler.wd_incr_style", "iteration",
        "consumed_train_samples", "consumed_valid_samples", "num_floating_point_operations_so_far", "rng.seed"}) {
    want.emplace_back(key);
  }
  EXPECT_EQ(state.keys(), want);

  // Global shapes (H 32, padded V 256, E 4, expert ffn 32 with SwiGLU's fused fc1, shared expert 32).
  const std::vector<std::pair<std::string, std::vector<int64_t>>> shapes = {
      {"embedding.word_embeddings.weight", {256, 32}},
      {"embedding.position_embeddings.weight", {16, 32}},
      {"output_layer.weight", {256, 32}},
      {"decoder.layers.0.mlp.linear_fc1.weight", {128, 32}},
      {"decoder.layers.1.mlp.router.weight", {4, 32}},
      {kExpertBias, {4}},
      {"decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight", {64, 32}},
      {"decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.weight", {32, 32}},
      {"decoder.layers.1.mlp.shared_experts.gate_weight", {1, 32}},
      {"optimizer.state.exp_avg_sq.decoder.layers.1.mlp.experts.local_experts.0.linear_fc2.weight", {32, 32}},
      {"optimizer.step", {}},
  };
  for (const auto& [key, shape] : shapes) EXPECT_EQ(state.at(key).global_shape, shape) << key;

  // Tensor entries are the live tensors, whole (one process: no shard, no flat range).
  for (const Param& p : mo.model->params()) {
    const StateEntry& e = state.at(p.name);
    EXPECT_EQ(e.local.data<float>(), p.value.data<float>()) << p.name;
    EXPECT_EQ(e.placement.shard.num_shards, 1) << p.name;
    EXPECT_FALSE(e.placement.flat()) << p.name;
    EXPECT_EQ(e.dtype, DType::kF32);
    EXPECT_EQ(state.at("optimizer.state.exp_avg." + p.name).local.shape(), p.value.shape()) << p.name;
  }
  EXPECT_EQ(state.at(kExpertBias).local.data<float>(), mo.model->buffer(kExpertBias).value.data<float>());
}

TEST(TrainingState, ScalarsHoldProgressSchedulerAndSeed) {
  const TrainingArgs args = tiny_moe_args();
  const ModelAndOptimizer mo = build_model_and_optimizer(args, parallel::ParallelState::single_process());
  LRSchedule schedule(lr_schedule_config(args));
  for (int i = 0; i < 3; ++i) schedule.step(args.global_batch_size);
  TrainingProgress progress;
  progress.iteration = 3;
  progress.consumed_train_samples = 24;
  progress.consumed_valid_samples = 16;
  progress.floating_point_operations_so_far = 1.5e9;
  const StateDict state = training_state(*mo.model, *mo.optimizer, schedule, progress, 7);
  EXPECT_EQ(state.i64("iteration"), 3);
  EXPECT_EQ(state.i64("consumed_train_samples"), 24);
  EXPECT_EQ(state.i64("consumed_valid_samples"), 16);
  EXPECT_EQ(state.f64("num_floating_point_operations_so_far"), 1.5e9);
  EXPECT_EQ(state.i64("rng.seed"), 7);
  EXPECT_EQ(state.i64("optimizer.step"), 0);
  // Megatron's scheduler counts samples: 3 iterations x 8, warmup 2 x 8, decay 10 x 8.
  EXPECT_EQ(state.i64("lr_scheduler.num_steps"), 24);
  EXPECT_EQ(state.f64("lr_scheduler.lr_warmup_steps"), 16.0);
  EXPECT_EQ(state.f64("lr_scheduler.lr_decay_steps"), 80.0);
  EXPECT_EQ(state.i64("lr_scheduler.lr_decay_style"), 2);  // cosine
  EXPECT_EQ(state.f64("lr_scheduler.max_lr"), 1e-3);
  EXPECT_EQ(state.f64("lr_scheduler.min_lr"), 1e-5);
  EXPECT_EQ(state.f64("lr_scheduler.start_wd"), 0.05);
  EXPECT_EQ(state.f64("lr_scheduler.end_wd"), 0.05);
  EXPECT_EQ(state.f64("lr_scheduler.wd_incr_steps"), 10.0 * 8.0);  // --train-iters x global batch
  EXPECT_EQ(state.i64("lr_scheduler.wd_incr_style"), 0);           // constant
}

class TrainingStateMoments : public testing::TestWithParam<bool> {};

TEST_P(TrainingStateMoments, HoldAdamsFirstStep) {
  const TrainingArgs args = tiny_moe_args(GetParam());
  const ModelAndOptimizer mo = build_model_and_optimizer(args, parallel::ParallelState::single_process());
  mo.ddp->zero_grad();
  for (Param& p : mo.model->params()) {
    float* g = p.grad.data<float>();
    for (int64_t i = 0; i < p.grad.numel(); ++i) g[i] = grad_value(p.name, i);
  }
  mo.ddp->finish_grad_sync();
  mo.optimizer->step(1e-3);
  mo.ddp->wait_param_gather();
  const LRSchedule schedule(lr_schedule_config(args));
  const StateDict state = training_state(*mo.model, *mo.optimizer, schedule, TrainingProgress{}, args.seed);
  EXPECT_EQ(state.i64("optimizer.step"), 1);
  for (const Param& p : mo.model->params()) {
    const StateEntry& m = state.at("optimizer.state.exp_avg." + p.name);
    const StateEntry& v = state.at("optimizer.state.exp_avg_sq." + p.name);
    ASSERT_EQ(m.local.numel(), p.value.numel()) << p.name;  // one process: every moment is here, whole
    EXPECT_FALSE(m.placement.flat()) << p.name;
    for (int64_t i = 0; i < p.value.numel(); ++i) {
      const double g = grad_value(p.name, i);
      ASSERT_FLOAT_EQ(m.local.data<float>()[i], static_cast<float>((1.0 - args.adam_beta1) * g)) << p.name << " " << i;
      ASSERT_FLOAT_EQ(v.local.data<float>()[i], static_cast<float>((1.0 - args.adam_beta2) * g * g))
          << p.name << " " << i;
    }
    EXPECT_EQ(state.at(p.name).local.data<float>(), p.value.data<float>()) << p.name;
  }
}

INSTANTIATE_TEST_SUITE_P(ReplicatedAndDistributed, TrainingStateMoments, testing::Bool());

// Distributed-optimizer pieces become flat ranges of the parameter's local tensor; a parameter with no piece on this
// rank is listed with an empty range so every rank has the same keys.
TEST(TrainingState, OptimizerPiecesAreFlatRanges) {
  ParamStore params;
  params.push_back(make_param("a", {2, 3}, InitKind::kZeros));
  params.push_back(make_param("b", {4}, InitKind::kZeros));
  const Tensor m_a(std::vector<int64_t>{3}, DType::kF32), v_a(std::vector<int64_t>{3}, DType::kF32);
  StateDict state;
  add_optimizer_state(state, params, {AdamWMomentSlice{0, 2, 5, m_a, v_a, Tensor()}}, 4);
  EXPECT_EQ(state.keys(), (std::vector<std::string>{"optimizer.state.exp_avg.a", "optimizer.state.exp_avg.b",
                                                    "optimizer.state.exp_avg_sq.a", "optimizer.state.exp_avg_sq.b",
                                                    "optimizer.step"}));
  const StateEntry& a = state.at("optimizer.state.exp_avg.a");
  EXPECT_EQ(a.global_shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(a.placement.flat_begin, 2);
  EXPECT_EQ(a.placement.flat_end, 5);
  EXPECT_EQ(a.local.data<float>(), m_a.data<float>());
  EXPECT_EQ(global_index(a.placement, 0), 2);
  const StateEntry& b = state.at("optimizer.state.exp_avg_sq.b");
  EXPECT_EQ(b.global_shape, (std::vector<int64_t>{4}));
  EXPECT_TRUE(b.placement.flat());
  EXPECT_EQ(b.local.numel(), 0);
  EXPECT_EQ(state.i64("optimizer.step"), 4);

  StateDict twice;
  EXPECT_THROW(add_optimizer_state(
                   twice, params,
                   {AdamWMomentSlice{0, 0, 3, m_a, v_a, Tensor()}, AdamWMomentSlice{0, 3, 6, m_a, v_a, Tensor()}}, 1),
               std::logic_error);
}

}  // namespace
}  // namespace moecore
