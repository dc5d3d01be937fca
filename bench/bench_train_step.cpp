// Times one training step (forward, backward, AdamW) of a llama-style GPTModel on random tokens and prints
// one JSON line. Its PyTorch peer is bench/torch_train_step.py with the same flags.
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "moecore/model/gpt_model.h"
#include "moecore/optim/adamw_optimizer.h"
#include "moecore/tensor/rng.h"

int main(int argc, char** argv) {
  std::map<std::string, long> flags = {{"--layers", 4}, {"--hidden", 192}, {"--heads", 4},  {"--groups", 2},
                                       {"--ffn", 512},  {"--seq", 256},    {"--batch", 8},  {"--vocab", 50304},
                                       {"--steps", 5},  {"--warmup", 1},   {"--threads", 0}};
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!flags.contains(argv[i])) {
      std::fprintf(stderr, "error: unknown flag %s\n", argv[i]);
      return 1;
    }
    flags[argv[i]] = std::strtol(argv[i + 1], nullptr, 10);
  }
  if (flags["--threads"] > 0) omp_set_num_threads(static_cast<int>(flags["--threads"]));
  moecore::ModelConfig c;
  c.num_layers = flags["--layers"];
  c.hidden_size = flags["--hidden"];
  c.num_attention_heads = flags["--heads"];
  c.num_query_groups = flags["--groups"];
  c.kv_channels = c.hidden_size / c.num_attention_heads;
  c.ffn_hidden_size = flags["--ffn"];
  c.seq_length = c.max_position_embeddings = flags["--seq"];
  c.vocab_size = flags["--vocab"];
  c.normalization = moecore::Normalization::kRMSNorm;
  c.activation = moecore::Activation::kSwiGLU;
  c.position_embedding_type = moecore::PositionEmbedding::kRope;
  c.add_bias_linear = false;
  c.attention_dropout = c.hidden_dropout = 0.0;
  moecore::GPTModel model(c, 1234);
  moecore::AdamWOptimizer optimizer(model.params(), {});

  const long B = flags["--batch"], S = flags["--seq"];
  std::vector<int32_t> tokens(static_cast<size_t>(B * S)), labels(tokens.size());
  const moecore::CounterRng rng(7, moecore::stream_key("bench"));
  for (size_t i = 0; i < tokens.size(); ++i) {
    tokens[i] = static_cast<int32_t>(rng.uniform(2 * i) * static_cast<float>(c.vocab_size - 1));
    labels[i] = static_cast<int32_t>(rng.uniform(2 * i + 1) * static_cast<float>(c.vocab_size - 1));
  }
  std::vector<double> times;
  double loss = 0.0;
  for (long step = 0; step < flags["--warmup"] + flags["--steps"]; ++step) {
    const auto start = std::chrono::steady_clock::now();
    model.zero_grad();
    std::unique_ptr<moecore::MicroBatchContext> ctx;
    moecore::ForwardOptions options;
    loss = model.forward(ctx, tokens.data(), labels.data(), nullptr, B, S, options);
    model.backward(std::move(ctx), 1.0);
    optimizer.clip_grad_norm(1.0);
    optimizer.step(1e-4);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (step >= flags["--warmup"]) times.push_back(seconds);
  }
  std::sort(times.begin(), times.end());
  const double median = times[times.size() / 2];
  std::printf(
      "{\"impl\": \"moecore\", \"threads\": %d, \"params\": %ld, \"tokens_per_step\": %ld, "
      "\"step_ms\": %.1f, \"tokens_per_s\": %.1f, \"loss\": %.4f}\n",
      omp_get_max_threads(), static_cast<long>(model.num_parameters()), B * S, median * 1e3,
      static_cast<double>(B * S) / median, loss);
  return 0;
}
