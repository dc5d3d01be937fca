// The ranks' command lines compared flag by flag: last occurrence wins, --flag=value equals --flag value, a flag
// given on one rank only differs, per-rank flags are skipped, and the first differing flag in table order is named.
#include <gtest/gtest.h>

#include <optional>
#include <string>
#include <vector>

#include "moecore/train/argument_agreement.h"

namespace moecore {
namespace {

using Args = std::vector<std::string>;

TEST(ArgumentAgreement, EqualCommandLinesAgree) {
  const Args args = {"--num-layers", "2", "--seed", "7", "--bf16", "--data-path", "1", "a", "2", "b"};
  EXPECT_EQ(first_argument_disagreement(args, args, 1), std::nullopt);
  EXPECT_EQ(first_argument_disagreement({}, {}, 1), std::nullopt);
}

TEST(ArgumentAgreement, NamesTheDifferingFlagWithBothValues) {
  EXPECT_EQ(first_argument_disagreement({"--seed", "1234", "--lr", "1e-3"}, {"--seed", "7", "--lr", "1e-3"}, 1),
            "ranks disagree on --seed: rank 0 has 1234, rank 1 has 7");
  EXPECT_EQ(first_argument_disagreement({"--lr", "1e-3"}, {"--lr", "1e-2"}, 3),
            "ranks disagree on --lr: rank 0 has 1e-3, rank 3 has 1e-2");
}

TEST(ArgumentAgreement, LastOccurrenceWinsAndEqualsSyntaxIsTheSame) {
  // Rank 0 ends with --seed 7, as rank 1 does: argparse keeps the last value.
  EXPECT_EQ(first_argument_disagreement({"--seed", "1", "--seed", "7"}, {"--seed=7"}, 1), std::nullopt);
  EXPECT_EQ(first_argument_disagreement({"--seed", "7", "--seed", "1"}, {"--seed", "7"}, 1),
            "ranks disagree on --seed: rank 0 has 1, rank 1 has 7");
  // The order of different flags does not matter.
  EXPECT_EQ(first_argument_disagreement({"--seed", "7", "--lr", "1"}, {"--lr", "1", "--seed", "7"}, 1), std::nullopt);
}

TEST(ArgumentAgreement, AFlagOnOneRankOnlyDiffers) {
  EXPECT_EQ(first_argument_disagreement({"--seed", "1234"}, {}, 1),
            "ranks disagree on --seed: rank 0 has 1234, rank 1 does not give it");
  EXPECT_EQ(first_argument_disagreement({}, {"--bf16"}, 2),
            "ranks disagree on --bf16: rank 0 does not give it, rank 2 gives it");
  // A flag given with its default value still differs from an absent one: the command lines are what is compared.
  EXPECT_EQ(first_argument_disagreement({}, {"--seed", "1234"}, 1),
            "ranks disagree on --seed: rank 0 does not give it, rank 1 has 1234");
}

TEST(ArgumentAgreement, ListValuesAndQuotedValues) {
  EXPECT_EQ(first_argument_disagreement({"--data-path", "1", "a", "1", "b"}, {"--data-path", "1", "a"}, 1),
            "ranks disagree on --data-path: rank 0 has 1 a 1 b, rank 1 has 1 a");
  EXPECT_EQ(first_argument_disagreement({"--sample-prompt", "hello world"}, {"--sample-prompt", "hello"}, 1),
            "ranks disagree on --sample-prompt: rank 0 has 'hello world', rank 1 has hello");
}

TEST(ArgumentAgreement, FirstInFlagTableOrder) {
  // --num-layers comes before --seed in the flag table (model shape first), whatever the command-line order.
  EXPECT_EQ(first_argument_disagreement({"--seed", "1", "--num-layers", "2"}, {"--seed", "2", "--num-layers", "4"}, 1),
            "ranks disagree on --num-layers: rank 0 has 2, rank 1 has 4");
  // Names the table does not know (they fail in parsing later) come after it, alphabetically.
  EXPECT_EQ(first_argument_disagreement({"--zz", "1", "--aa", "1", "--seed", "1"},
                                        {"--zz", "2", "--aa", "2", "--seed", "2"}, 1),
            "ranks disagree on --seed: rank 0 has 1, rank 1 has 2");
  EXPECT_EQ(first_argument_disagreement({"--zz", "1", "--aa", "1"}, {"--zz", "2", "--aa", "2"}, 1),
            "ranks disagree on --aa: rank 0 has 1, rank 1 has 2");
}

TEST(ArgumentAgreement, PerRankFlagsAreSkipped) {
  EXPECT_EQ(first_argument_disagreement({"--threads", "4"}, {"--threads", "16"}, 1), std::nullopt);
  EXPECT_EQ(first_argument_disagreement({"--threads", "4"}, {}, 1), std::nullopt);
}

TEST(ArgumentAgreement, StrayTokensAndNegativeNumbers) {
  // A negative number is a value, not a flag (as argparse).
  EXPECT_EQ(first_argument_disagreement({"--seed", "-1"}, {"--seed", "-2"}, 1),
            "ranks disagree on --seed: rank 0 has -1, rank 1 has -2");
  EXPECT_EQ(first_argument_disagreement({"stray", "--seed", "1"}, {"--seed", "1"}, 1),
            "ranks disagree on the arguments before the first flag: rank 0 has stray, rank 1 does not give it");
}

}  // namespace
}  // namespace moecore
