// The generic flag parser every command uses: arities, `=value`, `--no-` forms, argparse's negative numbers, the
// errors (one wording for every command) and the help text.
#include <gtest/gtest.h>

#include <optional>

#include "moecore/util/flag_parser.h"

namespace moecore {
namespace {

struct Options {
  int64_t layers = 0;
  double rate = 0.0;
  bool fast = false;
  bool cache = true;
  std::vector<int64_t> ranks;
  std::string mode = "a";
};

const std::vector<FlagSpec<Options>>& table() {
  static const std::vector<FlagSpec<Options>> rows = {
      {"--num-layers", Arity::kOne, "N", "layers",
       [](Options& o, const FlagValue& v) { o.layers = v.integer_up_to(100); }},
      {"--rate", Arity::kOne, "X", "a rate", [](Options& o, const FlagValue& v) { o.rate = v.real(); }},
      {"--fast", Arity::kSwitch, "", "go fast", [](Options& o, const FlagValue&) { o.fast = true; }},
      {"--cache", Arity::kSwitch, "", "keep a cache", [](Options& o, const FlagValue& v) { o.cache = !v.negated; },
       "--no-cache"},
      {"--ranks", Arity::kList, "R...", "ranks",
       [](Options& o, const FlagValue& v) { o.ranks = v.each([](const FlagValue& one) { return one.integer(); }); }},
      {"--mode", Arity::kOne, "{a,b}", "a mode",
       [](Options& o, const FlagValue& v) {
         o.mode = v.choice({"a", "b"}, {"c"});
       }},
  };
  return rows;
}

Options parse(const std::vector<std::string>& args, const FlagParserOptions& options = {}) {
  Options parsed;
  parse_flags(table(), args, parsed, options);
  return parsed;
}

std::string error_of(const std::vector<std::string>& args, const FlagParserOptions& options = {}) {
  try {
    parse(args, options);
  } catch (const FlagError& error) {
    return error.what();
  }
  return "no error";
}

TEST(FlagParser, EveryArityWithSpaceAndEquals) {
  const Options parsed = parse({"--num-layers", "4", "--rate=0.5", "--fast", "--ranks", "0", "3", "--mode=b"});
  EXPECT_EQ(parsed.layers, 4);
  EXPECT_DOUBLE_EQ(parsed.rate, 0.5);
  EXPECT_TRUE(parsed.fast);
  EXPECT_EQ(parsed.ranks, (std::vector<int64_t>{0, 3}));
  EXPECT_EQ(parsed.mode, "b");
  EXPECT_EQ(parse({"--ranks=7"}).ranks, std::vector<int64_t>{7});
  EXPECT_EQ(parse({"--num-layers", "2", "--num-layers", "5"}).layers, 5);  // last wins
}

TEST(FlagParser, GivenNamesTheFlagsThatAppeared) {
  Options parsed;
  const ParsedFlags flags = parse_flags(table(), {"--fast", "--no-cache", "--rate", "1"}, parsed);
  EXPECT_EQ(flags.given, (std::set<std::string>{"--fast", "--no-cache", "--rate"}));
  EXPECT_FALSE(flags.help_requested);
}

TEST(FlagParser, NoFormOfASwitch) {
  EXPECT_TRUE(parse({}).cache);
  EXPECT_FALSE(parse({"--no-cache"}).cache);
  EXPECT_TRUE(parse({"--no-cache", "--cache"}).cache);
  EXPECT_EQ(error_of({"--no-cache=1"}), "--no-cache takes no value (got '--no-cache=1')");
  EXPECT_EQ(error_of({"--no-fast"}), "unknown flag --no-fast");
}

TEST(FlagParser, NegativeNumbersAreValues) {
  EXPECT_DOUBLE_EQ(parse({"--rate", "-2.5"}).rate, -2.5);
  EXPECT_DOUBLE_EQ(parse({"--rate", "-.5"}).rate, -0.5);
  EXPECT_DOUBLE_EQ(parse({"--rate", "-1e-3"}).rate, -1e-3);
  EXPECT_EQ(parse({"--ranks", "-1", "2"}).ranks, (std::vector<int64_t>{-1, 2}));
  EXPECT_EQ(error_of({"--num-layers", "-1,1"}), "invalid value '-1,1' for --num-layers: expected an integer");
  EXPECT_TRUE(looks_like_flag("--x"));
  EXPECT_TRUE(looks_like_flag("-h"));
  EXPECT_FALSE(looks_like_flag("-3"));
  EXPECT_FALSE(looks_like_flag("-"));
  EXPECT_FALSE(looks_like_flag("value"));
}

TEST(FlagParser, UnknownFlagSuggestsTheClosest) {
  EXPECT_EQ(error_of({"--num-layer", "4"}), "unknown flag --num-layer (did you mean --num-layers?)");
  EXPECT_EQ(error_of({"--zzzzzzzz"}), "unknown flag --zzzzzzzz");
  EXPECT_EQ(error_of({"--num-layer=4"}), "unknown flag --num-layer (did you mean --num-layers?)");
}

TEST(FlagParser, MegatronOnlyHook) {
  FlagParserOptions options;
  options.is_megatron_only = [](const std::string_view name) { return name == "--moe-latent-size"; };
  options.megatron_names = {"--moe-latent-size"};
  EXPECT_EQ(error_of({"--moe-latent-size", "3"}, options),
            "--moe-latent-size is a Megatron flag that moecore does not implement yet");
  EXPECT_EQ(error_of({"--moe-latent-sizes"}, options),
            "unknown flag --moe-latent-sizes (did you mean --moe-latent-size?)");
}

TEST(FlagParser, RefusalHookComesFirst) {
  FlagParserOptions options;
  options.is_megatron_only = [](const std::string_view) { return true; };
  options.refusal = [](const std::string_view name) {
    return name == "--optimizer-cpu-offload" ? std::string("--optimizer-cpu-offload has no meaning here") : "";
  };
  options.megatron_names = {"--optimizer-cpu-offload", "--moe-latent-size"};
  EXPECT_EQ(error_of({"--optimizer-cpu-offload"}, options), "--optimizer-cpu-offload has no meaning here");
  EXPECT_EQ(error_of({"--moe-latent-size", "3"}, options),
            "--moe-latent-size is a Megatron flag that moecore does not implement yet");
}

TEST(FlagParser, MissingValues) {
  EXPECT_EQ(error_of({"--num-layers"}), "--num-layers expects a value (N)");
  EXPECT_EQ(error_of({"--num-layers", "--fast"}), "--num-layers expects a value (N)");
  EXPECT_EQ(error_of({"--ranks"}), "--ranks expects at least one value (R...)");
  EXPECT_EQ(error_of({"--ranks", "--fast"}), "--ranks expects at least one value (R...)");
}

TEST(FlagParser, SwitchGivenAValue) {
  EXPECT_EQ(error_of({"--fast=yes"}), "--fast takes no value (got '--fast=yes')");
  EXPECT_EQ(error_of({"--fast", "yes"}),
            "unexpected argument 'yes' (flags start with --; a value belongs after its flag)");
}

TEST(FlagParser, ValueHelpers) {
  EXPECT_EQ(error_of({"--num-layers", "abc"}), "invalid value 'abc' for --num-layers: expected an integer");
  EXPECT_EQ(error_of({"--num-layers", "101"}), "--num-layers 101 is above the limit of 100");
  EXPECT_EQ(error_of({"--rate", "nan"}), "invalid value 'nan' for --rate: expected a finite number");
  EXPECT_EQ(error_of({"--mode", "c"}), "--mode c is not implemented yet (moecore implements a, b)");
  EXPECT_EQ(error_of({"--mode", "d"}), "invalid value 'd' for --mode (choose from a, b, c)");
  EXPECT_EQ(error_of({"--ranks", "1", "x"}), "invalid value 'x' for --ranks: expected an integer");
  EXPECT_EQ(parse({"--num-layers=+7"}).layers, 7);
  EXPECT_EQ((FlagValue{"--seed", {"18446744073709551615"}}.unsigned_integer()), UINT64_MAX);
  EXPECT_THROW((FlagValue{"--seed", {"-1"}}.unsigned_integer()), FlagError);
  const FlagValue zero{"--world-size", {"0"}};
  EXPECT_THROW(zero.positive_up_to(8), FlagError);
  EXPECT_EQ((FlagValue{"--world-size", {"8"}}.positive_up_to(8)), 8);
  EXPECT_THROW((FlagValue{"--dir", {""}}.non_empty_text()), FlagError);
  try {
    (void)FlagValue{"--top", {"0"}}.integer_in(1, 9);
    ADD_FAILURE() << "0 is outside [1, 9]";
  } catch (const FlagError& error) {
    EXPECT_STREQ(error.what(), "--top must be in [1, 9], got 0");
  }
}

TEST(FlagParser, HelpAnywhereStopsParsing) {
  Options parsed;
  EXPECT_TRUE(parse_flags(table(), {"--num-layers", "bad", "--help"}, parsed).help_requested);
  EXPECT_TRUE(parse_flags(table(), {"-h"}, parsed).help_requested);
  EXPECT_EQ(parsed.layers, 0);
}

TEST(FlagParser, HelpTextFromTheTable) {
  const std::string help = flags_help(table());
  EXPECT_NE(help.find("  --num-layers N"), std::string::npos);
  EXPECT_NE(help.find("  --cache, --no-cache"), std::string::npos);
  EXPECT_NE(help.find("keep a cache\n"), std::string::npos);
  EXPECT_EQ(help.find("  --num-layers N") + 48, help.find("layers\n"));  // help starts in column 48
  EXPECT_EQ(flag_names(table()), (std::vector<std::string>{"--num-layers", "--rate", "--fast", "--cache", "--no-cache",
                                                           "--ranks", "--mode"}));
}

TEST(FlagParser, PositionalsAndPassedOnTokens) {
  FlagParserOptions positionals;
  positionals.positionals = true;
  Options parsed;
  const ParsedFlags with_dir = parse_flags(table(), {"DIR", "--fast"}, parsed, positionals);
  EXPECT_EQ(with_dir.positional, std::vector<std::string>{"DIR"});
  FlagParserOptions pass;
  std::vector<std::string> passed_on;
  pass.pass_on = [&](const std::string& token) { passed_on.push_back(token); };
  parse_flags(table(), {"--lr", "0.1", "--fast", "--seq-length=8"}, parsed, pass);
  EXPECT_EQ(passed_on, (std::vector<std::string>{"--lr", "0.1", "--seq-length=8"}));
  EXPECT_TRUE(parsed.fast);
}

TEST(FlagParser, AbbreviationsOnlyWhenAllowed) {
  EXPECT_EQ(error_of({"--num-lay", "4"}), "unknown flag --num-lay");
  FlagParserOptions abbrev;
  abbrev.allow_abbrev = true;
  abbrev.megatron_names = {"--rate-limit"};
  abbrev.is_megatron_only = [](const std::string_view name) { return name == "--rate-limit"; };
  EXPECT_EQ(parse({"--num-lay", "4"}, abbrev).layers, 4);
  EXPECT_EQ(parse({"--num-lay=5"}, abbrev).layers, 5);
  EXPECT_EQ(error_of({"--rat", "1"}, abbrev), "ambiguous option --rat could match --rate, --rate-limit");
  EXPECT_EQ(error_of({"--rate-l", "1"}, abbrev), "--rate-limit is a Megatron flag that moecore does not implement yet");
  EXPECT_EQ(error_of({"--fa=1"}, abbrev), "--fast takes no value (got '--fa=1')");
}

}  // namespace
}  // namespace moecore
