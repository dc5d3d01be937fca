#include "moecore/data/sample_dataset.h"

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>

#include "moecore/data/indexed_dataset.h"
#include "moecore/util/json_error.h"

namespace moecore {

struct SampleDataset::Indexed {
  IndexedDataset tokens;
  std::optional<IndexedDataset> loss_mask;
  explicit Indexed(const std::string& prefix) : tokens(prefix + "_tokens_document") {}
};

namespace {

// The ids of document d (all its sequences).
std::vector<int32_t> document(const IndexedDataset& data, const int64_t d) {
  std::vector<int32_t> ids;
  const std::vector<int64_t>& docs = data.document_indices();
  for (int64_t s = docs[static_cast<size_t>(d)]; s < docs[static_cast<size_t>(d) + 1]; ++s) {
    const std::vector<int32_t> part = data.get(s);
    ids.insert(ids.end(), part.begin(), part.end());
  }
  return ids;
}

int64_t document_length(const IndexedDataset& data, const int64_t d) {
  int64_t n = 0;
  const std::vector<int64_t>& docs = data.document_indices();
  for (int64_t s = docs[static_cast<size_t>(d)]; s < docs[static_cast<size_t>(d) + 1]; ++s) {
    n += data.sequence_lengths()[static_cast<size_t>(s)];
  }
  return n;
}

// "" or what is wrong with a sample.
std::string sample_problem(const Sample& sample, const int64_t vocab_size) {
  if (sample.tokens.size() < 2) return "has " + std::to_string(sample.tokens.size()) + " tokens (at least 2)";
  if (sample.loss_mask.size() != sample.tokens.size()) {
    return "has " + std::to_string(sample.tokens.size()) + " tokens but " + std::to_string(sample.loss_mask.size()) +
           " loss-mask values";
  }
  for (size_t i = 0; i < sample.tokens.size(); ++i) {
    if (sample.tokens[i] < 0 || sample.tokens[i] >= vocab_size) {
      return "token " + std::to_string(i) + " is id " + std::to_string(sample.tokens[i]) +
             ", outside the vocabulary of " + std::to_string(vocab_size);
    }
    if (sample.loss_mask[i] > 1) return "loss-mask value " + std::to_string(i) + " is not 0 or 1";
  }
  return "";
}

// One JSONL line's sample; DataError naming the line.
Sample parse_line(const std::string& path, const int64_t line_number, const std::string& line) {
  const auto bad = [&](const std::string& problem) {
    return DataError(path + ":" + std::to_string(line_number) + ": " + problem);
  };
  nlohmann::json object;
  try {
    object = nlohmann::json::parse(line);
  } catch (const nlohmann::json::parse_error& e) {
    throw bad("malformed JSON (" + json_error_text(e) + ")");
  }
  if (!object.is_object()) throw bad("expected a JSON object");
  const auto ints = [&](const char* key, const int64_t low, const int64_t high) {
    std::vector<int64_t> values;
    const auto it = object.find(key);
    if (!it->is_array()) throw bad(std::string("\"") + key + "\" must be a list of integers");
    for (const auto& value : *it) {
      if (!value.is_number_integer() || value.get<int64_t>() < low || value.get<int64_t>() > high) {
        throw bad(std::string("\"") + key + "\" must hold integers in [" + std::to_string(low) + ", " +
                  std::to_string(high) + "], got " + value.dump());
      }
      values.push_back(value.get<int64_t>());
    }
    return values;
  };
  if (!object.contains("tokens")) throw bad("no \"tokens\"");
  Sample sample;
  for (const int64_t id : ints("tokens", 0, INT32_MAX)) sample.tokens.push_back(static_cast<int32_t>(id));
  if (object.contains("loss_mask")) {
    for (const int64_t m : ints("loss_mask", 0, 1)) sample.loss_mask.push_back(static_cast<uint8_t>(m));
  } else {
    sample.loss_mask.assign(sample.tokens.size(), 1);
  }
  return sample;
}

}  // namespace

SampleDataset::SampleDataset(const std::string& path, const int64_t vocab_size) : path_(path) {
  if (path.ends_with(".jsonl")) {
    std::error_code error;
    if (!std::filesystem::is_regular_file(path, error)) throw DataError(path + ": no such file");
    std::ifstream in(path);
    std::string line;
    int64_t line_number = 0;
    while (std::getline(in, line)) {
      ++line_number;
      if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
      Sample sample = parse_line(path, line_number, line);
      if (const std::string problem = sample_problem(sample, vocab_size); !problem.empty()) {
        throw DataError(path + ":" + std::to_string(line_number) + ": the sample " + problem);
      }
      lengths_.push_back(static_cast<int64_t>(sample.tokens.size()));
      samples_.push_back(std::move(sample));
    }
    if (in.bad()) throw DataError(path + ": cannot be read");
  } else {
    indexed_ = std::make_unique<Indexed>(path);
    const std::string mask_prefix = path + "_loss_mask_document";
    std::error_code error;
    if (std::filesystem::exists(mask_prefix + ".idx", error)) indexed_->loss_mask.emplace(mask_prefix);
    const int64_t documents = static_cast<int64_t>(indexed_->tokens.document_indices().size()) - 1;
    if (indexed_->loss_mask && static_cast<int64_t>(indexed_->loss_mask->document_indices().size()) - 1 != documents) {
      throw DataError(mask_prefix + " has " + std::to_string(indexed_->loss_mask->document_indices().size() - 1) +
                      " documents, " + path + "_tokens_document " + std::to_string(documents));
    }
    for (int64_t d = 0; d < documents; ++d) {
      const int64_t n = document_length(indexed_->tokens, d);
      if (indexed_->loss_mask && document_length(*indexed_->loss_mask, d) != n) {
        throw DataError(mask_prefix + ": sample " + std::to_string(d) + " has " +
                        std::to_string(document_length(*indexed_->loss_mask, d)) + " loss-mask values for " +
                        std::to_string(n) + " tokens");
      }
      if (const std::string problem = sample_problem(sample(d), vocab_size); !problem.empty()) {
        throw DataError(path + ": sample " + std::to_string(d) + " " + problem);
      }
      lengths_.push_back(n);
    }
  }
  if (lengths_.empty()) throw DataError(path + ": no samples");
}

SampleDataset::~SampleDataset() = default;

Sample SampleDataset::sample(const int64_t i) const {
  if (!indexed_) return samples_.at(static_cast<size_t>(i));
  Sample out;
  out.tokens = document(indexed_->tokens, i);
  if (indexed_->loss_mask) {
    for (const int32_t m : document(*indexed_->loss_mask, i)) out.loss_mask.push_back(m == 0 ? 0 : m == 1 ? 1 : 2);
  } else {
    out.loss_mask.assign(out.tokens.size(), 1);
  }
  return out;
}

}  // namespace moecore
