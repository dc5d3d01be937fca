// DistributedDataParallel + DistributedAdamW in one process: the bucket layout (backward order, whole params,
// size threshold, padding), gradient views into the flat buffers, and bit-identical results to AdamWOptimizer for
// every option combination. The multi-rank behaviour is tested under mpirun in tests/parallel/test_ddp.cpp.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "moecore/optim/adamw_optimizer.h"
#include "moecore/optim/ddp.h"
#include "moecore/optim/distributed_optimizer.h"
#include "moecore/parallel/parallel_state.h"
#include "moecore/tensor/memory_tracker.h"
#include "moecore/tensor/rng.h"

namespace moecore {
namespace {

// Registration order; modules -1..3, two expert params, two 1-D no-decay params.
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
  add("decoder.layers.1.mlp.experts.local_experts.1.linear_fc1.weight", {16, 8}, 1, true);
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
    for (int64_t i = 0; i < p.grad.numel(); ++i) {
      p.grad.data<float>()[i] += static_cast<float>(rng.normal(static_cast<uint64_t>(i)));
    }
  }
}

struct Combo {
  int64_t bucket_size;
  bool overlap_grad, dist_opt, overlap_param;
};

class DdpSingleProcess : public ::testing::TestWithParam<Combo> {};

TEST_P(DdpSingleProcess, BitIdenticalToAdamW) {
  const Combo c = GetParam();
  DdpOptions options;
  options.bucket_size = c.bucket_size;
  options.overlap_grad_reduce = c.overlap_grad;
  options.use_distributed_optimizer = c.dist_opt;
  options.overlap_param_gather = c.overlap_param;
  const AdamWOptions adam{0.9, 0.95, 1e-8, 0.1};

  ParamStore ref = make_model();
  AdamWOptimizer ref_opt(ref, adam);
  ParamStore params = make_model();
  DistributedDataParallel ddp(params, parallel::ParallelState::single_process(), options);
  DistributedAdamW opt(ddp, params, adam);

  const double max_norms[3] = {2.0, 1e9, 3.0};
  for (int step = 0; step < 3; ++step) {
    for (int m = -1; m <= 3; ++m) ddp.before_forward(m);
    ddp.zero_grad();
    for (Param& p : ref) p.grad.zero_();
    for (int mb = 0; mb < 2; ++mb) {
      ddp.set_last_microbatch(mb == 1);
      for (int m = 3; m >= -1; --m) {
        fill_grads(params, step, mb, m);
        fill_grads(ref, step, mb, m);
        ddp.after_backward(m);
      }
    }
    ddp.finish_grad_sync();
    const double ref_norm = ref_opt.clip_grad_norm(max_norms[step]);
    const double norm = opt.clip_grad_norm(max_norms[step]);
    EXPECT_EQ(norm, ref_norm) << "step " << step;
    if (step == 0) {
      EXPECT_GT(ref_norm, max_norms[0]);
    }
    ref_opt.step(1e-2);
    opt.step(1e-2);
  }
  ddp.wait_param_gather();
  EXPECT_EQ(opt.steps_taken(), 3);
  for (size_t i = 0; i < params.size(); ++i) {
    ASSERT_EQ(params[i].value.shape(), ref[i].value.shape());
    EXPECT_EQ(std::memcmp(params[i].value.data<float>(), ref[i].value.data<float>(), ref[i].value.nbytes()), 0)
        << params[i].name;
  }
}

INSTANTIATE_TEST_SUITE_P(Options, DdpSingleProcess,
                         ::testing::Values(Combo{0, false, false, false}, Combo{0, true, false, false},
                                           Combo{100, true, false, false}, Combo{0, false, true, false},
                                           Combo{100, false, true, false}, Combo{100, true, true, true},
                                           Combo{1, true, true, true}));

