// `moecore generate` sampling flags: non-finite numbers and out-of-range values are one-line errors.
#include <gtest/gtest.h>

#include <fstream>
#include <string>
#include <vector>

#include "moecore/cli/generate_args.h"
#include "moecore/model/config.h"
#include "test_temp_dir.h"

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
  EXPECT_EQ(error_of({"--top-k", "1.5"}), "invalid value '1.5' for --top-k: expected an integer");
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

TEST(GenerateArgs, NoKvCacheSwitch) {
  EXPECT_TRUE(parse_generate_args({"--load", "dir", "--prompt", "hi"}).kv_cache);
  EXPECT_FALSE(parse_generate_args({"--load", "dir", "--no-kv-cache", "--prompt", "hi"}).kv_cache);
  EXPECT_EQ(error_of({"--no-kv-cache=1"}), "--no-kv-cache takes no value (got '--no-kv-cache=1')");
  EXPECT_TRUE(parse_generate_args({"--load", "dir", "--no-kv-cache", "--kv-cache", "--prompt", "hi"}).kv_cache);
}

std::string file_error(const std::vector<std::string>& args) {
  try {
    parse_generate_args(args);
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

TEST(GenerateArgs, PromptFile) {
  const test::TempDir dir("generate_args");
  const auto write = [&](const std::string& name, const std::string& bytes) {
    std::ofstream(dir.path(name), std::ios::binary) << bytes;
    return dir.path(name);
  };
  // The text as written, less the newline that ends its last line.
  const std::string text = write("prompt.txt", "Call me Ishmael.\nSome years ago\u2014never mind how long.\n");
  EXPECT_EQ(parse_generate_args({"--load", "dir", "--prompt-file", text}).prompt,
            "Call me Ishmael.\nSome years ago\u2014never mind how long.");
  EXPECT_EQ(parse_generate_args({"--load", "dir", "--prompt-file", write("crlf.txt", "1 2 3\r\n")}).prompt, "1 2 3");
  const std::string missing = dir.path("missing.txt");
  EXPECT_EQ(file_error({"--load", "dir", "--prompt-file", missing}), "--prompt-file " + missing + ": no such file");
  EXPECT_EQ(file_error({"--load", "dir", "--prompt-file", dir.path().string()}),
            "--prompt-file " + dir.path().string() + " is a directory, not a text file");
  for (const char* empty : {"", "\n"}) {
    const std::string path = write("empty.txt", empty);
    EXPECT_EQ(file_error({"--load", "dir", "--prompt-file", path}), "--prompt-file " + path + " is empty");
  }
  const std::string latin1 = write("latin1.txt", "caf\xe9\n");
  EXPECT_EQ(file_error({"--load", "dir", "--prompt-file", latin1}),
            "--prompt-file " + latin1 + " is not UTF-8 text (an invalid byte at offset 3)");
  EXPECT_EQ(file_error({"--load", "dir", "--prompt", "hi", "--prompt-file", text}),
            "--prompt and --prompt-file are mutually exclusive: give one");
  EXPECT_EQ(file_error({"--load", "dir"}), "--prompt TEXT or --prompt-file PATH is required");
}

TEST(GenerateArgs, TokenizerMustFitTheModel) {
  const GenerateArgs null_args = parse_generate_args(
      {"--load", "ckpt", "--prompt", "1 2", "--tokenizer-type", "NullTokenizer", "--vocab-size", "300"});
  try {
    check_tokenizer_against_model(null_args, 301, 256);
    ADD_FAILURE() << "a tokenizer larger than the model's embedding must be rejected";
  } catch (const ConfigError& e) {
    EXPECT_STREQ(e.what(),
                 "--vocab-size 300 gives a NullTokenizer of 301 tokens (the ids and end-of-document), more than the "
                 "model's 256 embedding rows (ckpt/config.json vocab_size): use the tokenizer the model was trained "
                 "with");
  }
  EXPECT_NO_THROW(check_tokenizer_against_model(null_args, 256, 256));
  EXPECT_NO_THROW(check_tokenizer_against_model(null_args, 129, 256));  // a padded vocabulary
  const GenerateArgs gpt2 = parse_generate_args({"--load", "ckpt", "--prompt", "hi"});
  try {
    check_tokenizer_against_model(gpt2, 50257, 512);
    ADD_FAILURE() << "a tokenizer larger than the model's embedding must be rejected";
  } catch (const ConfigError& e) {
    EXPECT_STREQ(e.what(),
                 "the tokenizer has 50257 tokens, more than the model's 512 embedding rows (ckpt/config.json "
                 "vocab_size): use the tokenizer the model was trained with");
  }
}

}  // namespace
}  // namespace moecore
