// `moecore generate` sampling flags: non-finite numbers and out-of-range values are one-line errors.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "moecore/model/config.h"
#include "moecore/train/generate_args.h"

namespace moecore {
namespace {

std::string error_of(const std::vector<std::string>& extra) {
  std::vector<std::string> args = {"--load", "dir", "--prompt", "hi"};
  args.insert(args.end(), extra.begin(), extra.end());
  try {
    parse_generate_args(args);
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

TEST(GenerateArgs, TemperatureMustBeFinite) {
  EXPECT_EQ(error_of({"--temperature", "nan"}), "invalid value 'nan' for --temperature: expected a finite number");
  EXPECT_EQ(error_of({"--temperature", "inf"}), "invalid value 'inf' for --temperature: expected a finite number");
  EXPECT_EQ(error_of({"--temperature=-infinity"}),
            "invalid value '-infinity' for --temperature: expected a finite number");
  EXPECT_EQ(error_of({"--temperature", "-0.5"}), "--temperature must be >= 0");
  EXPECT_EQ(error_of({"--temperature", "0.7"}), "");
}

TEST(GenerateArgs, TopKRange) {
  EXPECT_EQ(error_of({"--top-k", "-1"}), "--top-k must be >= 0");
  EXPECT_EQ(error_of({"--top-k", "1.5"}), "invalid value '1.5' for --top-k: expected a number");
  GenerateArgs args = parse_generate_args({"--load", "dir", "--prompt", "hi", "--top-k", "129"});
  try {
    check_sampling_against_vocabulary(args, 128);
    ADD_FAILURE() << "--top-k above the vocabulary must be rejected";
  } catch (const ConfigError& e) {
    EXPECT_STREQ(e.what(), "--top-k 129 is larger than the vocabulary (128 tokens)");
  }
  args.top_k = 128;
  EXPECT_NO_THROW(check_sampling_against_vocabulary(args, 128));
}

TEST(GenerateArgs, NewTokensAndNullTokenizer) {
  EXPECT_EQ(error_of({"--max-new-tokens", "4611686018427387904"}),
            "--max-new-tokens 4611686018427387904 is above the limit of 16777216");
  EXPECT_EQ(error_of({"--tokenizer-type", "NullTokenizer"}),
            "--tokenizer-type NullTokenizer requires --vocab-size (as `moecore train`)");
  EXPECT_EQ(error_of({"--vocab-size", "100"}), "--vocab-size is used only with --tokenizer-type NullTokenizer");
  const GenerateArgs args = parse_generate_args(
      {"--load", "dir", "--prompt", "1 2", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100"});
  // As `moecore train`: ids 0..99 and the EOD id 100.
  EXPECT_EQ(build_tokenizer(generate_tokenizer_options(args))->vocab_size(), 101);
}

}  // namespace
}  // namespace moecore