TEST(Ddp, BucketsFollowBackwardOrderAndKeepParamsWhole) {
  ParamStore params = make_model();
  DdpOptions options;
  options.bucket_size = 200;
  DistributedDataParallel ddp(params, parallel::ParallelState::single_process(), options);
  ASSERT_EQ(ddp.groups().size(), 2u);  // dense, expert
  EXPECT_FALSE(ddp.groups()[0].expert);
  EXPECT_TRUE(ddp.groups()[1].expert);
  // Dense in backward order: output 264 (closes), final norm 8 + fc1 bias 31 + fc1 248 (closes), qkv 192 +
  // norm 8 = 200 (closes), embedding 264. Experts: 128 + 128 (closes).
  const std::vector<std::vector<int>> expected = {{8}, {7, 6, 5}, {2, 1}, {0}, {4, 3}};
  ASSERT_EQ(ddp.buckets().size(), expected.size());
  for (size_t b = 0; b < expected.size(); ++b) EXPECT_EQ(ddp.buckets()[b].params, expected[b]) << "bucket " << b;
  for (size_t i = 0; i < params.size(); ++i) {
    const auto& slot = ddp.slots()[i];
    const auto& bucket = ddp.buckets()[static_cast<size_t>(slot.bucket)];
    EXPECT_GE(slot.offset, bucket.begin);
    EXPECT_LE(slot.offset + slot.numel, bucket.end);
    EXPECT_EQ(slot.offset % 16, 0);
    // The grad is a view into the group's buffer.
    EXPECT_EQ(params[i].grad.data<float>(),
              ddp.groups()[static_cast<size_t>(slot.group)].grad_buffer.data<float>() + slot.offset);
  }
  // Megatron's default without overlap: one bucket per group.
  ParamStore params2 = make_model();
  DistributedDataParallel ddp2(params2, parallel::ParallelState::single_process(), DdpOptions{});
  EXPECT_EQ(ddp2.buckets().size(), 2u);
}

TEST(Ddp, DistributedOptimizerRebindsValuesAndPadsBuckets) {
  ParamStore params = make_model();
  const ParamStore before = make_model();
  DdpOptions options;
  options.bucket_size = 200;
  options.use_distributed_optimizer = true;
  DistributedDataParallel ddp(params, parallel::ParallelState::single_process(), options);
  for (const auto& b : ddp.buckets()) {
    EXPECT_EQ((b.end - b.begin) % 128, 0);
    EXPECT_EQ(b.shard_size, b.end - b.begin);
    EXPECT_EQ(b.shard_begin, b.begin);
  }
  for (size_t i = 0; i < params.size(); ++i) {
    const auto& slot = ddp.slots()[i];
    EXPECT_EQ(params[i].value.data<float>(),
              ddp.groups()[static_cast<size_t>(slot.group)].param_buffer.data<float>() + slot.offset);
    EXPECT_EQ(std::memcmp(params[i].value.data<float>(), before[i].value.data<float>(), before[i].value.nbytes()), 0);
  }
}

// A fresh model's zero gradients are released before the flat buffer exists (the gradients' peak memory is one
// copy); gradients already holding values are carried into the buffer.
TEST(Ddp, GradientsMoveIntoTheBufferWithoutASecondCopy) {
  ParamStore params = make_model();
  params[1].grad.data<float>()[5] = 2.5f;  // one gradient with a value, the rest zero
  MemoryTracker& memory = MemoryTracker::instance();
  int64_t old_bytes = 0;
  for (const Param& p : params) old_bytes += p.grad.numel() * static_cast<int64_t>(sizeof(float));
  const int64_t others = memory.current(MemCategory::kGrads) - old_bytes;  // gradients outside this model
  const int64_t nonzero_bytes = params[1].grad.numel() * static_cast<int64_t>(sizeof(float));
  memory.reset_peaks();
  const DistributedDataParallel ddp(params, parallel::ParallelState::single_process(), DdpOptions{});
  const int64_t buffer_bytes = memory.current(MemCategory::kGrads) - others;
  EXPECT_GE(buffer_bytes, old_bytes);
  // The buffer and the one gradient with values coexist; the zero ones were gone before the buffer came.
  EXPECT_LE(memory.peak(MemCategory::kGrads), others + buffer_bytes + nonzero_bytes);
  EXPECT_EQ(params[1].grad.data<float>()[5], 2.5f);
  EXPECT_EQ(params[1].grad.shape(), (std::vector<int64_t>{24, 8}));
  EXPECT_EQ(params[0].grad.shape(), (std::vector<int64_t>{33, 8}));
}

TEST(Ddp, OverlapParamGatherNeedsDistributedOptimizer) {
  ParamStore params = make_model();
  DdpOptions options;
  options.overlap_param_gather = true;
  EXPECT_THROW(DistributedDataParallel(params, parallel::ParallelState::single_process(), options),
               std::invalid_argument);
}

}  // namespace
}  // namespace moecore
