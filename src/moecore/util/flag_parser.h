// The command-line parser every `moecore` command uses: a table of flag specs for a target type, parsed as
// Megatron's argparse parsers do (allow_abbrev=False).
//
// Syntax: `--flag value` or `--flag=value`; a switch (store_true) takes no value, and answers to its `--no-` form
// when its spec names one (argparse's BooleanOptionalAction / a store_false partner); a list flag (nargs='+') takes
// every following token up to the next flag; a flag given twice: last wins. A token that starts with '-' is a flag
// unless it is a number or a '-' is followed by a digit or '.' (argparse's negative-number rule: "-3", "-1,1,1" are
// values), so a string value that starts with '-' must be written `--flag=value`.
//
// Errors (one line each, thrown as FlagError; every command words them the same):
//   unknown flag           "unknown flag --num-layer (did you mean --num-layers?)"
//   Megatron flag not built "--moe-permute-fusion is a Megatron flag that moecore does not implement yet"
//   ambiguous prefix       "ambiguous option --w could match --workers, --workers-to-check" (allow_abbrev only)
//   stray token            "unexpected argument 'x' (flags start with --; a value belongs after its flag)"
//   switch given a value   "--swiglu takes no value (got '--swiglu=1')"
//   missing value          "--num-layers expects a value (N)" / "--data-path expects at least one value (PATH...)"
//   bad value              "invalid value 'abc' for --num-layers: expected an integer" (FlagValue's helpers)
#pragma once

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <set>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace moecore {

// A command-line problem (one line). Commands may rethrow it as their own error type.
class FlagError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// The values given to one flag occurrence, and the checks that turn them into typed values.
struct FlagValue {
  std::string_view flag;            // the flag's table name (the positive name for a `--no-` form)
  std::vector<std::string> values;  // empty for a switch
  bool negated = false;             // the switch was given as its `--no-` form

  const std::string& text() const { return values.front(); }

  [[noreturn]] void fail(const std::string& expected) const;

  int64_t integer() const;            // a decimal integer, optional leading '+'
  uint64_t unsigned_integer() const;  // a decimal integer in [0, 2^64) (seeds)
  double real() const;                // a finite number

  // Upper limits: a value beyond what a user could mean is an error naming the flag, the limit and why.
  int64_t integer_up_to(int64_t max, std::string_view why = {}) const;
  double real_up_to(double max, std::string_view why = {}) const;
  [[noreturn]] void too_large(const std::string& limit, std::string_view why) const;

  // An integer in [1, max]: "--flag must be positive (got 0)" below, the limit error above.
  int64_t positive_up_to(int64_t max) const;
  // An integer in [min, max]: "--flag must be in [min, max], got X" outside.
  int64_t integer_in(int64_t min, int64_t max) const;

  const std::string& non_empty_text() const;

  // `implemented` are accepted; `megatron_only` are Megatron's other choices, reported as not implemented yet.
  const std::string& choice(std::initializer_list<std::string_view> implemented,
                            std::initializer_list<std::string_view> megatron_only = {}) const;

  // Every value of a list flag, each parsed by `parse` and named in its own error.
  template <typename Parse>
  auto each(Parse parse) const {
    std::vector<decltype(parse(FlagValue{flag, {values.front()}}))> parsed;
    for (const std::string& value : values) parsed.push_back(parse(FlagValue{flag, {value}}));
    return parsed;
  }
};

enum class Arity { kSwitch, kOne, kList };

// One row of a command's flag table.
template <typename Target>
struct FlagSpec {
  std::string_view name;     // "--num-layers"
  Arity arity;               // switch, one value, or a list of one or more
  std::string_view metavar;  // "N", "{a,b}", "PATH..." (help and "expects a value (N)")
  std::string_view help;
  void (*apply)(Target&, const FlagValue&);
  std::string_view negation = {};  // a switch's "--no-..." form; apply then sees FlagValue::negated
};

// How a command treats what is not in its table.
struct FlagParserOptions {
  // Names a Megatron flag the command does not implement: "... is a Megatron flag that moecore does not implement
  // yet" instead of "unknown flag"; these names are did-you-mean candidates too.
  std::function<bool(std::string_view)> is_megatron_only;
  // Names a Megatron flag the command refuses for a reason of its own: the whole one-line error, or "" for others.
  // Checked before is_megatron_only; list such flags in megatron_names too.
  std::function<std::string(std::string_view)> refusal;
  std::vector<std::string> megatron_names;  // did-you-mean candidates besides the table
  // When set, tokens that are no flag of the table (unknown flags, their values, stray tokens) are handed to it in
  // order instead of refused: a command that passes them on to another parser, as `moecore plan` to train's.
  std::function<void(const std::string& token)> pass_on;
  // Tokens that are no flag are handed back as positional arguments instead of refused.
  bool positionals = false;
  // argparse's allow_abbrev (the default of plain argparse parsers, such as tools/preprocess_data.py's; Megatron's
  // training parser turns it off): a unique prefix of a flag (among the table and megatron_names) names it;
  // "ambiguous option --w could match --workers, --workers-to-check" when several flags start with it.
  bool allow_abbrev = false;
};

struct ParsedFlags {
  bool help_requested = false;          // --help / -h anywhere: nothing else was parsed
  std::set<std::string> given;          // table names of the flags that appeared (a `--no-` form under its own)
  std::vector<std::string> positional;  // positionals: the non-flag tokens, in order
};

// argparse's rule: whether a command-line token is a flag (not a value such as -3 or -1,1,1).
bool looks_like_flag(std::string_view token);

// The type-erased table the parser walks (FlagSpec rows without their apply).
struct FlagRow {
  std::string_view name;
  Arity arity;
  std::string_view metavar;
  std::string_view help;
  std::string_view negation;
};

namespace detail {
ParsedFlags parse_flag_rows(const std::vector<FlagRow>& rows, const std::vector<std::string>& args,
                            const FlagParserOptions& options,
                            const std::function<void(size_t row, const FlagValue& value)>& apply);
std::string flag_rows_help(const std::vector<FlagRow>& rows);

template <typename Target>
std::vector<FlagRow> rows_of(const std::vector<FlagSpec<Target>>& table) {
  std::vector<FlagRow> rows;
  rows.reserve(table.size());
  for (const FlagSpec<Target>& spec : table) {
    rows.push_back({spec.name, spec.arity, spec.metavar, spec.help, spec.negation});
  }
  return rows;
}
}  // namespace detail

// Parses `args` (after the command name) into `target` through `table`. Throws FlagError (one line); an apply
// function may throw its own errors, which pass through.
template <typename Target>
ParsedFlags parse_flags(const std::vector<FlagSpec<Target>>& table, const std::vector<std::string>& args,
                        Target& target, const FlagParserOptions& options = {}) {
  return detail::parse_flag_rows(detail::rows_of(table), args, options,
                                 [&](const size_t row, const FlagValue& value) { table[row].apply(target, value); });
}

// One line per flag: "  --name METAVAR" padded to 48 columns, then its help ("--name, --no-name" for a switch with
// a `--no-` form).
template <typename Target>
std::string flags_help(const std::vector<FlagSpec<Target>>& table) {
  return detail::flag_rows_help(detail::rows_of(table));
}

// Every flag name of the table (with "--"; `--no-` forms after their flag), in table order.
template <typename Target>
std::vector<std::string> flag_names(const std::vector<FlagSpec<Target>>& table) {
  std::vector<std::string> names;
  for (const FlagSpec<Target>& spec : table) {
    names.emplace_back(spec.name);
    if (!spec.negation.empty()) names.emplace_back(spec.negation);
  }
  return names;
}

}  // namespace moecore
