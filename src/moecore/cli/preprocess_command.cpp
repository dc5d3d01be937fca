#include "moecore/cli/preprocess_command.h"

#include <algorithm>
#include <exception>
#include <iostream>
#include <stdexcept>
#include <string_view>

#include "moecore/cli/commands.h"
#include "moecore/util/flag_parser.h"

namespace moecore {
namespace {

// clang-format off
// preprocess_data.py's parser: its own flags plus Megatron's tokenizer group (megatron/training/arguments.py).
const std::vector<FlagSpec<PreprocessOptions>>& preprocess_flag_table() {
  static const std::vector<FlagSpec<PreprocessOptions>> table = {
    {"--input", Arity::kOne, "FILE.jsonl", "JSONL input, one document per line (required)",
     [](PreprocessOptions& o, const FlagValue& v) { o.input = v.text(); }},
    {"--json-keys", Arity::kList, "KEY...",
     "the keys to write: text is tokenized, an integer list (ids) written as is (default text)",
     [](PreprocessOptions& o, const FlagValue& v) { o.json_keys = v.values; }},
    {"--split-sentences", Arity::kSwitch, "", "split documents into sentences (Megatron: NLTK; not implemented)",
     [](PreprocessOptions& o, const FlagValue&) { o.split_sentences = true; }},
    {"--keep-newlines", Arity::kSwitch, "", "keep newlines between sentences (only with --split-sentences)",
     [](PreprocessOptions& o, const FlagValue&) { o.keep_newlines = true; }},
    {"--append-eod", Arity::kSwitch, "", "append an end-of-document token to each text document (not id lists)",
     [](PreprocessOptions& o, const FlagValue&) { o.append_eod = true; }},
    {"--lang", Arity::kOne, "LANG", "language of sentence splitting (default english)",
     [](PreprocessOptions& o, const FlagValue& v) { o.lang = v.text(); }},
    {"--output-prefix", Arity::kOne, "PREFIX", "writes PREFIX_KEY_document.bin/.idx (required)",
     [](PreprocessOptions& o, const FlagValue& v) { o.output_prefix = v.text(); }},
    {"--workers", Arity::kOne, "N", "tokenizing threads (required)",
     [](PreprocessOptions& o, const FlagValue& v) { o.workers = v.integer(); }},
    {"--partitions", Arity::kOne, "N", "input partitions (1 only)",
     [](PreprocessOptions& o, const FlagValue& v) { o.partitions = v.integer(); }},
    {"--log-interval", Arity::kOne, "N", "progress every N documents (default 1000)",
     [](PreprocessOptions& o, const FlagValue& v) { o.log_interval = v.integer(); }},
    {"--tokenizer-type", Arity::kOne, "TYPE",
     "GPT2BPETokenizer (encoder.json + vocab.bpe) or NullTokenizer (text = space-separated ids) (required)",
     [](PreprocessOptions& o, const FlagValue& v) { o.tokenizer.type = v.text(); }},
    {"--vocab-file", Arity::kOne, "F", "GPT2BPETokenizer's vocabulary",
     [](PreprocessOptions& o, const FlagValue& v) { o.tokenizer.vocab_file = v.text(); }},
    {"--merge-file", Arity::kOne, "F", "GPT2BPETokenizer's merges",
     [](PreprocessOptions& o, const FlagValue& v) { o.tokenizer.merge_file = v.text(); }},
    {"--vocab-size", Arity::kOne, "V", "NullTokenizer's ids",
     [](PreprocessOptions& o, const FlagValue& v) { o.tokenizer.vocab_size = v.integer(); }},
    {"--vocab-extra-ids", Arity::kOne, "0", "T5 sentinels (0 only, as preprocess_data.py forces)",
     [](PreprocessOptions&, const FlagValue& v) {
       if (v.integer() != 0) {
         throw FlagError("--vocab-extra-ids " + v.text() +
                         ": Megatron's preprocess_data.py forces 0 (T5 sentinels are not supported)");
       }
     }},
    {"--legacy-tokenizer", Arity::kSwitch, "", "accepted: moecore's tokenizers are Megatron's legacy classes",
     [](PreprocessOptions&, const FlagValue&) {}},
  };
  return table;
}
// clang-format on

// preprocess_data.py's flags (and its tokenizer group's) that moecore's preprocess does not implement.
constexpr std::string_view kMegatronOnlyFlags[] = {
    "--find-optimal-num-workers",
    "--workers-to-check",
    "--max-documents",
    "--performance-dir",
    "--keep-sequential-samples",
    "--padded-vocab-size",
    "--tokenizer-model",
    "--tokenizer-metadata",
    "--tiktoken-pattern",
    "--tiktoken-num-special-tokens",
    "--tiktoken-special-tokens",
    "--trust-remote-code",
    "--tokenizer-hf-no-use-fast",
    "--tokenizer-hf-no-include-special-tokens",
    "--tokenizer-sentencepiece-legacy",
    "--special-tokens",
    "--tokenizer-prompt-format",
    "--sft-tokenizer-prompt-format",
    "--image-tag-type",
    "--force-system-message",
    "--metadata-path",
};

std::string preprocess_usage() {
  return "usage: moecore preprocess --input FILE.jsonl --output-prefix PREFIX --workers N --tokenizer-type TYPE\n"
         "                          [--vocab-file F --merge-file F | --vocab-size V] [--json-keys KEY ...]\n"
         "                          [--append-eod] [--log-interval N] [--partitions 1]\n"
         "Writes PREFIX_KEY_document.bin/.idx (Megatron indexed dataset) for each --json-keys KEY (default: "
         "text).\n\n" +
         flags_help(preprocess_flag_table());
}

}  // namespace

PreprocessOptions parse_preprocess_args(const std::vector<std::string>& args) {
  PreprocessOptions options;
  FlagParserOptions parser;
  parser.allow_abbrev = true;
  parser.is_megatron_only = [](const std::string_view name) {
    return std::find(std::begin(kMegatronOnlyFlags), std::end(kMegatronOnlyFlags), name) !=
           std::end(kMegatronOnlyFlags);
  };
  parser.megatron_names.assign(std::begin(kMegatronOnlyFlags), std::end(kMegatronOnlyFlags));
  ParsedFlags parsed;
  try {
    parsed = parse_flags(preprocess_flag_table(), args, options, parser);
  } catch (const FlagError& error) {
    throw std::invalid_argument(error.what());
  }
  if (parsed.help_requested) {
    const std::string usage = preprocess_usage();
    throw std::invalid_argument(usage.substr(0, usage.find('\n')));
  }
  std::string missing;
  for (const std::string_view required : {"--input", "--output-prefix", "--workers"}) {
    if (!parsed.given.count(std::string(required))) missing.append(" ").append(required);
  }
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

void preprocess_main(const std::vector<std::string>& args) {
  if (std::find(args.begin(), args.end(), "--help") != args.end() ||
      std::find(args.begin(), args.end(), "-h") != args.end()) {
    std::cout << preprocess_usage();
    return;
  }
  preprocess(parse_preprocess_args(args));
}

}  // namespace moecore

int run_preprocess(int argc, char** argv) {
  try {
    moecore::preprocess_main(std::vector<std::string>(argv + (argc > 0 ? 1 : 0), argv + argc));
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << std::endl;
    return 1;
  }
}
