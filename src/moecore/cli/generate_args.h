// `moecore generate` flags (the common flag parser, util/flag_parser.h):
//   --load DIR               HuggingFace-style export (config.json + model.safetensors), e.g. from --export-hf
//   --prompt TEXT            text to continue (this or --prompt-file is required)
//   --prompt-file PATH       the text to continue from a UTF-8 file (one final newline dropped)
//   --max-new-tokens N       tokens to produce (default 64)
//   --temperature T          0 = greedy (default); > 0 samples from softmax(logits / T); finite
//   --top-k K                sample among the K most likely tokens (0 = all; at most the vocabulary)
//   --seed N                 sampling seed (default 1234)
//   --kv-cache / --no-kv-cache
//                            keep a key / value cache (default), or re-run the whole context for every new token
//                            instead of keeping a key / value cache (the reference the cache is checked against; the
//                            same tokens, slower)
//   --tokenizer-type, --vocab-file, --merge-file
//                            the tokenizer; default GPT2BPETokenizer with DIR/vocab.json and DIR/merges.txt
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "moecore/tokenizer/tokenizer.h"

namespace moecore {

struct GenerateArgs {
  std::string load_dir;
  std::string prompt;
  std::string prompt_file;  // --prompt-file: its text is read into `prompt`
  int64_t max_new_tokens = 64;
  double temperature = 0.0;
  int64_t top_k = 0;
  uint64_t seed = 1234;
  bool kv_cache = true;        // false: --no-kv-cache
  std::string record_routing;  // --record-routing FILE: router replay's recording, appended to FILE
  std::string tokenizer_type = "GPT2BPETokenizer";
  std::string vocab_file;             // default DIR/vocab.json
  std::string merge_file;             // default DIR/merges.txt
  std::optional<int64_t> vocab_size;  // NullTokenizer: ids below it, the last one EOD (as `moecore train`)
  bool help_requested = false;
};

// Throws ConfigError with one line (unknown flag with a suggestion, bad value, missing --load / --prompt).
GenerateArgs parse_generate_args(const std::vector<std::string>& args);
// Throws ConfigError when --top-k exceeds the tokenizer's vocabulary (the ids sampling may produce).
void check_sampling_against_vocabulary(const GenerateArgs& args, int64_t vocab_size);
// Throws ConfigError when the tokenizer has more tokens than the model's embedding rows (config.json vocab_size):
// its ids would fall outside the model. Fewer tokens is a padded vocabulary, as `moecore train` pads it.
void check_tokenizer_against_model(const GenerateArgs& args, int64_t tokenizer_vocab_size, int64_t model_rows);
// The text of --prompt-file PATH: UTF-8, one final "\n" (or "\r\n") dropped. ConfigError naming the file when it is
// missing, unreadable, not UTF-8 or empty.
std::string read_prompt_file(const std::string& path);
std::string generate_usage();
TokenizerOptions generate_tokenizer_options(const GenerateArgs& args);

}  // namespace moecore
