#include "moecore/data/preprocess.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <thread>

#include "moecore/data/indexed_dataset.h"
#include "moecore/util/flag_suggest.h"

namespace moecore {
namespace {

// ---------------------------------------------------------------------------------------------------------------
// Flags

enum class FlagKind { kValue, kList, kSwitch };

struct FlagSpec {
  std::string_view name;
  FlagKind kind;
  bool implemented;
};

// preprocess_data.py's parser: its own flags plus Megatron's tokenizer group (megatron/training/arguments.py).
constexpr FlagSpec kFlags[] = {
    {"--input", FlagKind::kValue, true},
    {"--json-keys", FlagKind::kList, true},
    {"--split-sentences", FlagKind::kSwitch, true},
    {"--keep-newlines", FlagKind::kSwitch, true},
    {"--append-eod", FlagKind::kSwitch, true},
    {"--lang", FlagKind::kValue, true},
    {"--output-prefix", FlagKind::kValue, true},
    {"--workers", FlagKind::kValue, true},
    {"--partitions", FlagKind::kValue, true},
    {"--log-interval", FlagKind::kValue, true},
    {"--tokenizer-type", FlagKind::kValue, true},
    {"--vocab-file", FlagKind::kValue, true},
    {"--merge-file", FlagKind::kValue, true},
    {"--vocab-size", FlagKind::kValue, true},
    {"--vocab-extra-ids", FlagKind::kValue, true},
    {"--legacy-tokenizer", FlagKind::kSwitch, true},  // moecore's tokenizers are Megatron's legacy classes
    {"--find-optimal-num-workers", FlagKind::kSwitch, false},
    {"--workers-to-check", FlagKind::kList, false},
    {"--max-documents", FlagKind::kValue, false},
    {"--performance-dir", FlagKind::kValue, false},
    {"--keep-sequential-samples", FlagKind::kSwitch, false},
    {"--padded-vocab-size", FlagKind::kValue, false},
    {"--tokenizer-model", FlagKind::kValue, false},
    {"--tokenizer-metadata", FlagKind::kValue, false},
    {"--tiktoken-pattern", FlagKind::kValue, false},
    {"--tiktoken-num-special-tokens", FlagKind::kValue, false},
    {"--tiktoken-special-tokens", FlagKind::kList, false},
    {"--trust-remote-code", FlagKind::kSwitch, false},
    {"--tokenizer-hf-no-use-fast", FlagKind::kSwitch, false},
    {"--tokenizer-hf-no-include-special-tokens", FlagKind::kSwitch, false},
    {"--tokenizer-sentencepiece-legacy", FlagKind::kSwitch, false},
    {"--special-tokens", FlagKind::kList, false},
    {"--tokenizer-prompt-format", FlagKind::kValue, false},
    {"--sft-tokenizer-prompt-format", FlagKind::kValue, false},
    {"--image-tag-type", FlagKind::kValue, false},
    {"--force-system-message", FlagKind::kSwitch, false},
    {"--metadata-path", FlagKind::kValue, false},
};

constexpr std::string_view kUsage =
    "usage: moecore preprocess --input FILE.jsonl --output-prefix PREFIX --workers N --tokenizer-type TYPE\n"
    "                          [--vocab-file F --merge-file F | --vocab-size V] [--json-keys KEY ...]\n"
    "                          [--append-eod] [--log-interval N] [--partitions 1]\n"
    "Writes PREFIX_KEY_document.bin/.idx (Megatron indexed dataset) for each --json-keys KEY (default: text).\n"
    "TYPE: GPT2BPETokenizer (encoder.json + vocab.bpe) or NullTokenizer (text = space-separated ids).\n";

// argparse's matching: an exact name, else a unique prefix of one.
const FlagSpec& find_flag(std::string_view name) {
  for (const FlagSpec& flag : kFlags) {
    if (flag.name == name) return flag;
  }
  std::vector<const FlagSpec*> candidates;
  for (const FlagSpec& flag : kFlags) {
    if (name.size() > 2 && flag.name.starts_with(name)) candidates.push_back(&flag);
  }
  if (candidates.size() == 1) return *candidates.front();
  if (candidates.size() > 1) {
    std::string message = "ambiguous option " + std::string(name) + " could match";
    for (size_t i = 0; i < candidates.size(); ++i) message += (i ? ", " : " ") + std::string(candidates[i]->name);
    throw std::invalid_argument(message);
  }
  std::vector<std::string_view> names;
  for (const FlagSpec& flag : kFlags) names.push_back(flag.name);
  const std::string closest = closest_flag(name, names);
  std::string message = "unknown flag " + std::string(name) + " for moecore preprocess";
  if (!closest.empty()) message += " (did you mean " + closest + "?)";
  throw std::invalid_argument(message);
}

bool looks_like_flag(std::string_view arg) {
  if (arg.size() < 2 || arg[0] != '-') return false;
  const char c = arg[1];
  return !(c >= '0' && c <= '9') && c != '.';  // "-5" is a negative number, like argparse
}

int64_t parse_int(std::string_view flag, const std::string& value) {
  try {
    size_t used = 0;
    const long long parsed = std::stoll(value, &used);
    if (used == value.size()) return parsed;
  } catch (const std::exception&) {
  }
  throw std::invalid_argument("argument " + std::string(flag) + ": invalid int value: '" + value + "'");
}

}  // namespace

PreprocessOptions parse_preprocess_args(const std::vector<std::string>& args) {
  PreprocessOptions options;
  bool seen_input = false;
  bool seen_output_prefix = false;
  bool seen_workers = false;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& arg = args[i];
    if (!looks_like_flag(arg)) throw std::invalid_argument("unrecognized argument: " + arg);
    if (arg == "-h" || arg == "--help") throw std::invalid_argument(std::string(kUsage.substr(0, kUsage.find('\n'))));
    const size_t equals = arg.find('=');
    const std::string name = arg.substr(0, equals);
    const FlagSpec& flag = find_flag(name);
    std::vector<std::string> values;
    if (equals != std::string::npos) {
      if (flag.kind == FlagKind::kSwitch) {
        throw std::invalid_argument("argument " + std::string(flag.name) + ": ignored explicit argument '" +
                                    arg.substr(equals + 1) + "'");
      }
      values.push_back(arg.substr(equals + 1));
    } else if (flag.kind != FlagKind::kSwitch) {
      while (i + 1 < args.size() && !looks_like_flag(args[i + 1])) {
        values.push_back(args[++i]);
        if (flag.kind == FlagKind::kValue) break;
      }
      if (values.empty()) {
        throw std::invalid_argument(
            "argument " + std::string(flag.name) +
            (flag.kind == FlagKind::kList ? ": expected at least one argument" : ": expected one argument"));
      }
    }
    if (!flag.implemented) {
      throw std::invalid_argument("flag " + std::string(flag.name) +
                                  " is a Megatron flag not implemented in moecore preprocess yet");
    }
    const std::string value = values.empty() ? std::string() : values.front();
    if (flag.name == "--input") {
      options.input = value;
      seen_input = true;
    } else if (flag.name == "--json-keys") {
      options.json_keys = values;
    } else if (flag.name == "--split-sentences") {
      options.split_sentences = true;
    } else if (flag.name == "--keep-newlines") {
      options.keep_newlines = true;
    } else if (flag.name == "--append-eod") {
      options.append_eod = true;
    } else if (flag.name == "--lang") {
      options.lang = value;
    } else if (flag.name == "--output-prefix") {
      options.output_prefix = value;
      seen_output_prefix = true;
    } else if (flag.name == "--workers") {
      options.workers = parse_int(flag.name, value);
      seen_workers = true;
    } else if (flag.name == "--partitions") {
      options.partitions = parse_int(flag.name, value);
    } else if (flag.name == "--log-interval") {
      options.log_interval = parse_int(flag.name, value);
    } else if (flag.name == "--tokenizer-type") {
      options.tokenizer.type = value;
    } else if (flag.name == "--vocab-file") {
      options.tokenizer.vocab_file = value;
    } else if (flag.name == "--merge-file") {
      options.tokenizer.merge_file = value;
    } else if (flag.name == "--vocab-size") {
      options.tokenizer.vocab_size = parse_int(flag.name, value);
    } else if (flag.name == "--vocab-extra-ids") {
      if (parse_int(flag.name, value) != 0) {
        throw std::invalid_argument("--vocab-extra-ids " + value +
                                    ": Megatron's preprocess_data.py forces 0 (T5 sentinels are not supported)");
      }
    }  // --legacy-tokenizer: nothing to do
  }
  std::string missing;
  if (!seen_input) missing += " --input";
  if (!seen_output_prefix) missing += " --output-prefix";
  if (!seen_workers) missing += " --workers";
  if (!missing.empty()) throw std::invalid_argument("the following arguments are required:" + missing);
  if (options.split_sentences) {
    throw std::invalid_argument("--split-sentences is not implemented in moecore (Megatron splits with NLTK)");
  }
  if (options.workers < 1)
    throw std::invalid_argument("--workers must be >= 1, got " + std::to_string(options.workers));
  if (options.partitions != 1) {
    throw std::invalid_argument("--partitions " + std::to_string(options.partitions) +
                                ": only 1 partition is implemented in moecore");
  }
  if (options.log_interval < 1) {
    throw std::invalid_argument("--log-interval must be >= 1, got " + std::to_string(options.log_interval));
  }
  if (options.tokenizer.type.empty()) throw std::invalid_argument("--tokenizer-type is required");
  if (options.json_keys.empty()) throw std::invalid_argument("--json-keys needs at least one key");
  for (size_t k = 0; k < options.json_keys.size(); ++k) {
    if (std::find(options.json_keys.begin(), options.json_keys.begin() + k, options.json_keys[k]) !=
        options.json_keys.begin() + k) {
      throw std::invalid_argument("--json-keys lists '" + options.json_keys[k] + "' twice");
    }
  }
  return options;
}

