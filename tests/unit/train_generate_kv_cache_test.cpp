// Generation through the key / value cache (model/kv_cache.h) against the full re-run of the context: the same
// greedy tokens for every attention and position kind, the decode step's logits equal to the full forward's last
// position, and the sliding window once prompt + new tokens outgrow --seq-length.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "moecore/config/arguments.h"
#include "moecore/model/kv_cache.h"
#include "moecore/train/generate.h"
#include "moecore/train/training_setup.h"
#include "test_recipe.h"

namespace moecore {
namespace {

// The recipe's flags without those named in `drop` (each with its value), then `extra`.
ModelConfig recipe_model(const std::string& recipe, const std::vector<std::string>& extra,
                         const std::set<std::string>& drop = {}) {
  const std::vector<std::string> flags = test::recipe_flags(recipe);
  std::vector<std::string> kept;
  for (size_t i = 0; i < flags.size(); ++i) {
    if (drop.contains(flags[i])) {
      if (i + 1 < flags.size() && flags[i + 1].rfind("--", 0) != 0) ++i;
      continue;
    }
    kept.push_back(flags[i]);
  }
  kept.insert(kept.end(), extra.begin(), extra.end());
  const TrainingArgs args = parse_train_args(kept);
  return with_padded_vocabulary(args, build_vocabulary(args)).model;
}

// A larger init spread than the recipes' so that a random model's greedy continuation is not one repeated token.
const std::vector<std::string> kSpread = {"--init-method-std", "0.2"};

std::vector<std::string> with(std::vector<std::string> flags, const std::vector<std::string>& more) {
  flags.insert(flags.end(), more.begin(), more.end());
  return flags;
}

std::vector<int32_t> prompt_of(const int64_t length, const int64_t vocab) {
  std::vector<int32_t> prompt;
  for (int64_t i = 0; i < length; ++i) prompt.push_back(static_cast<int32_t>((i * 37 + 11) % vocab));
  return prompt;
}

// Greedy continuation with and without the cache; the cache must really be used.
void expect_same_greedy_tokens(const ModelConfig& config, const int64_t prompt_length, const int64_t new_tokens) {
  GPTModel model(config, 1234);
  ASSERT_EQ(kv_cache_unsupported_reason(model), "");
  SamplingOptions options;
  options.max_new_tokens = new_tokens;
  const std::vector<int32_t> prompt = prompt_of(prompt_length, config.vocab_size);
  options.kv_cache = false;
  const std::vector<int32_t> reference = generate(model, prompt, options);
  options.kv_cache = true;
  const std::vector<int32_t> cached = generate(model, prompt, options);
  EXPECT_EQ(cached, reference);
  // A continuation that is one token over and over would hide wrong positions.
  const std::set<int32_t> distinct(reference.begin() + prompt_length, reference.end());
  EXPECT_GT(distinct.size(), 2u);
}

TEST(GenerateKvCache, DenseGqaRopeQkLayernorm) {
  expect_same_greedy_tokens(
      recipe_model("tiny-dense-megatron-defaults",
                   with(kSpread, {"--group-query-attention", "--num-query-groups", "2", "--position-embedding-type",
                                  "rope", "--qk-layernorm", "--normalization", "RMSNorm", "--swiglu"})),
      9, 24);
}

TEST(GenerateKvCache, LearnedAbsolutePositions) {
  expect_same_greedy_tokens(recipe_model("tiny-dense-megatron-defaults", kSpread), 9, 24);
}

TEST(GenerateKvCache, NoPositionEmbedding) {
  expect_same_greedy_tokens(
      recipe_model("tiny-dense-megatron-defaults", with(kSpread, {"--position-embedding-type", "none"})), 9, 24);
}

TEST(GenerateKvCache, YarnPositions) {
  expect_same_greedy_tokens(recipe_model("tiny-dense-megatron-defaults",
                                         with(kSpread, {"--position-embedding-type", "yarn", "--rotary-scaling-factor",
                                                        "4", "--yarn-original-max-position-embeddings", "32"})),
                            9, 24);
}

TEST(GenerateKvCache, MoeMixtral) { expect_same_greedy_tokens(recipe_model("mixtral-tiny", kSpread), 9, 24); }

// deepseek-v3-tiny is DeepSeek-V3's architecture: multi-latent attention with a q latent and qk-layernorm, YaRN,
// v_head_dim (32) other than qk_head_dim + qk_pos_emb_head_dim (48), a dense first layer, then MoE layers.
TEST(GenerateKvCache, MlaWithQLatentYarn) {
  expect_same_greedy_tokens(recipe_model("deepseek-v3-tiny", kSpread), 9, 24);
}

const std::set<std::string> kMlaFlags = {
    "--multi-latent-attention", "--q-lora-rank", "--kv-lora-rank",          "--qk-head-dim",
    "--qk-pos-emb-head-dim",    "--v-head-dim",  "--rotary-scaling-factor", "--mscale",
    "--mscale-all-dim"};

// The same MoE layers under standard attention.
TEST(GenerateKvCache, MoeDeepSeekLikeStandardAttention) {
  expect_same_greedy_tokens(recipe_model("deepseek-v3-tiny", kSpread, kMlaFlags), 9, 24);
}

// Without a q latent, plain RoPE, v_head_dim = qk_head_dim + qk_pos_emb_head_dim.
const std::vector<std::string> kMlaNoQLatent = {"--multi-latent-attention",
                                                "--kv-lora-rank",
                                                "24",
                                                "--qk-head-dim",
                                                "16",
                                                "--qk-pos-emb-head-dim",
                                                "8",
                                                "--v-head-dim",
                                                "24",
                                                "--rope-type",
                                                "rope"};

TEST(GenerateKvCache, MlaWithoutQLatentRope) {
  expect_same_greedy_tokens(recipe_model("deepseek-v3-tiny", with(kSpread, kMlaNoQLatent), kMlaFlags), 9, 24);
}

// The decode step's logits are the full forward's at the last position: after a prefill of the prompt, and after
// every single-token step.
void expect_decode_logits_match(const ModelConfig& config) {
  GPTModel model(config, 77);
  std::vector<int32_t> tokens = prompt_of(7, config.vocab_size);
  KvCache cache(config, config.seq_length);
  Tensor step_logits = model.decode_logits(cache, tokens);
  for (int step = 0; step < 6; ++step) {
    const Tensor full_logits = model.last_logits(tokens.data(), 1, static_cast<int64_t>(tokens.size()));
    ASSERT_EQ(step_logits.numel(), full_logits.numel());
    double worst = 0.0, largest = 0.0;
    for (int64_t v = 0; v < full_logits.numel(); ++v) {
      worst =
          std::max(worst, std::abs(static_cast<double>(step_logits.data<float>()[v] - full_logits.data<float>()[v])));
      largest = std::max(largest, std::abs(static_cast<double>(full_logits.data<float>()[v])));
    }
    EXPECT_LE(worst, 1e-5 * std::max(1.0, largest)) << "step " << step << ", " << tokens.size() << " tokens";
    EXPECT_EQ(cache.length(), static_cast<int64_t>(tokens.size()));
    const int32_t next = static_cast<int32_t>((step * 53 + 5) % config.vocab_size);
    tokens.push_back(next);
    step_logits = model.decode_logits(cache, std::vector<int32_t>{next});
  }
}

TEST(GenerateKvCache, DecodeLogitsEqualFullForwardStandardAttention) {
  expect_decode_logits_match(recipe_model("mixtral-tiny", {"--qk-layernorm"}));
}

TEST(GenerateKvCache, DecodeLogitsEqualFullForwardMla) {
  expect_decode_logits_match(recipe_model("deepseek-v3-tiny", {}));
  expect_decode_logits_match(recipe_model("deepseek-v3-tiny", kMlaNoQLatent, kMlaFlags));
}

// Prompt + new tokens outgrow --seq-length 16: the window keeps the most recent 16 tokens at positions 0..15, so
// once it slides the cache starts over each step; the tokens are those of the full re-run.
TEST(GenerateKvCache, SlidingWindow) {
  for (const char* position : {"rope", "learned_absolute"}) {
    expect_same_greedy_tokens(recipe_model("tiny-dense-megatron-defaults",
                                           with(kSpread, {"--seq-length", "16", "--max-position-embeddings", "16",
                                                          "--position-embedding-type", position}),
                                           {"--seq-length", "--max-position-embeddings"}),
                              10, 24);
  }
}

// Models the cache cannot serve exactly fall back to the re-run: MoE token dropping counts the forward's tokens;
// 16-bit activations round the decode's last-bit differences to whole 16-bit steps.
void expect_full_rerun(const ModelConfig& config) {
  GPTModel model(config, 1234);
  EXPECT_NE(kv_cache_unsupported_reason(model), "");
  KvCache cache(config, config.seq_length);
  EXPECT_THROW(model.decode_logits(cache, std::vector<int32_t>{1, 2}), std::logic_error);
  SamplingOptions options;
  options.max_new_tokens = 24;
  const std::vector<int32_t> prompt = prompt_of(9, config.vocab_size);
  const std::vector<int32_t> cached = generate(model, prompt, options);
  options.kv_cache = false;
  EXPECT_EQ(cached, generate(model, prompt, options));
}

TEST(GenerateKvCache, TokenDroppingFallsBackToTheFullRerun) {
  expect_full_rerun(recipe_model("mixtral-tiny", with(kSpread, {"--moe-expert-capacity-factor", "1.0"})));
}

TEST(GenerateKvCache, SixteenBitActivationsFallBackToTheFullRerun) {
  expect_full_rerun(recipe_model("mixtral-tiny", with(kSpread, {"--bf16"})));
}

}  // namespace
}  // namespace moecore
