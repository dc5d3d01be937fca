// The model and run whose training state the training-state tests build, save and compare (in one process,
// tests/unit/train_training_state_test.cpp, and under mpirun, tests/parallel/training_state_main.cpp): the tiny-moe
// recipe made llama-style (RMSNorm, SwiGLU, no biases, untied output), a dense then an MoE layer with a gated shared
// expert, sigmoid scores and an expert bias, grouped GEMM; 10 iterations of a cosine schedule with weight decay on mock
// data.
#pragma once

#include <string>
#include <vector>

#include "unit/test_recipe.h"

namespace moecore::test {

inline std::vector<std::string> training_state_flags() {
  // clang-format off
  return recipe_flags("tiny-moe", {
      "--swiglu", "--disable-bias-linear", "--normalization", "RMSNorm", "--untie-embeddings-and-output-weights",
      "--moe-layer-freq", "[0,1]", "--moe-grouped-gemm", "--moe-shared-expert-intermediate-size", "32",
      "--moe-shared-expert-gate", "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
      "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "10", "--lr", "1e-3",
      "--min-lr", "1e-5", "--lr-warmup-iters", "2", "--lr-decay-style", "cosine", "--weight-decay", "0.05",
      "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "250", "--seed", "7"
  });
  // clang-format on
}

}  // namespace moecore::test