// ---------------------------------------------------------------------------------------------------------------
// Conversion

namespace {

// Tokens of one JSON line: per key, the non-empty sequences of the document (one, or one per list element).
struct EncodedLine {
  std::vector<std::vector<std::vector<int32_t>>> sequences_per_key;
  std::string error;  // non-empty: the problem with this line
};

std::string json_type_name(const nlohmann::json& value) { return value.type_name(); }

// Megatron's Encoder.encode for one line.
EncodedLine encode_line(const std::string& line, const PreprocessOptions& options, const Tokenizer& tokenizer) {
  EncodedLine encoded;
  nlohmann::json document;
  try {
    document = nlohmann::json::parse(line);
  } catch (const nlohmann::json::parse_error& e) {
    // nlohmann: "[json.exception.parse_error.101] parse error at line 1, column 5: syntax error ..."
    std::string what = e.what();
    what = what.substr(what.find("] ") + 2);
    if (const size_t column = what.find("column "); column != std::string::npos) what = what.substr(column);
    encoded.error = "malformed JSON at " + what;
    return encoded;
  }
  if (!document.is_object()) {
    encoded.error = "expected a JSON object, got " + json_type_name(document);
    return encoded;
  }
  encoded.sequences_per_key.resize(options.json_keys.size());
  for (size_t k = 0; k < options.json_keys.size(); ++k) {
    const std::string& key = options.json_keys[k];
    const auto it = document.find(key);
    if (it == document.end()) {
      encoded.error = "no key '" + key + "'";
      return encoded;
    }
    std::vector<const std::string*> sentences;
    if (it->is_string()) {
      sentences.push_back(it->get_ptr<const std::string*>());
    } else if (it->is_array() && std::all_of(it->begin(), it->end(), [](const auto& v) { return v.is_string(); })) {
      for (const auto& sentence : *it) sentences.push_back(sentence.get_ptr<const std::string*>());
    } else {
      encoded.error = "key '" + key + "' must be a string or a list of strings, got " + json_type_name(*it);
      return encoded;
    }
    auto& sequences = encoded.sequences_per_key[k];
    try {
      for (const std::string* sentence : sentences) {
        std::vector<int32_t> ids = tokenizer.tokenize(*sentence);
        if (!ids.empty()) sequences.push_back(std::move(ids));
      }
    } catch (const std::exception& e) {
      encoded.error = "key '" + key + "': " + e.what();
      return encoded;
    }
    if (options.append_eod && !sequences.empty()) sequences.back().push_back(tokenizer.eod());
  }
  return encoded;
}

// Runs encode_line over `lines` on `workers` threads; results keep the input order.
std::vector<EncodedLine> encode_lines(const std::vector<std::string>& lines, const PreprocessOptions& options,
                                      const Tokenizer& tokenizer) {
  std::vector<EncodedLine> results(lines.size());
  const size_t num_threads = std::min<size_t>(static_cast<size_t>(options.workers), lines.size());
  const auto encode_one = [&](size_t i) {
    try {
      results[i] = encode_line(lines[i], options, tokenizer);
    } catch (const std::exception& e) {  // e.g. out of memory: reported for this line, never terminates
      results[i].error = e.what();
    }
  };
  if (num_threads <= 1) {
    for (size_t i = 0; i < lines.size(); ++i) encode_one(i);
    return results;
  }
  std::atomic<size_t> next{0};
  std::vector<std::jthread> threads;
  threads.reserve(num_threads);
  for (size_t t = 0; t < num_threads; ++t) {
    threads.emplace_back([&] {
      for (size_t i = next++; i < lines.size(); i = next++) encode_one(i);
    });
  }
  threads.clear();  // joins
  return results;
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

PreprocessStats preprocess(const PreprocessOptions& options) {
  const auto startup_start = std::chrono::steady_clock::now();
  std::error_code ec;
  if (std::filesystem::is_directory(options.input, ec)) {
    throw std::runtime_error("--input " + options.input + " is a folder, not a JSONL file");
  }
  std::ifstream input(options.input, std::ios::binary);
  if (!input) throw std::runtime_error("cannot open --input " + options.input);
  if (!options.quiet) std::cout << "Opening " << options.input << std::endl;

  const std::unique_ptr<Tokenizer> tokenizer = build_tokenizer(options.tokenizer);
  const IndexedDType dtype = optimal_token_dtype(tokenizer->vocab_size());
  std::vector<IndexedDatasetWriter> writers;
  writers.reserve(options.json_keys.size());
  for (const std::string& key : options.json_keys) {
    writers.emplace_back(options.output_prefix + "_" + key + "_document", dtype);
  }
  if (!options.quiet) std::cout << "Time to startup: " << seconds_since(startup_start) << std::endl;

  PreprocessStats stats;
  stats.tokens_per_key.assign(options.json_keys.size(), 0);
  const auto start = std::chrono::steady_clock::now();
  // Lines are read and written in chunks; each chunk is tokenized in parallel.
  const size_t chunk_lines = std::max<size_t>(64, 32 * static_cast<size_t>(options.workers));
  constexpr size_t kChunkBytes = 16 << 20;
  int64_t line_number = 0;
  std::vector<std::string> lines;
  std::string line;
  bool more = true;
  while (more) {
    lines.clear();
    size_t chunk_bytes = 0;
    while (lines.size() < chunk_lines && chunk_bytes < kChunkBytes) {
      if (!std::getline(input, line)) {
        more = false;
        break;
      }
      chunk_bytes += line.size() + 1;
      lines.push_back(std::move(line));
    }
    if (input.bad()) throw std::runtime_error("--input " + options.input + ": read error");
    const std::vector<EncodedLine> encoded = encode_lines(lines, options, *tokenizer);
    for (size_t i = 0; i < encoded.size(); ++i) {
      ++line_number;
      if (!encoded[i].error.empty()) {
        throw std::runtime_error("--input " + options.input + " line " + std::to_string(line_number) + ": " +
                                 encoded[i].error);
      }
      for (size_t k = 0; k < writers.size(); ++k) {
        for (const std::vector<int32_t>& sequence : encoded[i].sequences_per_key[k]) {
          writers[k].add_sequence(sequence);
          stats.tokens_per_key[k] += static_cast<int64_t>(sequence.size());
        }
        writers[k].end_document();
      }
      ++stats.documents;
      stats.input_bytes += static_cast<int64_t>(lines[i].size()) + 1;
      if (!options.quiet && stats.documents % options.log_interval == 0) {
        const double elapsed = seconds_since(start);
        std::fprintf(stderr, "Processed %lld documents (%.2f docs/s, %.2f MB/s).\n",
                     static_cast<long long>(stats.documents), static_cast<double>(stats.documents) / elapsed,
                     static_cast<double>(stats.input_bytes) / elapsed / 1024.0 / 1024.0);
      }
    }
  }
  // An empty dataset would only fail later, in training (Megatron writes one without a word).
  if (stats.documents == 0) throw std::runtime_error("no documents in --input " + options.input);
  for (size_t k = 0; k < writers.size(); ++k) {
    if (stats.tokens_per_key[k] == 0) {
      throw std::runtime_error("--input " + options.input + ": the " + std::to_string(stats.documents) +
                               " documents hold no tokens under key '" + options.json_keys[k] + "'");
    }
  }
  for (IndexedDatasetWriter& writer : writers) writer.finalize();
  stats.seconds = seconds_since(start);
  if (!options.quiet) {
    int64_t total_tokens = 0;
    for (const int64_t tokens : stats.tokens_per_key) total_tokens += tokens;
    std::cout << "Done: " << stats.documents << " documents, " << total_tokens << " tokens, "
              << static_cast<double>(stats.input_bytes) / 1024.0 / 1024.0 << " MB in " << stats.seconds << " s ("
              << static_cast<double>(stats.input_bytes) / 1024.0 / 1024.0 / std::max(stats.seconds, 1e-9)
              << " MB/s) -> " << options.output_prefix << "_{" << options.json_keys.front()
              << (options.json_keys.size() > 1 ? ",..." : "") << "}_document.{bin,idx}" << std::endl;
  }
  return stats;
}

void preprocess_main(const std::vector<std::string>& args) {
  if (std::find(args.begin(), args.end(), "--help") != args.end() ||
      std::find(args.begin(), args.end(), "-h") != args.end()) {
    std::cout << kUsage;
    return;
  }
  preprocess(parse_preprocess_args(args));
}

}  // namespace moecore
