#include "moecore/cli/generate_args.h"

#include <charconv>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>

#include "moecore/model/config.h"
#include "moecore/tokenizer/utf8.h"
#include "moecore/util/flag_parser.h"

namespace moecore {
namespace {

// clang-format off
const std::vector<FlagSpec<GenerateArgs>>& generate_flag_table() {
  static const std::vector<FlagSpec<GenerateArgs>> table = {
    {"--load", Arity::kOne, "DIR", "HuggingFace-style export (config.json + model.safetensors), e.g. from --export-hf",
     [](GenerateArgs& a, const FlagValue& v) { a.load_dir = v.text(); }},
    {"--prompt", Arity::kOne, "TEXT", "text to continue (this or --prompt-file is required)",
     [](GenerateArgs& a, const FlagValue& v) { a.prompt = v.text(); }},
    {"--prompt-file", Arity::kOne, "PATH", "the text to continue from a UTF-8 file (one final newline dropped)",
     [](GenerateArgs& a, const FlagValue& v) { a.prompt_file = v.text(); }},
    {"--max-new-tokens", Arity::kOne, "N", "tokens to produce (default 64)",
     [](GenerateArgs& a, const FlagValue& v) { a.max_new_tokens = v.integer(); }},
    {"--temperature", Arity::kOne, "T", "0 = greedy (default); > 0 samples from softmax(logits / T)",
     [](GenerateArgs& a, const FlagValue& v) { a.temperature = v.real(); }},
    {"--top-k", Arity::kOne, "K", "sample among the K most likely tokens (0 = all; at most the vocabulary)",
     [](GenerateArgs& a, const FlagValue& v) { a.top_k = v.integer(); }},
    {"--seed", Arity::kOne, "N", "sampling seed (default 1234)",
     [](GenerateArgs& a, const FlagValue& v) { a.seed = v.unsigned_integer(); }},
    {"--record-routing", Arity::kOne, "FILE",
     "router replay: append the experts every MoE router chose for each position fed to the model to FILE (moecore's "
     "routing recording, replayed by moecore train --moe-routing-replay-file)",
     [](GenerateArgs& a, const FlagValue& v) { a.record_routing = v.text(); }},
    {"--kv-cache", Arity::kSwitch, "",
     "keep a key / value cache (default); --no-kv-cache re-runs the whole context for every new token (the "
     "reference the cache is checked against)",
     [](GenerateArgs& a, const FlagValue& v) { a.kv_cache = !v.negated; }, "--no-kv-cache"},
    {"--tokenizer-type", Arity::kOne, "TYPE", "GPT2BPETokenizer (default, DIR/vocab.json and DIR/merges.txt) or "
     "NullTokenizer",
     [](GenerateArgs& a, const FlagValue& v) { a.tokenizer_type = v.text(); }},
    {"--vocab-file", Arity::kOne, "F", "GPT2BPETokenizer's vocabulary (default DIR/vocab.json)",
     [](GenerateArgs& a, const FlagValue& v) { a.vocab_file = v.text(); }},
    {"--merge-file", Arity::kOne, "F", "GPT2BPETokenizer's merges (default DIR/merges.txt)",
     [](GenerateArgs& a, const FlagValue& v) { a.merge_file = v.text(); }},
    {"--vocab-size", Arity::kOne, "N", "NullTokenizer: ids below N, then end-of-document (as `moecore train`)",
     [](GenerateArgs& a, const FlagValue& v) { a.vocab_size = v.integer(); }},
  };
  return table;
}
// clang-format on

}  // namespace

std::string generate_usage() {
  return "usage: moecore generate --load DIR (--prompt TEXT | --prompt-file PATH) [flags]\n\n" +
         flags_help(generate_flag_table());
}

GenerateArgs parse_generate_args(const std::vector<std::string>& args) {
  GenerateArgs out;
  try {
    if (parse_flags(generate_flag_table(), args, out).help_requested) {
      out.help_requested = true;
      return out;
    }
  } catch (const FlagError& error) {
    throw ConfigError(error.what());
  }
  if (out.load_dir.empty()) throw ConfigError("--load DIR is required (a directory written by --export-hf)");
  if (!out.prompt_file.empty()) {
    if (!out.prompt.empty()) throw ConfigError("--prompt and --prompt-file are mutually exclusive: give one");
    out.prompt = read_prompt_file(out.prompt_file);
  }
  if (out.prompt.empty()) throw ConfigError("--prompt TEXT or --prompt-file PATH is required");
  if (out.max_new_tokens < 0) throw ConfigError("--max-new-tokens must be >= 0");
  // Each new token extends the sequence; a table of 2^24 positions is moecore's limit for --seq-length too.
  constexpr int64_t kMaxNewTokens = int64_t{1} << 24;
  if (out.max_new_tokens > kMaxNewTokens) {
    throw ConfigError("--max-new-tokens " + std::to_string(out.max_new_tokens) + " is above the limit of " +
                      std::to_string(kMaxNewTokens));
  }
  if (out.tokenizer_type == "NullTokenizer" && !out.vocab_size) {
    throw ConfigError("--tokenizer-type NullTokenizer requires --vocab-size (as `moecore train`)");
  }
  if (out.vocab_size && out.tokenizer_type != "NullTokenizer") {
    throw ConfigError("--vocab-size is used only with --tokenizer-type NullTokenizer");
  }
  if (out.temperature < 0) throw ConfigError("--temperature must be >= 0");
  if (out.top_k < 0) throw ConfigError("--top-k must be >= 0");
  return out;
}

void check_sampling_against_vocabulary(const GenerateArgs& args, const int64_t vocab_size) {
  // Megatron's torch_sampling.py asserts "top-k is larger than logit size."
  if (args.top_k > vocab_size) {
    throw ConfigError("--top-k " + std::to_string(args.top_k) + " is larger than the vocabulary (" +
                      std::to_string(vocab_size) + " tokens)");
  }
}

void check_tokenizer_against_model(const GenerateArgs& args, const int64_t tokenizer_vocab_size,
                                   const int64_t model_rows) {
  if (tokenizer_vocab_size <= model_rows) return;
  const std::string tokenizer = args.tokenizer_type == "NullTokenizer"
                                    ? "--vocab-size " + std::to_string(*args.vocab_size) +
                                          " gives a NullTokenizer of " + std::to_string(tokenizer_vocab_size) +
                                          " tokens (the ids and end-of-document)"
                                    : "the tokenizer has " + std::to_string(tokenizer_vocab_size) + " tokens";
  throw ConfigError(tokenizer + ", more than the model's " + std::to_string(model_rows) + " embedding rows (" +
                    args.load_dir + "/config.json vocab_size): use the tokenizer the model was trained with");
}

std::string read_prompt_file(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::file_status status = fs::status(path, ec);
  if (!fs::exists(status)) throw ConfigError("--prompt-file " + path + ": no such file");
  if (fs::is_directory(status)) throw ConfigError("--prompt-file " + path + " is a directory, not a text file");
  std::ifstream in(path, std::ios::binary);
  std::string text;
  if (in) text.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  if (!in || in.bad()) throw ConfigError("--prompt-file " + path + ": cannot be read");
  for (size_t pos = 0; pos < text.size();) {
    const utf8::DecodedChar c = utf8::decode(text, pos);
    if (!c.valid) {
      throw ConfigError("--prompt-file " + path + " is not UTF-8 text (an invalid byte at offset " +
                        std::to_string(pos) + ")");
    }
    pos += c.length;
  }
  // The newline that ends a text file's last line is not part of the prompt.
  if (text.ends_with("\r\n")) {
    text.resize(text.size() - 2);
  } else if (text.ends_with('\n')) {
    text.pop_back();
  }
  if (text.empty()) throw ConfigError("--prompt-file " + path + " is empty");
  return text;
}

TokenizerOptions generate_tokenizer_options(const GenerateArgs& args) {
  TokenizerOptions options;
  options.type = args.tokenizer_type;
  options.vocab_file = args.vocab_file.empty() ? args.load_dir + "/vocab.json" : args.vocab_file;
  options.merge_file = args.merge_file.empty() ? args.load_dir + "/merges.txt" : args.merge_file;
  options.vocab_size = args.vocab_size.value_or(-1);
  return options;
}

}  // namespace moecore
