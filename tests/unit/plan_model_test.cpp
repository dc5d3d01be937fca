// The planner's memory and time models against the Megatron-Core MoE report (arXiv 2603.07685): its DeepSeek-V3
// memory study (Table 3, the memory-efficient permutation, Table 4's recompute savings, FP8 activations), its
// best-found configurations (Table 20 with Table 11's measured TFLOP/s per GPU) and its Mixtral-8x7B finding.
// The figures are gathered in shared/reference/paper-tables.md; the report's "GB" are GiB (2^30 bytes): its
// weights-and-gradients and optimizer rows are 6 and 12 bytes per parameter of 16 DeepSeek-V3 MoE layers in GiB.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <sstream>
#include <string>
#include <vector>

#include "moecore/plan/layout_search.h"
#include "moecore/plan/memory_model.h"
#include "moecore/plan/plan_args.h"
#include "moecore/plan/plan_command.h"
#include "moecore/plan/time_model.h"
#include "unit/test_source_dir.h"

namespace moecore::plan {
namespace {

namespace fs = std::filesystem;
using Flags = std::vector<std::string>;

using test::source_dir;

Flags hf(const std::string& name) {
  return {"--hf-config", (source_dir() / "tests/unit/data/hf_configs" / (name + ".json")).string()};
}

Flags operator+(Flags a, const Flags& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

const Flags kCommon = {"--bf16",
                       "--use-distributed-optimizer",
                       "--overlap-grad-reduce",
                       "--overlap-param-gather",
                       "--moe-grouped-gemm",
                       "--attention-dropout",
                       "0",
                       "--hidden-dropout",
                       "0"};

// DeepSeek-V3 (MTP 1) on 256 GPUs, TP1 PP4 VPP4 EP64, the report's memory study. The report does not print its
// pipeline layout; this one gives the first virtual stages of ranks 0 and 1 (the ranks keeping the most
// micro-batches alive in the interleaved schedule) three layers, the others four, and MTP and the loss the last.
Flags deepseek_memory_study() {
  return hf("deepseek_v3") + kCommon +
         Flags{"--seq-length",
               "4096",
               "--num-gpus",
               "256",
               "--gpu",
               "GB200",
               "--pipeline-model-parallel-size",
               "4",
               "--pipeline-model-parallel-layout",
               "Et*3|t*3|(tttt|)*13,tttmL",
               "--expert-model-parallel-size",
               "64",
               "--micro-batch-size",
               "1",
               "--global-batch-size",
               "8192",
               "--no-moe-memory-efficient-permutation"};
}

StageMemory worst(const Flags& flags) { return estimate_plan_memory(parse_plan_args(flags)).worst(); }

double gib(const double bytes) { return bytes / kGiB; }

void expect_within(const double value, const double expected, const double relative, const std::string& what) {
  EXPECT_NEAR(value, expected, relative * expected) << what << ": " << value << " vs " << expected;
}

TEST(PlanMemory, DeepSeekV3MemoryStudyTable3) {
  const StageMemory m = worst(deepseek_memory_study());
  expect_within(gib(m.weights_and_grads()), 36.4, 0.10, "weights and gradients");
  expect_within(gib(m.main_weights_and_optimizer), 32.1, 0.10, "main weights and optimizer");
  expect_within(gib(m.activations), 131.0, 0.10, "activations");
  expect_within(gib(m.total()), 199.5, 0.10, "total");
}

TEST(PlanMemory, DeepSeekV3SavingsOfEachOptimization) {
  const double base = gib(worst(deepseek_memory_study()).total());
  const auto saving = [&](const Flags& extra) { return base - gib(worst(deepseek_memory_study() + extra).total()); };
  // Memory-efficient permutation: the probabilities applied before fc2 (the default), 26.3 GB.
  Flags efficient = deepseek_memory_study();
  efficient.erase(std::find(efficient.begin(), efficient.end(), "--no-moe-memory-efficient-permutation"));
  expect_within(base - gib(worst(efficient).total()), 26.3, 0.15, "memory-efficient permutation");
  // Table 4: MLA up-projection 30.4 GB and LayerNorm 8.2 GB in BF16.
  expect_within(saving({"--recompute-granularity", "selective", "--recompute-modules", "mla_up_proj"}), 30.4, 0.15,
                "mla_up_proj recompute");
  expect_within(saving({"--recompute-granularity", "selective", "--recompute-modules", "layernorm"}), 8.2, 0.15,
                "layernorm recompute");
  // SwiGLU 3.8 GB: the fc2 inputs it discards are one byte per element, i.e. Table 4's figure matches FP8 activations
  // (in BF16 the model gives twice that: 8 x 2048 bf16 values per token and layer).
  const Flags fp8 = {"--fp8-format", "e4m3", "--fp8-recipe", "mxfp8"};
  const double fp8_base = gib(worst(deepseek_memory_study() + fp8).total());
  const double swiglu =
      fp8_base - gib(worst(deepseek_memory_study() + fp8 +
                           Flags{"--recompute-granularity", "selective", "--recompute-modules", "moe_act"})
                         .total());
  expect_within(swiglu, 3.8, 0.15, "moe_act recompute under FP8");
  // FP8 activations, "about 16 GB": linear layers keep their inputs in one byte, except linear_proj, which keeps
  // the attention output the attention backward keeps anyway (Megatron's set_save_original_input), and the shared
  // experts' fc1, whose input the router keeps in BF16.
  expect_within(base - fp8_base, 16.0, 0.20, "FP8 activations");
}

// The precision-aware optimizer's main parameters: bf16 weights' fp32 master as 16-bit remainders where Megatron
// stores them (TE holding the master weights: no FP8, --fp8-recipe delayed, FP4), a full fp32 copy under the other FP8
// recipes (optimizer_config.py: use_precision_aware_optimizer_no_fp8_or_ds_fp8). Per shard element 4 + 4 + 2 bytes
// against 4 + 4 + 4; moecore's CPU engine counts the same 2 bytes per element.
TEST(PlanMemory, PrecisionAwareMainParamsAsMegatron) {
  const Flags base = hf("mixtral_8x7b") + kCommon +
                     Flags{"--use-precision-aware-optimizer",
                           "--seq-length",
                           "4096",
                           "--num-gpus",
                           "64",
                           "--micro-batch-size",
                           "1",
                           "--global-batch-size",
                           "256",
                           "--expert-model-parallel-size",
                           "8"};
  for (const char* gpu : {"H100", "cpu"}) {
    const auto optimizer = [&](const Flags& extra) {
      return worst(base + Flags{"--gpu", gpu} + extra).main_weights_and_optimizer;
    };
    const double remainders = optimizer({});
    EXPECT_EQ(optimizer({"--fp8-format", "e4m3"}), remainders) << gpu << ": delayed";
    EXPECT_EQ(optimizer({"--fp4-format", "e2m1"}), remainders) << gpu << ": FP4";
    for (const char* recipe : {"tensorwise", "blockwise", "mxfp8"}) {
      const double full = optimizer({"--fp8-format", "e4m3", "--fp8-recipe", recipe});
      if (std::string(gpu) == "H100") {
        EXPECT_NEAR(full / remainders, 12.0 / 10.0, 1e-9) << gpu << " " << recipe;
      } else {
        EXPECT_GT(full, remainders * 1.1) << gpu << " " << recipe;
      }
    }
  }
}

struct Table20Row {
  const char* what;
  double measured_tflops;  // Table 11
  Flags flags;
};

std::vector<Table20Row> table20() {
  const Flags ds = hf("deepseek_v3") + kCommon + Flags{"--moe-token-dispatcher-type", "flex", "--seq-length", "4096"};
  const Flags qw = hf("qwen3_235b_a22b") + kCommon + Flags{"--moe-token-dispatcher-type", "flex"};
  const Flags mx = {"--fp8-format", "e4m3", "--fp8-recipe", "mxfp8"};
  const Flags ds_pp4 = {"--pipeline-model-parallel-size", "4", "--pipeline-model-parallel-layout",
                        "Et*3|t*3|(tttt|)*13,tttmL"};
  const Flags q_vpp6 = {"--pipeline-model-parallel-size", "4", "--pipeline-model-parallel-layout",
                        "Ettt|(tttt|)*22,tttL"};
  const Flags q_vpp12 = {"--pipeline-model-parallel-size", "4", "--pipeline-model-parallel-layout", "Et|(tt|)*46,tL"};
  const Flags overlap = {"--overlap-moe-expert-parallel-comm"};
  const Flags sel = {"--recompute-granularity", "selective", "--recompute-modules"};
  return {
      {"DeepSeek-V3 GB300 MXFP8", 1233,
       ds + mx + ds_pp4 + overlap +
           Flags{"--num-gpus", "256", "--gpu", "GB300", "--expert-model-parallel-size", "64", "--micro-batch-size", "1",
                 "--global-batch-size", "8192"}},
      {"DeepSeek-V3 GB200 MXFP8", 1048,
       ds + mx + ds_pp4 + sel + Flags{"mlp"} +
           Flags{"--num-gpus", "256", "--gpu", "GB200", "--expert-model-parallel-size", "64", "--micro-batch-size", "1",
                 "--global-batch-size", "8192"}},
      {"DeepSeek-V3 GB200 BF16", 857,
       ds + sel + Flags{"mlp"} +
           Flags{"--num-gpus", "256", "--gpu", "GB200", "--pipeline-model-parallel-size", "8",
                 "--pipeline-model-parallel-layout", "Et|(tt|)*30,mL", "--expert-model-parallel-size", "32",
                 "--micro-batch-size", "1", "--global-batch-size", "4096"}},
      {"DeepSeek-V3 H100 FP8 blockwise", 368,
       ds + ds_pp4 + overlap + sel + Flags{"mla_up_proj", "mlp"} +
           Flags{"--fp8-format", "e4m3", "--fp8-recipe", "blockwise", "--num-gpus", "1024", "--gpu", "H100",
                 "--tensor-model-parallel-size", "2", "--sequence-parallel", "--expert-model-parallel-size", "64",
                 "--expert-tensor-parallel-size", "1", "--micro-batch-size", "1", "--global-batch-size", "8192"}},
      {"Qwen3-235B GB300 MXFP8", 974,
       qw + mx + q_vpp6 +
           Flags{"--seq-length", "4096", "--num-gpus", "256", "--gpu", "GB300", "--expert-model-parallel-size", "64",
                 "--micro-batch-size", "2", "--global-batch-size", "3072"}},
      {"Qwen3-235B GB200 MXFP8", 919,
       qw + mx + q_vpp6 + overlap + sel + Flags{"moe_act", "layernorm"} +
           Flags{"--seq-length", "4096", "--num-gpus", "256", "--gpu", "GB200", "--expert-model-parallel-size", "64",
                 "--micro-batch-size", "3", "--global-batch-size", "3072"}},
      {"Qwen3-235B GB200 BF16", 750,
       qw + q_vpp12 + overlap + sel + Flags{"moe_act", "layernorm"} +
           Flags{"--seq-length", "4096", "--num-gpus", "256", "--gpu", "GB200", "--expert-model-parallel-size", "32",
                 "--micro-batch-size", "1", "--global-batch-size", "8192"}},
      {"Qwen3-235B H100 BF16", 320,
       qw + overlap + sel + Flags{"moe_act", "layernorm"} +
           Flags{"--seq-length",
                 "4096",
                 "--num-gpus",
                 "256",
                 "--gpu",
                 "H100",
                 "--tensor-model-parallel-size",
                 "2",
                 "--sequence-parallel",
                 "--pipeline-model-parallel-size",
                 "8",
                 "--pipeline-model-parallel-layout",
                 "Ett|(ttt|)*30,ttL",
                 "--expert-model-parallel-size",
                 "32",
                 "--expert-tensor-parallel-size",
                 "1",
                 "--micro-batch-size",
                 "1",
                 "--global-batch-size",
                 "2048"}},
      {"Qwen3-235B GB300 MXFP8 seq 131072", 1150,
       qw + mx + q_vpp12 +
           Flags{"--seq-length",
                 "131072",
                 "--max-position-embeddings",
                 "131072",
                 "--num-gpus",
                 "128",
                 "--gpu",
                 "GB300",
                 "--tensor-model-parallel-size",
                 "4",
                 "--sequence-parallel",
                 "--context-parallel-size",
                 "4",
                 "--expert-model-parallel-size",
                 "32",
                 "--expert-tensor-parallel-size",
                 "1",
                 "--micro-batch-size",
                 "1",
                 "--global-batch-size",
                 "1024"}},
  };
}

TEST(PlanTime, Table20ThroughputWithin25Percent) {
  for (const Table20Row& row : table20()) {
    const StepTime time = estimate_step_time(parse_plan_args(row.flags));
    expect_within(time.tflops_per_gpu, row.measured_tflops, 0.25, row.what);
  }
}

TEST(PlanTime, MixtralPrefersEp8Tp1OverEp4Tp2) {
  const Flags base = hf("mixtral_8x7b") + kCommon +
                     Flags{"--seq-length",
                           "4096",
                           "--num-gpus",
                           "64",
                           "--gpu",
                           "H100",
                           "--micro-batch-size",
                           "1",
                           "--global-batch-size",
                           "256",
                           "--recompute-granularity",
                           "selective",
                           "--recompute-modules",
                           "moe_act",
                           "layernorm"};
  for (const char* pp : {"1", "4"}) {
    const Flags with_pp = base + Flags{"--pipeline-model-parallel-size", pp};
    const double ep8 =
        estimate_step_time(parse_plan_args(with_pp + Flags{"--expert-model-parallel-size", "8"})).tflops_per_gpu;
    const double ep4_tp2 =
        estimate_step_time(
            parse_plan_args(with_pp + Flags{"--expert-model-parallel-size", "4", "--tensor-model-parallel-size", "2",
                                            "--sequence-parallel", "--expert-tensor-parallel-size", "2"}))
            .tflops_per_gpu;
    EXPECT_GT(ep8, ep4_tp2) << "PP " << pp;
  }
}

TEST(PlanSearch, RanksFittingLayoutsAndGivesReasons) {
  const Flags flags =
      hf("mixtral_8x7b") + kCommon + Flags{"--seq-length",       "4096", "--num-gpus",          "16", "--gpu",   "H100",
                                           "--micro-batch-size", "1",    "--global-batch-size", "64", "--search"};
  const std::vector<Candidate> candidates = search_layouts(parse_plan_args(flags));
  ASSERT_FALSE(candidates.empty());
  EXPECT_TRUE(candidates.front().fits);
  bool saw_memory = false;
  for (size_t i = 0; i < candidates.size(); ++i) {
    const Candidate& c = candidates[i];
    if (i > 0 && c.fits && candidates[i - 1].fits) {
      EXPECT_LE(candidates[i - 1].time->total_s, c.time->total_s);
    }
    if (!c.fits) {
      EXPECT_FALSE(c.reason.empty()) << c.layout.describe();
    }
    saw_memory |= c.reason.find("out of memory by") != std::string::npos;
  }
  EXPECT_TRUE(saw_memory);  // PP1 / TP1 layouts of a 47B model do not fit 80 GB H100s
}

TEST(PlanCommand, JsonHasTheDocumentedFields) {
  std::ostringstream out;
  const Flags flags = deepseek_memory_study() + Flags{"--json"};
  EXPECT_EQ(plan_main(flags, out), 0);
  const std::string text = out.str();
  for (const char* field :
       {"\"flops_per_token\"", "\"memory_gb\"", "\"weights_and_grads\"", "\"main_weights_and_optimizer\"",
        "\"activations\"", "\"total\"", "\"step_time_s\"", "\"tflops_per_gpu\"", "\"fits\"", "\"layout\""}) {
    EXPECT_NE(text.find(field), std::string::npos) << field;
  }
}

TEST(PlanArgs, BadInputIsOneLineError) {
  const auto message = [](const Flags& flags) {
    try {
      parse_plan_args(flags);
    } catch (const ConfigError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  const Flags model = hf("mixtral_8x7b") + Flags{"--seq-length", "4096"};
  EXPECT_NE(message(model).find("--num-gpus"), std::string::npos);
  EXPECT_EQ(message(model + Flags{"--num-gpu", "8"}), "unknown flag --num-gpu (did you mean --num-gpus?)");
  EXPECT_EQ(message(model + Flags{"--num-layer", "8", "--num-gpus", "8"}),
            "unknown flag --num-layer (did you mean --num-layers?)");
  EXPECT_NE(message(model + Flags{"--num-gpus", "8", "--gpu", "A100"}).find("unknown GPU 'A100'"), std::string::npos);
  EXPECT_NE(message(model + Flags{"--num-gpus", "8", "--recompute-granularity", "full"}).find("--recompute-method"),
            std::string::npos);
  EXPECT_NE(message(model + Flags{"--num-gpus", "8", "--recompute-modules", "mlp"}).find("selective"),
            std::string::npos);
  EXPECT_NE(message(model + Flags{"--num-gpus", "8", "--recompute-granularity", "selective", "--recompute-modules",
                                  "mla_up_proj"})
                .find("--multi-latent-attention"),
            std::string::npos);
  EXPECT_NE(message(model + Flags{"--num-gpus", "6", "--tensor-model-parallel-size", "4"}), "no error");
  EXPECT_NE(message(model + Flags{"--num-gpus", "8", "--q-lora-rank", "64"}).find("--multi-latent-attention"),
            std::string::npos);
}

}  // namespace
}  // namespace moecore::plan
