// NullTokenizer against Megatron's _NullTokenizer (megatron/training/tokenizer/tokenizer.py):
//   tokenize(text) = [int(x) for x in text.split(' ')], detokenize = ' '.join(map(str, ids)),
//   vocab_size = V + 1, eod = V. Expected parses are Python's int() results (checked with python3).
#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

#include "moecore/tokenizer/null_tokenizer.h"
#include "moecore/tokenizer/tokenizer.h"

namespace moecore {
namespace {

using Ids = std::vector<int32_t>;

TEST(NullTokenizer, SizesFollowMegatron) {
  const NullTokenizer tokenizer(1000);
  EXPECT_EQ(tokenizer.vocab_size(), 1001);
  EXPECT_EQ(tokenizer.eod(), 1000);
  EXPECT_EQ(padded_vocab_size(tokenizer.vocab_size(), 128, 1), 1024);
  const std::unique_ptr<Tokenizer> built = build_tokenizer({"NullTokenizer", "", "", 50257});
  EXPECT_EQ(built->vocab_size(), 50258);
  EXPECT_EQ(built->eod(), 50257);
}

TEST(NullTokenizer, ParsesLikePythonInt) {
  const NullTokenizer tokenizer(5000);
  EXPECT_EQ(tokenizer.tokenize("1 2 3"), (Ids{1, 2, 3}));
  EXPECT_EQ(tokenizer.tokenize("42"), (Ids{42}));
  EXPECT_EQ(tokenizer.tokenize("3\n"), (Ids{3}));           // int('3\n') == 3
  EXPECT_EQ(tokenizer.tokenize("\t7 8\r\n"), (Ids{7, 8}));  // surrounding whitespace of each piece
  EXPECT_EQ(tokenizer.tokenize("\x0b"
                               "9\x0c"),
            (Ids{9}));
  EXPECT_EQ(tokenizer.tokenize("+5 007 -0"), (Ids{5, 7, 0}));
  EXPECT_EQ(tokenizer.tokenize("1_000 4_9_9"), (Ids{1000, 499}));
  EXPECT_EQ(tokenizer.tokenize("5000"), (Ids{5000}));  // eod itself
  // Python raises ValueError for each of these pieces (split(' ') makes '' pieces from extra spaces).
  for (const char* text : {"", " 3", "1  2", "1 ", "1__0", "_1", "1_", "0x10", "1.0", "+-1", "- 1", "a",
                           "\x1c"
                           "9",
                           "1\n2"}) {
    EXPECT_THROW(tokenizer.tokenize(text), TokenizerError) << "'" << text << "'";
  }
}

TEST(NullTokenizer, RejectsIdsOutsideTheVocabulary) {
  const NullTokenizer tokenizer(100);
  EXPECT_THROW(tokenizer.tokenize("101"), TokenizerError);
  EXPECT_THROW(tokenizer.tokenize("-1"), TokenizerError);
  EXPECT_THROW(tokenizer.tokenize("99999999999999999999999"), TokenizerError);
  try {
    tokenizer.tokenize("3 abc 4");
    FAIL() << "no error";
  } catch (const TokenizerError& e) {
    EXPECT_EQ(std::string(e.what()),
              "NullTokenizer: 'abc' is not an integer (the text must be token ids separated by single spaces)");
  }
  EXPECT_THROW(NullTokenizer(0), TokenizerError);
  EXPECT_THROW(NullTokenizer(-3), TokenizerError);
  EXPECT_THROW(build_tokenizer({"NullTokenizer", "", "", -1}), TokenizerError);
}

TEST(NullTokenizer, DetokenizeJoinsWithSpacesAndRoundTrips) {
  const NullTokenizer tokenizer(65535);
  EXPECT_EQ(tokenizer.detokenize({1, 2, 3}), "1 2 3");
  EXPECT_EQ(tokenizer.detokenize({}), "");
  std::mt19937 rng(11);
  for (int trial = 0; trial < 100; ++trial) {
    Ids ids(1 + rng() % 50);
    for (int32_t& id : ids) id = static_cast<int32_t>(rng() % 65536);
    EXPECT_EQ(tokenizer.tokenize(tokenizer.detokenize(ids)), ids);
  }
}

}  // namespace
}  // namespace moecore
