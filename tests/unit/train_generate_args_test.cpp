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

}  // namespace
}  // namespace moecore
