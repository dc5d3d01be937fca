// Fuzz harness: the command lines of `moecore train` (parse_train_args, then what the trainer derives from the
// arguments), `moecore generate` (parse_generate_args) and `moecore preprocess` (parse_preprocess_args), and the
// flag files under configs/ (*.args: one flag and its value per line, '#' comments, read as the shell does with
// `$(grep -v '^#' FILE)`).
//
// Input: the tokens of one command line. With a NUL byte in the input the tokens are the NUL-separated pieces
// (any byte may appear in a token); otherwise the input is a flag file: lines starting with '#' dropped, the rest
// split on blanks. A first token "generate" or "preprocess" picks that command; "train" or anything else, train.
#include <cstddef>
#include <cstdint>
#include <exception>
#include <string>
#include <string_view>
#include <vector>

#include "fuzz_util.h"
#include "moecore/cli/generate_args.h"
#include "moecore/cli/preprocess_command.h"
#include "moecore/config/arguments.h"
#include "moecore/plan/run_memory_estimate.h"

namespace {

constexpr size_t kMaxTokens = 512;

std::vector<std::string> tokens_of(std::string_view text) {
  std::vector<std::string> tokens;
  if (text.find('\0') != std::string_view::npos) {
    size_t begin = 0;
    while (begin <= text.size() && tokens.size() < kMaxTokens) {
      const size_t end = std::min(text.find('\0', begin), text.size());
      tokens.emplace_back(text.substr(begin, end - begin));
      begin = end + 1;
    }
    return tokens;
  }
  size_t line_begin = 0;
  while (line_begin < text.size() && tokens.size() < kMaxTokens) {
    const size_t line_end = std::min(text.find('\n', line_begin), text.size());
    const std::string_view line = text.substr(line_begin, line_end - line_begin);
    line_begin = line_end + 1;
    if (!line.empty() && line.front() == '#') continue;
    size_t i = 0;
    while (i < line.size()) {
      while (i < line.size() && (line[i] == ' ' || line[i] == '\t')) ++i;
      const size_t start = i;
      while (i < line.size() && line[i] != ' ' && line[i] != '\t') ++i;
      if (i > start) tokens.emplace_back(line.substr(start, i - start));
    }
  }
  return tokens;
}

void fuzz_train(const std::vector<std::string>& args, const int64_t world_size) {
  const moecore::TrainingArgs parsed = moecore::parse_train_args(args, world_size);
  if (parsed.help_requested) return;
  // What the trainer computes from the arguments before it allocates anything.
  (void)moecore::pipeline_shape(parsed);
  (void)moecore::lr_schedule_config(parsed);
  moecore::TrainingArgs with_vocabulary = parsed;
  with_vocabulary.model.vocab_size = moecore::padded_vocab_size(50257, parsed);
  (void)moecore::plan::estimate_run_memory(with_vocabulary).total();
}

void fuzz_generate(const std::vector<std::string>& args) {
  const moecore::GenerateArgs parsed = moecore::parse_generate_args(args);
  if (!parsed.help_requested) (void)moecore::generate_tokenizer_options(parsed);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::vector<std::string> tokens = tokens_of(std::string_view(reinterpret_cast<const char*>(data), size));
  std::string command = "train";
  if (!tokens.empty() &&
      (tokens.front() == "train" || tokens.front() == "generate" || tokens.front() == "preprocess")) {
    command = tokens.front();
    tokens.erase(tokens.begin());
  }
  try {
    if (command == "generate") {
      fuzz_generate(tokens);
    } else if (command == "preprocess") {
      (void)moecore::parse_preprocess_args(tokens);
    } else {
      // Also the data-parallel arithmetic of a multi-rank job: world sizes 1, 2, 4 and 8.
      fuzz_train(tokens, int64_t{1} << (size % 4));
    }
  } catch (const std::exception& error) {
    moecore::fuzz::expected_error(error);
  }
  return 0;
}
