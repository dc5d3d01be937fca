#include "moecore/data/preprocess.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <thread>

#include "moecore/data/indexed_dataset.h"
#include "moecore/util/json_error.h"

namespace moecore {

// ---------------------------------------------------------------------------------------------------------------
// Conversion

namespace {

// Tokens of one JSON line: per key, the non-empty sequences of the document (one, or one per list element of a
// list of strings).
struct EncodedLine {
  std::vector<std::vector<std::vector<int32_t>>> sequences_per_key;
  std::string error;  // non-empty: the problem with this line
};

std::string json_type_name(const nlohmann::json& value) { return value.type_name(); }

// "a string", "an array".
std::string json_type_with_article(const nlohmann::json& value) {
  const std::string name = value.type_name();
  return (name.front() == 'a' || name.front() == 'o' ? "an " : "a ") + name;
}

// A list whose first element is a number holds ids, already tokenized; anything else is text.
bool is_id_list(const nlohmann::json& value) { return value.is_array() && !value.empty() && value.front().is_number(); }

// The ids of an id list, checked one by one: integers in [0, 2^31), each below the tokenizer's vocabulary size
// (the dataset is read with that tokenizer at training time). An empty string when they are valid, else the
// problem.
std::string read_ids(const nlohmann::json& list, const int64_t vocab_size, std::vector<int32_t>& ids) {
  constexpr int64_t kIdLimit = int64_t{1} << 31;
  constexpr int64_t kInt64Max = std::numeric_limits<int64_t>::max();
  ids.reserve(list.size());
  for (size_t index = 0; index < list.size(); ++index) {
    const nlohmann::json& element = list[index];
    const std::string where = " at index " + std::to_string(index);
    // nlohmann parses non-negative integers as unsigned, negative ones as signed, and integers beyond 64 bits
    // as doubles: those are out of range rather than "not an integer".
    const bool huge = element.is_number_float() && std::abs(element.get<double>()) >= 0x1p63;
    if (!element.is_number_integer() && !huge) {
      const std::string got = element.is_number() ? element.dump() : json_type_with_article(element);
      return "id list" + where + " holds " + got + ", not an integer";
    }
    const bool above_int64 =
        huge || (element.is_number_unsigned() && element.get<uint64_t>() > static_cast<uint64_t>(kInt64Max));
    const int64_t id = above_int64 ? kInt64Max : element.get<int64_t>();  // saturated: out of range either way
    if (id < 0 || id >= kIdLimit) return "id " + element.dump() + where + " is outside [0, 2^31)";
    if (id >= vocab_size) {
      return "id " + std::to_string(id) + where + " is not below the tokenizer's vocabulary size " +
             std::to_string(vocab_size);
    }
    ids.push_back(static_cast<int32_t>(id));
  }
  return "";
}

// Megatron's Encoder.encode for one line.
EncodedLine encode_line(const std::string& line, const PreprocessOptions& options, const Tokenizer& tokenizer) {
  EncodedLine encoded;
  nlohmann::json document;
  try {
    document = nlohmann::json::parse(line);
  } catch (const nlohmann::json::parse_error& e) {
    std::string what = json_error_text(e);  // "parse error at line 1, column 5: syntax error ..."
    if (const size_t column = what.find("column "); column != std::string::npos) what = what.substr(column);
    encoded.error = "malformed JSON at " + what;
    return encoded;
  }
  if (!document.is_object()) {
    encoded.error = "expected a JSON object, got " + json_type_name(document);
    return encoded;
  }
  encoded.sequences_per_key.resize(options.json_keys.size());
  const int64_t vocab_size = tokenizer.vocab_size();
  for (size_t k = 0; k < options.json_keys.size(); ++k) {
    const std::string& key = options.json_keys[k];
    const auto it = document.find(key);
    if (it == document.end()) {
      encoded.error = "no key '" + key + "'";
      return encoded;
    }
    auto& sequences = encoded.sequences_per_key[k];
    if (is_id_list(*it)) {  // written as is: no tokenizer, no --append-eod
      std::vector<int32_t> ids;
      if (const std::string problem = read_ids(*it, vocab_size, ids); !problem.empty()) {
        encoded.error = "key '" + key + "': " + problem;
        return encoded;
      }
      sequences.push_back(std::move(ids));
      continue;
    }
    std::vector<const std::string*> sentences;
    if (it->is_string()) {
      sentences.push_back(it->get_ptr<const std::string*>());
    } else if (it->is_array() && std::all_of(it->begin(), it->end(), [](const auto& v) { return v.is_string(); })) {
      for (const auto& sentence : *it) sentences.push_back(sentence.get_ptr<const std::string*>());
    } else {
      encoded.error =
          "key '" + key + "' must be a string, a list of strings or a list of integers, got " + json_type_name(*it);
      if (it->is_array()) {
        const auto not_string = std::find_if(it->begin(), it->end(), [](const auto& v) { return !v.is_string(); });
        encoded.error += " holding " + json_type_with_article(*not_string) + " at index " +
                         std::to_string(std::distance(it->begin(), not_string));
      }
      return encoded;
    }
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

}  // namespace moecore
