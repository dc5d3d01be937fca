// The memory estimate made before anything is allocated, with the planner's CPU engine accounting: its parameter
// count against a hand count and against the built models, the optimizer's share, and the refusal of a configuration
// that cannot fit.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "moecore/config/arguments.h"
#include "moecore/config/memory_estimate.h"
#include "moecore/parallel/parallel_state.h"
#include "moecore/plan/run_memory_estimate.h"
#include "moecore/train/training_setup.h"
#include "unit/test_recipe.h"

namespace moecore {
namespace {

using Args = std::vector<std::string>;

Args tiny_dense() {
  // clang-format off
  return test::recipe_flags("tiny-dense", {
      "--train-iters", "10", "--lr", "1e-3", "--micro-batch-size", "2", "--mock-data",
      "--tokenizer-type", "NullTokenizer", "--vocab-size", "999"
  });
  // clang-format on
}

TrainingArgs finalized(Args args, const Args& extra = {}) {
  args.insert(args.end(), extra.begin(), extra.end());
  const TrainingArgs parsed = parse_train_args(args);
  return with_padded_vocabulary(parsed, build_vocabulary(parsed));
}

TEST(MemoryEstimate, DenseParametersByHand) {
  // Megatron's defaults: LayerNorm (weight + bias), GeLU, biases, learned positions, tied output. The vocabulary of
  // 999 + EOD pads to 1024. Per layer: qkv 192x64 + 192, proj 64x64 + 64, two LayerNorms 2 x 128, fc1 256x64 + 256,
  // fc2 64x256 + 64 = 49984; two layers, word embeddings 1024x64, positions 32x64, final LayerNorm 128.
  const TrainingArgs args = finalized(tiny_dense());
  ASSERT_EQ(args.model.vocab_size, 1024);
  const double parameters = 2 * 49984 + 1024 * 64 + 32 * 64 + 128;
  const MemoryEstimate estimate = plan::estimate_run_memory(args);
  EXPECT_DOUBLE_EQ(estimate.parameters, parameters * 4);
  EXPECT_DOUBLE_EQ(estimate.gradients, parameters * 4);
  EXPECT_DOUBLE_EQ(estimate.optimizer, parameters * 4 * 2);  // exp_avg and exp_avg_sq
  EXPECT_GT(estimate.activations, 0.0);
  // 10 iterations x 2 sequences, plus the validation (before, during: 1, after) and test reads of 100 x 2 each.
  EXPECT_GT(estimate.data_indices, 0.0);
  // --bf16 adds the fp32 main parameters to the optimizer.
  EXPECT_DOUBLE_EQ(plan::estimate_run_memory(finalized(tiny_dense(), {"--bf16"})).optimizer, parameters * 4 * 3);
}

TEST(MemoryEstimate, ParametersMatchTheBuiltModel) {
  const std::vector<Args> variants = {
      {},
      {"--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear", "--position-embedding-type", "rope",
       "--untie-embeddings-and-output-weights", "--qk-layernorm", "--group-query-attention", "--num-query-groups", "2"},
      {"--num-experts", "4", "--moe-ffn-hidden-size", "48", "--moe-router-topk", "2", "--moe-layer-freq", "([0]+[1])"},
      {"--num-experts", "4", "--swiglu", "--disable-bias-linear", "--normalization", "RMSNorm",
       "--moe-shared-expert-intermediate-size", "32", "--moe-shared-expert-gate", "--moe-router-enable-expert-bias",
       "--moe-router-score-function", "sigmoid"},
      // LatentMoE, with biases on the latent projections and without.
      {"--num-experts", "4", "--moe-ffn-hidden-size", "48", "--moe-layer-freq", "([0]+[1])", "--moe-latent-size", "16"},
      {"--num-experts", "4", "--swiglu", "--disable-bias-linear", "--moe-latent-size", "8",
       "--moe-shared-expert-intermediate-size", "32"},
      // Multi-Token Prediction: depths like the last layer (dense with LayerNorm; MoE after a dense first layer).
      {"--position-embedding-type", "rope", "--mtp-num-layers", "1"},
      {"--position-embedding-type", "rope", "--mtp-num-layers", "2", "--num-experts", "4", "--moe-ffn-hidden-size",
       "48", "--moe-router-topk", "2", "--moe-layer-freq", "([0]+[1])"},
  };
  for (const Args& variant : variants) {
    const TrainingArgs args = finalized(tiny_dense(), variant);
    const ModelAndOptimizer built = build_model_and_optimizer(args, parallel::ParallelState::single_process());
    // The params category also holds the buffers (the router's expert bias).
    double buffers = 0;
    for (const Buffer& b : built.model->named_buffers()) buffers += static_cast<double>(b.value.numel());
    const double parameters = one_process_parameter_count(*built.model);
    EXPECT_DOUBLE_EQ(plan::estimate_run_memory(args).parameters, (parameters + buffers) * 4)
        << testing::PrintToString(variant);
  }
}

TEST(MemoryEstimate, ShardsOverParallelRanks) {
  // tiny-dense without biases, RMSNorm: per layer qkv 192x64, proj 64x64, fc1 256x64, fc2 64x256 (49152) and two
  // norms of 64; word embeddings 1024x64, learned positions 32x64 and the final norm. TP 2 halves all but the positions
  // and the norms, which every TP rank keeps whole; the distributed optimizer splits the states over the data-parallel
  // ranks.
  const double replicated = 32 * 64 + 2 * 2 * 64 + 64;
  const double whole = 2 * 49152 + 1024 * 64 + replicated;
  const TrainingArgs one = finalized(tiny_dense(), {"--disable-bias-linear", "--normalization", "RMSNorm"});
  EXPECT_DOUBLE_EQ(plan::estimate_run_memory(one).parameters, whole * 4);
  TrainingArgs tp2 = one;
  tp2.parallel.tensor_model_parallel_size = 2;
  tp2.parallel.world_size = 2;
  const double tp2_local = (whole - replicated) / 2 + replicated;
  EXPECT_DOUBLE_EQ(plan::estimate_run_memory(tp2).parameters, tp2_local * 4);
  TrainingArgs sharded = tp2;
  sharded.parallel.world_size = 8;
  sharded.data_parallel_size = 4;
  sharded.use_distributed_optimizer = true;
  EXPECT_DOUBLE_EQ(plan::estimate_run_memory(sharded).optimizer, tp2_local / 4 * 4 * 2);  // exp_avg, exp_avg_sq
}

TEST(MemoryEstimate, MegatronFsdpShardsTheOptimizer) {
  // tiny-dense with 8 layers over DP 4: the Adam states are sharded except with no_shard. (The parameters' and
  // gradients' peaks stay whole: the engine builds the whole model before sharding it.)
  const double whole = 8 * 49984 + 1024 * 64 + 32 * 64 + 128;  // see DenseParametersByHand
  const auto with_strategy = [](const char* strategy) {
    Args flags = {"--num-layers", "8", "--use-megatron-fsdp", "--data-parallel-sharding-strategy", strategy};
    if (std::string(strategy) != "no_shard") flags.push_back("--use-distributed-optimizer");
    TrainingArgs a = finalized(tiny_dense(), flags);
    a.parallel.world_size = 4;
    a.data_parallel_size = 4;
    return plan::estimate_run_memory(a);
  };
  for (const char* strategy : {"optim", "optim_grads", "optim_grads_params"}) {
    EXPECT_DOUBLE_EQ(with_strategy(strategy).optimizer, whole * 4 * 2 / 4) << strategy;
  }
  EXPECT_DOUBLE_EQ(with_strategy("no_shard").optimizer, whole * 4 * 2);
}

TEST(MemoryEstimate, RefusesWhatCannotFit) {
  // A 2^20-wide model: 2 layers of 12 x 2^40 weights alone are 24 x 2^40 parameters, 96 TiB in fp32.
  const TrainingArgs args = finalized(tiny_dense(), {"--hidden-size", "1048576", "--num-attention-heads", "1"});
  const MemoryEstimate estimate = plan::estimate_run_memory(args);
  EXPECT_GT(estimate.parameters, 24.0 * (1LL << 40) * 4);
  try {
    check_memory_fits(estimate, 16.0 * (1LL << 30));
    FAIL() << "expected ConfigError";
  } catch (const ConfigError& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("per rank (parameters "), std::string::npos) << message;
    EXPECT_NE(message.find("but 16.0 GiB of memory is available"), std::string::npos) << message;
  }
  EXPECT_NO_THROW(check_memory_fits(plan::estimate_run_memory(finalized(tiny_dense())), 16.0 * (1LL << 30)));
  // Iterations also cost memory: 2^40 iterations of 2 sequences need 56 TiB of sample indices.
  EXPECT_GT(plan::estimate_run_memory(finalized(tiny_dense(), {"--train-iters", "1099511627776"})).data_indices,
            50.0 * (1LL << 40));
}

TEST(MemoryEstimate, FormatsBytes) {
  EXPECT_EQ(format_bytes(512), "512.0 B");
  EXPECT_EQ(format_bytes(1536), "1.5 KiB");
  EXPECT_EQ(format_bytes(3.0 * (1LL << 30)), "3.0 GiB");
}

}  // namespace
}  // namespace moecore
