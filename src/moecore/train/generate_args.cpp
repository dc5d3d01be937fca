#include "moecore/train/generate_args.h"

#include <charconv>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <type_traits>

#include "moecore/model/config.h"
#include "moecore/tokenizer/utf8.h"
#include "moecore/util/flag_suggest.h"

namespace moecore {
namespace {

template <typename T>
T parse_number(const std::string& flag, const std::string& text) {
  T value{};
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (error != std::errc() || end != text.data() + text.size()) {
    throw ConfigError("invalid value '" + text + "' for " + flag + ": expected a number");
  }
  if constexpr (std::is_floating_point_v<T>) {
    // from_chars reads "nan" and "inf": a sampling parameter must be a number to sample with.
    if (!std::isfinite(value)) {
      throw ConfigError("invalid value '" + text + "' for " + flag + ": expected a finite number");
    }
  }
  return value;
}

}  // namespace

std::string generate_usage() {
  return "usage: moecore generate --load DIR (--prompt TEXT | --prompt-file PATH) [--max-new-tokens N]\n"
         "                        [--temperature T] [--top-k K] [--seed N] [--no-kv-cache]\n"
         "                        [--tokenizer-type GPT2BPETokenizer --vocab-file F --merge-file F |\n"
         "                         --tokenizer-type NullTokenizer --vocab-size N]\n";
}

GenerateArgs parse_generate_args(const std::vector<std::string>& args) {
  GenerateArgs out;
  const std::map<std::string, std::function<void(const std::string&)>> setters = {
      {"--load", [&](const std::string& v) { out.load_dir = v; }},
      {"--prompt", [&](const std::string& v) { out.prompt = v; }},
      {"--prompt-file", [&](const std::string& v) { out.prompt_file = v; }},
      {"--max-new-tokens",
       [&](const std::string& v) { out.max_new_tokens = parse_number<int64_t>("--max-new-tokens", v); }},
      {"--temperature", [&](const std::string& v) { out.temperature = parse_number<double>("--temperature", v); }},
      {"--top-k", [&](const std::string& v) { out.top_k = parse_number<int64_t>("--top-k", v); }},
      {"--seed", [&](const std::string& v) { out.seed = parse_number<uint64_t>("--seed", v); }},
      {"--tokenizer-type", [&](const std::string& v) { out.tokenizer_type = v; }},
      {"--vocab-file", [&](const std::string& v) { out.vocab_file = v; }},
      {"--merge-file", [&](const std::string& v) { out.merge_file = v; }},
      {"--vocab-size", [&](const std::string& v) { out.vocab_size = parse_number<int64_t>("--vocab-size", v); }},
  };
  std::vector<std::string> known;
  for (const auto& [name, setter] : setters) known.push_back(name);
  constexpr const char* kNoKvCache = "--no-kv-cache";  // the one switch (no value)
  known.push_back(kNoKvCache);
  for (size_t i = 0; i < args.size(); ++i) {
    std::string flag = args[i];
    if (flag == "-h" || flag == "--help") {
      out.help_requested = true;
      return out;
    }
    std::string value;
    bool has_value = false;
    if (const size_t eq = flag.find('='); flag.rfind("--", 0) == 0 && eq != std::string::npos) {
      value = flag.substr(eq + 1);
      flag = flag.substr(0, eq);
      has_value = true;
    }
    if (flag == kNoKvCache) {
      if (has_value) throw ConfigError(flag + " takes no value");
      out.kv_cache = false;
      continue;
    }
    const auto it = setters.find(flag);
    if (it == setters.end()) {
      if (flag.rfind("-", 0) != 0) throw ConfigError("unexpected argument '" + flag + "' (flags start with --)");
      throw ConfigError(unknown_flag_message(flag, known));
    }
    if (!has_value) {
      if (i + 1 >= args.size()) throw ConfigError(flag + " needs a value");
      value = args[++i];
    }
    it->second(value);
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
