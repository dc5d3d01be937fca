#include "moecore/util/flag_parser.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <optional>

#include "moecore/util/flag_suggest.h"

namespace moecore {

void FlagValue::fail(const std::string& expected) const {
  throw FlagError("invalid value '" + text() + "' for " + std::string(flag) + ": expected " + expected);
}

int64_t FlagValue::integer() const {
  std::string_view digits = text();
  if (!digits.empty() && digits.front() == '+') digits.remove_prefix(1);
  int64_t value = 0;
  const auto [end, error] = std::from_chars(digits.data(), digits.data() + digits.size(), value);
  if (digits.empty() || error != std::errc() || end != digits.data() + digits.size()) fail("an integer");
  return value;
}

uint64_t FlagValue::unsigned_integer() const {
  std::string_view digits = text();
  if (!digits.empty() && digits.front() == '+') digits.remove_prefix(1);
  uint64_t value = 0;
  const auto [end, error] = std::from_chars(digits.data(), digits.data() + digits.size(), value);
  if (digits.empty() || error != std::errc() || end != digits.data() + digits.size()) fail("a non-negative integer");
  return value;
}

double FlagValue::real() const {
  std::string_view digits = text();
  if (!digits.empty() && digits.front() == '+') digits.remove_prefix(1);
  double value = 0.0;
  const auto [end, error] = std::from_chars(digits.data(), digits.data() + digits.size(), value);
  if (digits.empty() || error != std::errc() || end != digits.data() + digits.size() || !std::isfinite(value)) {
    fail("a finite number");
  }
  return value;
}

int64_t FlagValue::integer_up_to(const int64_t max, const std::string_view why) const {
  const int64_t value = integer();
  if (value > max) too_large(std::to_string(max), why);
  return value;
}

double FlagValue::real_up_to(const double max, const std::string_view why) const {
  const double value = real();
  if (value > max) {
    char limit[32];
    std::snprintf(limit, sizeof(limit), "%g", max);
    too_large(limit, why);
  }
  return value;
}

void FlagValue::too_large(const std::string& limit, const std::string_view why) const {
  throw FlagError(std::string(flag) + " " + text() + " is above the limit of " + limit +
                  (why.empty() ? "" : " (" + std::string(why) + ")"));
}

int64_t FlagValue::positive_up_to(const int64_t max) const {
  const int64_t value = integer_up_to(max);
  if (value < 1) throw FlagError(std::string(flag) + " must be positive (got " + text() + ")");
  return value;
}

int64_t FlagValue::integer_in(const int64_t min, const int64_t max) const {
  const int64_t value = integer();
  if (value < min || value > max) {
    throw FlagError(std::string(flag) + " must be in [" + std::to_string(min) + ", " + std::to_string(max) + "], got " +
                    text());
  }
  return value;
}

const std::string& FlagValue::non_empty_text() const {
  if (text().empty()) fail("a non-empty value");
  return text();
}

const std::string& FlagValue::choice(std::initializer_list<std::string_view> implemented,
                                     std::initializer_list<std::string_view> megatron_only) const {
  const auto join = [](std::initializer_list<std::string_view> names) {
    std::string joined;
    for (const std::string_view name : names) joined += (joined.empty() ? "" : ", ") + std::string(name);
    return joined;
  };
  if (std::find(implemented.begin(), implemented.end(), text()) != implemented.end()) return text();
  if (std::find(megatron_only.begin(), megatron_only.end(), text()) != megatron_only.end()) {
    throw FlagError(std::string(flag) + " " + text() + " is not implemented yet (moecore implements " +
                    join(implemented) + ")");
  }
  std::string all = join(implemented);
  if (megatron_only.size() > 0) all += ", " + join(megatron_only);
  throw FlagError("invalid value '" + text() + "' for " + std::string(flag) + " (choose from " + all + ")");
}

// No flag starts with "-" and a digit or '.', so such a token ("-1,1,1") is a value, which the flag's own check
// then judges.
bool looks_like_flag(const std::string_view token) {
  if (token.size() < 2 || token.front() != '-') return false;
  if (token[1] == '.' || (token[1] >= '0' && token[1] <= '9')) return false;
  double number = 0.0;
  const auto [end, error] = std::from_chars(token.data(), token.data() + token.size(), number);
  return !(error == std::errc() && end == token.data() + token.size());
}

namespace detail {
namespace {

struct Match {
  size_t row;
  bool negated;
};

std::optional<Match> find_row(const std::vector<FlagRow>& rows, const std::string_view name) {
  for (size_t i = 0; i < rows.size(); ++i) {
    if (rows[i].name == name) return Match{i, false};
    if (!rows[i].negation.empty() && rows[i].negation == name) return Match{i, true};
  }
  return std::nullopt;
}

// allow_abbrev: the one flag (table row or Megatron-only name) that starts with `name`, "" when none does.
std::string expand_prefix(const std::vector<FlagRow>& rows, const std::string& name, const FlagParserOptions& options) {
  std::vector<std::string> matches;
  const auto consider = [&](const std::string_view flag) {
    if (name.size() > 2 && flag.starts_with(name)) matches.emplace_back(flag);
  };
  for (const FlagRow& row : rows) {
    consider(row.name);
    if (!row.negation.empty()) consider(row.negation);
  }
  for (const std::string& flag : options.megatron_names) consider(flag);
  if (matches.size() > 1) {
    std::string message = "ambiguous option " + name + " could match";
    for (size_t i = 0; i < matches.size(); ++i) message += (i ? ", " : " ") + matches[i];
    throw FlagError(message);
  }
  return matches.empty() ? std::string() : matches.front();
}

[[noreturn]] void throw_unknown(const std::vector<FlagRow>& rows, const std::string& name,
                                const FlagParserOptions& options) {
  if (options.refusal) {
    if (std::string reason = options.refusal(name); !reason.empty()) throw FlagError(reason);
  }
  if (options.is_megatron_only && options.is_megatron_only(name)) {
    throw FlagError(name + " is a Megatron flag that moecore does not implement yet");
  }
  std::vector<std::string> candidates;
  for (const FlagRow& row : rows) {
    candidates.emplace_back(row.name);
    if (!row.negation.empty()) candidates.emplace_back(row.negation);
  }
  candidates.insert(candidates.end(), options.megatron_names.begin(), options.megatron_names.end());
  throw FlagError(unknown_flag_message(name, candidates));
}

}  // namespace

ParsedFlags parse_flag_rows(const std::vector<FlagRow>& rows, const std::vector<std::string>& args,
                            const FlagParserOptions& options,
                            const std::function<void(size_t row, const FlagValue& value)>& apply) {
  ParsedFlags parsed;
  for (const std::string& token : args) {
    if (token == "--help" || token == "-h") {
      parsed.help_requested = true;
      return parsed;
    }
  }

  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& token = args[i];
    if (!looks_like_flag(token)) {
      if (options.positionals) {
        parsed.positional.push_back(token);
        continue;
      }
      if (options.pass_on) {
        options.pass_on(token);
        continue;
      }
      throw FlagError("unexpected argument '" + token + "' (flags start with --; a value belongs after its flag)");
    }
    const size_t equals = token.find('=');
    std::string name = token.substr(0, equals);
    std::optional<Match> match = find_row(rows, name);
    if (!match && options.allow_abbrev) {
      if (std::string full = expand_prefix(rows, name, options); !full.empty()) {
        name = std::move(full);
        match = find_row(rows, name);
      }
    }
    if (!match) {
      if (options.pass_on) {
        options.pass_on(token);
        continue;
      }
      throw_unknown(rows, name, options);
    }

    const FlagRow& row = rows[match->row];
    FlagValue value{row.name, {}, match->negated};
    if (equals != std::string::npos) {
      if (row.arity == Arity::kSwitch || match->negated) {
        throw FlagError(name + " takes no value (got '" + token + "')");
      }
      value.values.push_back(token.substr(equals + 1));
    } else if (row.arity == Arity::kOne) {
      if (i + 1 >= args.size() || looks_like_flag(args[i + 1])) {
        throw FlagError(name + " expects a value (" + std::string(row.metavar) + ")");
      }
      value.values.push_back(args[++i]);
    } else if (row.arity == Arity::kList) {
      while (i + 1 < args.size() && !looks_like_flag(args[i + 1])) value.values.push_back(args[++i]);
      if (value.values.empty()) {
        throw FlagError(name + " expects at least one value (" + std::string(row.metavar) + ")");
      }
    }
    parsed.given.insert(name);
    apply(match->row, value);
  }
  return parsed;
}

std::string flag_rows_help(const std::vector<FlagRow>& rows) {
  std::string help;
  for (const FlagRow& row : rows) {
    std::string usage(2, ' ');
    usage.append(row.name);
    if (!row.negation.empty()) usage.append(", ").append(row.negation);
    if (!row.metavar.empty()) usage.append(1, ' ').append(row.metavar);
    usage.resize(std::max<size_t>(usage.size() + 2, 48), ' ');
    help.append(usage).append(row.help).append(1, '\n');
  }
  return help;
}

}  // namespace detail
}  // namespace moecore
