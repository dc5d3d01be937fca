// Megatron-FSDP on DistributedDataParallel in one process: every sharding strategy gives AdamWOptimizer's parameters
// bit for bit over micro-batches and steps; optim_grads_params binds a unit's parameters only between the hooks
// around its forward and backward (gathered into a transient buffer) and sharded gradients only during its backward;
// FsdpUnshardedScope gathers every unit and writes changed values back into the shards. Multi-rank runs against the
// one-process model are the dist.equiv.fsdp_* and dist.fsdp.* tests (tests/parallel).
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "moecore/optim/adamw_optimizer.h"
#include "moecore/optim/ddp.h"
#include "moecore/optim/distributed_optimizer.h"
#include "moecore/optim/fsdp.h"
#include "moecore/parallel/parallel_state.h"
#include "moecore/tensor/memory_tracker.h"
#include "moecore/tensor/rng.h"

namespace moecore {
namespace {

// Registration order; modules -1 (embedding), units 0..2 (one with experts), 3 (final norm, output layer).
ParamStore make_model() {
  ParamStore params;
  const auto add = [&](const std::string& name, const std::vector<int64_t>& shape, const int module,
                       const bool expert) {
    Param p = make_param(name, shape, InitKind::kNormal);
    p.module = module;
    p.is_expert = expert;
    init_param(p, 7, 0.5, 4);
    params.push_back(std::move(p));
  };
  add("embedding.word_embeddings.weight", {33, 8}, -1, false);
  add("decoder.layers.0.linear_qkv.weight", {24, 8}, 0, false);
  add("decoder.layers.0.input_layernorm.weight", {8}, 0, false);
  add("decoder.layers.1.mlp.experts.local_experts.0.linear_fc1.weight", {16, 8}, 1, true);
  add("decoder.layers.1.mlp.shared_experts.linear_fc1.weight", {16, 8}, 1, false);
  add("decoder.layers.2.mlp.linear_fc1.weight", {31, 8}, 2, false);
  add("decoder.layers.2.mlp.linear_fc1.bias", {31}, 2, false);
  add("decoder.final_layernorm.weight", {8}, 3, false);
  add("output_layer.weight", {33, 8}, 3, false);
  return params;
}

void fill_grads(ParamStore& params, const int step, const int mb, const int module) {
  for (Param& p : params) {
    if (p.module != module) continue;
    const CounterRng rng(static_cast<uint64_t>(step * 10 + mb), stream_key(p.name));
    // A forward reads the values: a value-dependent gradient catches a parameter bound to the wrong elements.
    const float* w = std::as_const(p.value).data<float>();
    for (int64_t i = 0; i < p.grad.numel(); ++i) {
      p.grad.data<float>()[i] += static_cast<float>(rng.normal(static_cast<uint64_t>(i))) + 0.1f * w[i];
    }
  }
}

class FsdpSingleProcess : public ::testing::TestWithParam<ShardingStrategy> {};

TEST_P(FsdpSingleProcess, BitIdenticalToAdamW) {
  const ShardingStrategy strategy = GetParam();
  DdpOptions options;
  options.use_distributed_optimizer = strategy != ShardingStrategy::kNoShard;
  options.fsdp = FsdpOptions{strategy, 3};
  const AdamWOptions adam{0.9, 0.95, 1e-8, 0.1};
  const bool zero3 = strategy == ShardingStrategy::kOptimGradsParams;
  const bool sharded_grads = zero3 || strategy == ShardingStrategy::kOptimGrads;

  ParamStore ref = make_model();
  AdamWOptimizer ref_opt(ref, adam);
  ParamStore params = make_model();
  DistributedDataParallel ddp(params, parallel::ParallelState::single_process(), options);
  DistributedAdamW opt(ddp, params, adam);
  // Units hold no whole values (ZeRO-3) or gradients (sharded gradients) between their uses; the rest always do.
  const auto check_unbound = [&] {
    for (const Param& p : params) {
      const bool unit = p.module >= 0 && p.module < 3;
      EXPECT_EQ(p.value.defined(), !(unit && zero3)) << p.name;
      EXPECT_EQ(p.grad.defined(), !(unit && sharded_grads)) << p.name;
    }
  };
  check_unbound();

  const double max_norms[3] = {2.0, 1e9, 3.0};
  for (int step = 0; step < 3; ++step) {
    ddp.zero_grad();
    for (Param& p : ref) p.grad.zero_();
    for (int mb = 0; mb < 2; ++mb) {
      ddp.set_last_microbatch(mb == 1);
      for (int m = -1; m <= 3; ++m) {
        ddp.before_forward(m);
        constexpr size_t kFirstParam[] = {0, 1, 3, 5, 7};  // of modules -1..3
        EXPECT_TRUE(params[kFirstParam[m + 1]].value.defined()) << "module " << m;
        ddp.after_forward(m);
      }
      if (zero3) {
        EXPECT_FALSE(params[1].value.defined());
      }
      for (int m = 3; m >= -1; --m) {
        ddp.before_backward(m);
        if (m == 1) {  // a forward recomputed inside the unit's backward keeps its parameters, prefetches nothing
          const int64_t comm = MemoryTracker::instance().current(MemCategory::kComm);
          ddp.before_forward(m);
          ddp.after_forward(m);
          EXPECT_TRUE(params[3].value.defined());
          EXPECT_EQ(MemoryTracker::instance().current(MemCategory::kComm), comm);
        }
        fill_grads(params, step, mb, m);
        fill_grads(ref, step, mb, m);
        ddp.after_backward(m);
      }
      check_unbound();
    }
    ddp.finish_grad_sync();
    EXPECT_EQ(opt.clip_grad_norm(max_norms[step]), ref_opt.clip_grad_norm(max_norms[step])) << "step " << step;
    ref_opt.step(1e-2);
    opt.step(1e-2);
    check_unbound();
  }
  ddp.wait_param_gather();
  const FsdpUnshardedScope unsharded(ddp, false);
  for (size_t i = 0; i < params.size(); ++i) {
    ASSERT_EQ(params[i].value.shape(), ref[i].value.shape());
    EXPECT_EQ(std::memcmp(params[i].value.data<float>(), ref[i].value.data<float>(), ref[i].value.nbytes()), 0)
        << params[i].name;
  }
}

INSTANTIATE_TEST_SUITE_P(Strategies, FsdpSingleProcess,
                         ::testing::Values(ShardingStrategy::kNoShard, ShardingStrategy::kOptim,
                                           ShardingStrategy::kOptimGrads, ShardingStrategy::kOptimGradsParams),
                         [](const ::testing::TestParamInfo<ShardingStrategy>& p) {
                           return std::string(sharding_strategy_name(p.param));
                         });

TEST(Fsdp, GatheredParametersAreTransientAndWrittenBack) {
  ParamStore params = make_model();
  DdpOptions options;
  options.use_distributed_optimizer = true;
  options.fsdp = FsdpOptions{ShardingStrategy::kOptimGradsParams, 3};
  MemoryTracker& tracker = MemoryTracker::instance();
  const int64_t comm_before = tracker.current(MemCategory::kComm);
  DistributedDataParallel ddp(params, parallel::ParallelState::single_process(), options);
  const int64_t comm_idle = tracker.current(MemCategory::kComm);
  ddp.before_forward(0);
  EXPECT_GT(tracker.current(MemCategory::kComm), comm_idle);  // unit 0 gathered, unit 1 prefetched
  ddp.after_forward(0);
  ddp.before_forward(1);
  ddp.after_forward(1);
  ddp.before_forward(2);
  ddp.after_forward(2);
  EXPECT_EQ(tracker.current(MemCategory::kComm), comm_idle);
  EXPECT_GE(comm_idle, comm_before);
  {
    const FsdpUnshardedScope unsharded(ddp, true);
    for (Param& p : params) p.value.data<float>()[0] = 3.5f;
  }
  EXPECT_FALSE(params[1].value.defined());
  const FsdpUnshardedScope again(ddp, false);
  for (const Param& p : params) EXPECT_EQ(std::as_const(p.value).data<float>()[0], 3.5f) << p.name;
  EXPECT_EQ(parse_sharding_strategy("optim_grads"), ShardingStrategy::kOptimGrads);
  EXPECT_FALSE(parse_sharding_strategy("zero3").has_value());
}

TEST(Fsdp, OneBucketPerModuleAndKindExpertsApart) {
  ParamStore params = make_model();
  DdpOptions options;
  options.use_distributed_optimizer = true;
  options.fsdp = FsdpOptions{ShardingStrategy::kOptimGradsParams, 3};
  const DistributedDataParallel ddp(params, parallel::ParallelState::single_process(), options);
  for (const DistributedDataParallel::Bucket& b : ddp.buckets()) {
    ASSERT_EQ(b.modules.size(), 1u);
    const int m = b.modules.front();
    EXPECT_EQ(b.unit, m >= 0 && m < 3) << "module " << m;
    EXPECT_EQ(b.params_sharded, b.unit);
    EXPECT_EQ(b.grads_sharded, b.unit);
    for (const int i : b.params) {
      EXPECT_EQ(params[static_cast<size_t>(i)].module, m);
      // Megatron's expert detection (".experts." in the name): the shared experts are dense.
      const bool routed = params[static_cast<size_t>(i)].name.find(".experts.") != std::string::npos;
      EXPECT_EQ(ddp.groups()[static_cast<size_t>(b.group)].expert, routed) << params[static_cast<size_t>(i)].name;
    }
  }
  // Modules -1, 0, 1 (dense and expert), 2, 3.
  EXPECT_EQ(ddp.buckets().size(), 6u);
}

TEST(Fsdp, RefusesWhatItDoesNotImplement) {
  ParamStore params = make_model();
  DdpOptions options;
  options.fsdp = FsdpOptions{ShardingStrategy::kOptimGradsParams, 3};
  EXPECT_THROW(DistributedDataParallel(params, parallel::ParallelState::single_process(), options),
               std::invalid_argument);  // sharding without the distributed optimizer
  options.use_distributed_optimizer = true;
  options.quantized_param_gather = true;  // --fp8-param-gather / --fp4-param-gather
  EXPECT_THROW(DistributedDataParallel(params, parallel::ParallelState::single_process(), options),
               std::invalid_argument);
}

}  // namespace
}  // namespace moecore
