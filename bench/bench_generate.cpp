// Time per new token of generation with and without the key / value cache (model/kv_cache.h), at a given context
// length. Model: the dense demo recipe (configs/demo-dense.args: 4 layers, hidden 192, 4 heads / 2 KV groups, SwiGLU,
// RoPE, 50304-token vocabulary) with --seq-length 1088, or with `mla` its multi-latent-attention twin (q latent 96,
// kv latent 64, qk 32 + rope 16 = v 48 per head). Random weights (the cost does not depend on them).
//   without the cache: one token = the forward of the whole context (GPTModel::last_logits over it)
//   with the cache:    one token = decode_logits of one position after the context was prefilled
// Prints per context: median and minimum milliseconds per token over the repeats.
// usage: bench_generate SOURCE_DIR [mla] [CONTEXT... (default 64 256 1024)]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <exception>
#include <functional>
#include <string>
#include <vector>

#include "moecore/config/arguments.h"
#include "moecore/model/kv_cache.h"
#include "moecore/train/training_setup.h"

namespace {

using namespace moecore;

constexpr int64_t kSeqLength = 1088;

std::vector<std::string> recipe_flags(const std::string& path) {
  std::FILE* file = std::fopen(path.c_str(), "r");
  if (file == nullptr) throw std::runtime_error("cannot read " + path);
  std::vector<std::string> flags;
  char line[512];
  while (std::fgets(line, sizeof line, file) != nullptr) {
    if (line[0] == '#') continue;
    std::string word;
    for (const char* c = line; *c != '\0'; ++c) {
      if (*c == ' ' || *c == '\n' || *c == '\t') {
        if (!word.empty()) flags.push_back(word);
        word.clear();
      } else {
        word += *c;
      }
    }
    if (!word.empty()) flags.push_back(word);
  }
  std::fclose(file);
  return flags;
}

ModelConfig bench_model(const std::string& source_dir, const bool mla) {
  std::vector<std::string> flags;
  const std::vector<std::string> recipe = recipe_flags(source_dir + "/configs/demo-dense.args");
  for (size_t i = 0; i < recipe.size(); ++i) {
    if (recipe[i] == "--seq-length" || recipe[i] == "--max-position-embeddings" || recipe[i] == "--split") {
      ++i;
      continue;
    }
    flags.push_back(recipe[i]);
  }
  const std::string seq = std::to_string(kSeqLength);
  flags.insert(flags.end(), {"--seq-length", seq, "--max-position-embeddings", seq, "--tokenizer-type", "NullTokenizer",
                             "--vocab-size", "50257", "--mock-data"});
  if (mla) {
    flags.insert(flags.end(),
                 {"--multi-latent-attention", "--q-lora-rank", "96", "--kv-lora-rank", "64", "--qk-head-dim", "32",
                  "--qk-pos-emb-head-dim", "16", "--v-head-dim", "48", "--qk-layernorm", "--rope-type", "rope"});
    std::erase(flags, "--group-query-attention");
    const auto groups = std::find(flags.begin(), flags.end(), "--num-query-groups");
    if (groups != flags.end()) flags.erase(groups, groups + 2);
    const auto position = std::find(flags.begin(), flags.end(), "--position-embedding-type");
    if (position != flags.end()) flags.erase(position, position + 2);
  }
  const TrainingArgs args = parse_train_args(flags);
  return with_padded_vocabulary(args, build_vocabulary(args)).model;
}

struct Timing {
  double median_ms = 0, min_ms = 0;
};

Timing summary(std::vector<double> ms) {
  std::sort(ms.begin(), ms.end());
  return {ms[ms.size() / 2], ms.front()};
}

double elapsed_ms(const std::function<void()>& fn) {
  const auto start = std::chrono::steady_clock::now();
  fn();
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

int run(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: bench_generate SOURCE_DIR [mla] [CONTEXT...]\n");
    return 2;
  }
  int next = 2;
  const bool mla = argc > next && std::string(argv[next]) == "mla";
  if (mla) ++next;
  std::vector<int64_t> contexts;
  for (int i = next; i < argc; ++i) contexts.push_back(std::stoll(argv[i]));
  if (contexts.empty()) contexts = {64, 256, 1024};
  const ModelConfig config = bench_model(argv[1], mla);
  GPTModel model(config, 1234);
  std::printf("# %s, %.2fM parameters, seq-length %ld\n", mla ? "multi-latent attention" : "GQA attention",
              static_cast<double>(model.num_parameters()) / 1e6, static_cast<long>(kSeqLength));
  std::printf("%-8s %22s %22s %9s\n", "context", "re-run ms/token (min)", "cached ms/token (min)", "speed-up");
  constexpr int kRerunRepeats = 5, kDecodeTokens = 64;
  for (const int64_t context : contexts) {
    std::vector<int32_t> tokens(static_cast<size_t>(context + kDecodeTokens));
    for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<int32_t>((i * 7919 + 13) % 50257);
    std::vector<double> rerun;
    model.last_logits(tokens.data(), 1, context);  // warm-up
    for (int r = 0; r < kRerunRepeats; ++r) {
      rerun.push_back(elapsed_ms([&] { model.last_logits(tokens.data(), 1, context); }));
    }
    KvCache cache(config, kSeqLength);
    model.decode_logits(cache, std::span<const int32_t>(tokens.data(), static_cast<size_t>(context)));
    std::vector<double> cached;
    for (int t = 0; t < kDecodeTokens; ++t) {
      const std::span<const int32_t> one(tokens.data() + context + t, 1);
      cached.push_back(elapsed_ms([&] { model.decode_logits(cache, one); }));
    }
    const Timing a = summary(rerun), b = summary(cached);
    std::printf("%-8ld %13.2f (%6.2f) %13.2f (%6.2f) %8.1fx\n", static_cast<long>(context), a.median_ms, a.min_ms,
                b.median_ms, b.min_ms, a.median_ms / b.median_ms);
  }
  return 0;
}

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
