// The planner's Megatron-FSDP terms (--use-megatron-fsdp --data-parallel-sharding-strategy) on the GPU models:
// Mixtral-8x7B's parameter counts worked out by hand from its Hugging Face config, sharded as Megatron-FSDP's
// param_and_grad_buffer.py distributes its buffers per strategy; the units' collectives in the time model; the
// refusals `moecore train` gives. The CPU engine's model is checked against measured runs (e2e.plan_memory_measured).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "moecore/config/arguments.h"
#include "moecore/plan/layout_search.h"
#include "moecore/plan/memory_model.h"
#include "moecore/plan/plan_args.h"
#include "moecore/plan/time_model.h"
#include "unit/test_source_dir.h"

namespace moecore::plan {
namespace {

namespace fs = std::filesystem;
using Flags = std::vector<std::string>;

using test::source_dir;

Flags operator+(Flags a, const Flags& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// Mixtral-8x7B on 64 H100s, TP1 PP1 EP8: dp-cp 64, expert-DP 8.
Flags mixtral_dp64_ep8() {
  return Flags{"--hf-config",
               (source_dir() / "tests/unit/data/hf_configs/mixtral_8x7b.json").string(),
               "--seq-length",
               "4096",
               "--bf16",
               "--moe-grouped-gemm",
               "--num-gpus",
               "64",
               "--gpu",
               "H100",
               "--expert-model-parallel-size",
               "8",
               "--micro-batch-size",
               "1",
               "--global-batch-size",
               "256"};
}

Flags fsdp(const std::string& strategy) {
  return {"--use-megatron-fsdp", "--data-parallel-sharding-strategy", strategy};
}

StageMemory worst(const Flags& flags) { return estimate_plan_memory(parse_plan_args(flags)).worst(); }

// Mixtral-8x7B per rank under EP8 (h 4096, 32 layers, ffn 14336, 8 experts, 32 heads, 8 KV groups of 128, vocab
// 32000, untied, RMSNorm, SwiGLU, no biases): one decoder layer's dense elements (QKV, output projection, two norms,
// router) and its routed experts' share, and what lies outside the units (embedding, output layer, final norm).
constexpr double kLayerDense = 4096.0 * (4096 + 2 * 1024) + 4096.0 * 4096 + 2 * 4096 + 8 * 4096;
constexpr double kLayerExperts = 8.0 * 3 * 14336 * 4096 / 8;
constexpr double kUnitDense = 32 * kLayerDense, kUnitExperts = 32 * kLayerExperts;
constexpr double kOutside = 2.0 * 32000 * 4096 + 4096;
constexpr double kAll = kUnitDense + kUnitExperts + kOutside;

void expect_bytes(const double value, const double expected, const std::string& what) {
  EXPECT_NEAR(value, expected, 1e-9 * expected) << what;
}

TEST(PlanFsdp, GpuBuffersPerStrategyAsMegatronFsdp) {
  const double dp = 64, edp = 8;
  const double units_kept = kUnitDense / dp + kUnitExperts / edp;  // this rank's shard of its units
  const double shard = (kUnitDense + kOutside) / dp + kUnitExperts / edp;
  // bf16 weights and main gradients (main grads dtype: the weights'), fp32 main weights + two fp32 Adam moments.
  const StageMemory no_shard = worst(mixtral_dp64_ep8() + fsdp("no_shard"));
  expect_bytes(no_shard.weights, 2 * kAll, "no_shard weights");
  expect_bytes(no_shard.grads, 2 * kAll, "no_shard gradients");
  expect_bytes(no_shard.main_weights_and_optimizer, 12 * kAll, "no_shard main weights and Adam states");

  const StageMemory optim = worst(mixtral_dp64_ep8() + fsdp("optim"));
  expect_bytes(optim.weights, 2 * kAll, "optim weights");
  expect_bytes(optim.grads, 2 * kAll, "optim gradients");
  expect_bytes(optim.main_weights_and_optimizer, 12 * shard, "optim main weights and Adam states");

  const StageMemory optim_grads = worst(mixtral_dp64_ep8() + fsdp("optim_grads"));
  expect_bytes(optim_grads.weights, 2 * kAll, "optim_grads weights");
  expect_bytes(optim_grads.grads, 2 * (kOutside + units_kept), "optim_grads gradients");
  expect_bytes(optim_grads.main_weights_and_optimizer, 12 * shard, "optim_grads main weights and Adam states");

  const StageMemory zero3 = worst(mixtral_dp64_ep8() + fsdp("optim_grads_params"));
  expect_bytes(zero3.weights, 2 * (kOutside + units_kept), "optim_grads_params weights");
  expect_bytes(zero3.grads, 2 * (kOutside + units_kept), "optim_grads_params gradients");
  expect_bytes(zero3.main_weights_and_optimizer, 12 * shard, "optim_grads_params main weights and Adam states");

  // Transient: two units' whole gradient buffers (optim_grads), and two units' gathered weights too (ZeRO-3), on
  // top of the layer's communication buffers every strategy has.
  const double unit = kLayerDense + kLayerExperts;
  expect_bytes(optim.comm_buffers, no_shard.comm_buffers, "optim's communication buffers");
  expect_bytes(optim_grads.comm_buffers - optim.comm_buffers, 2 * unit * 2, "optim_grads unit gradient buffers");
  expect_bytes(zero3.comm_buffers - optim.comm_buffers, 2 * unit * (2 + 2), "optim_grads_params unit buffers");
}

TEST(PlanFsdp, Fp32WeightsKeepAnFp32MainCopy) {
  // megatron_fsdp_main_params_dtype defaults to fp32 and is not None, so fp32 weights get a main-weight buffer too.
  Flags flags = mixtral_dp64_ep8();
  flags.erase(std::find(flags.begin(), flags.end(), "--bf16"));
  const StageMemory optim = worst(flags + fsdp("optim"));
  const double shard = (kUnitDense + kOutside) / 64 + kUnitExperts / 8;
  expect_bytes(optim.weights, 4 * kAll, "fp32 weights");
  expect_bytes(optim.main_weights_and_optimizer, 12 * shard, "fp32 main weights and Adam states");
}

TEST(PlanFsdp, ZeroThreeMovesMoreThanZeroTwo) {
  // Over 64 ranks of 8-GPU NVLink domains every unit's gather crosses the slower links: gathering each unit twice per
  // micro-batch costs more than the reduce-scatters alone, and more than no_shard's one all-reduce per step.
  const PlanArgs zero3 = parse_plan_args(mixtral_dp64_ep8() + fsdp("optim_grads_params"));
  const PlanArgs zero2 = parse_plan_args(mixtral_dp64_ep8() + fsdp("optim_grads"));
  const PlanArgs no_shard = parse_plan_args(mixtral_dp64_ep8() + fsdp("no_shard"));
  const double zero3_s = estimate_step_time(zero3).dp_comm_s;
  EXPECT_GT(zero3_s, estimate_step_time(zero2).dp_comm_s);
  EXPECT_GT(zero3_s, estimate_step_time(no_shard).dp_comm_s);
  // Four times the micro-batches: ZeRO-3's per-micro-batch gathers grow, no_shard's step collective does not.
  const PlanArgs zero3_more =
      parse_plan_args(mixtral_dp64_ep8() + fsdp("optim_grads_params") + Flags{"--global-batch-size", "1024"});
  const PlanArgs no_shard_more =
      parse_plan_args(mixtral_dp64_ep8() + fsdp("no_shard") + Flags{"--global-batch-size", "1024"});
  EXPECT_GT(estimate_step_time(zero3_more).dp_comm_s, zero3_s);
  EXPECT_DOUBLE_EQ(estimate_step_time(no_shard_more).dp_comm_s, estimate_step_time(no_shard).dp_comm_s);
}

TEST(PlanFsdp, SearchKeepsTheStrategy) {
  // --search with --use-megatron-fsdp ranks FSDP layouts: every valid candidate with data parallelism keeps ZeRO-3
  // shards of its weights.
  const std::vector<Candidate> candidates =
      search_layouts(parse_plan_args(mixtral_dp64_ep8() + fsdp("optim_grads_params") + Flags{"--search"}));
  ASSERT_FALSE(candidates.empty());
  int checked = 0;
  for (const Candidate& c : candidates) {
    if (!c.memory) continue;
    const double whole = 2 * (c.memory->fsdp.dense + c.memory->fsdp.expert);
    // Neither data parallelism nor expert-DP: nothing to shard.
    if (64 / (c.layout.tp * c.layout.pp) == 1 && 64 / (c.layout.etp * c.layout.ep * c.layout.pp) == 1) {
      EXPECT_DOUBLE_EQ(c.memory->weights, whole) << c.layout.describe();
      continue;
    }
    EXPECT_LT(c.memory->weights, whole) << c.layout.describe();
    ++checked;
  }
  EXPECT_GT(checked, 0);
}

TEST(PlanFsdp, RefusesWhatTrainRefuses) {
  const auto message = [](const Flags& flags) {
    try {
      parse_plan_args(flags);
    } catch (const ConfigError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_EQ(message(mixtral_dp64_ep8() + fsdp("optim_grads_params")), "no error");
  EXPECT_NE(message(mixtral_dp64_ep8() + Flags{"--data-parallel-sharding-strategy", "optim"})
                .find("needs --use-megatron-fsdp"),
            std::string::npos);
  EXPECT_NE(message(mixtral_dp64_ep8() + fsdp("optim") + Flags{"--grad-reduce-in-bf16"}).find("--grad-reduce-in-bf16"),
            std::string::npos);
  EXPECT_NE(message(mixtral_dp64_ep8() + fsdp("optim") + Flags{"--fp8-format", "e4m3", "--fp8-param-gather"})
                .find("--fp8-param-gather"),
            std::string::npos);
  EXPECT_NE(message(mixtral_dp64_ep8() + fsdp("optim") + Flags{"--use-precision-aware-optimizer"})
                .find("--use-precision-aware-optimizer"),
            std::string::npos);
}

}  // namespace
}  // namespace moecore::plan
