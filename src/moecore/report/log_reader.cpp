#include "moecore/report/log_reader.h"

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <optional>
#include <sstream>
#include <string_view>
#include <vector>

namespace moecore::report {

namespace {

std::string_view trim(std::string_view text) {
  while (!text.empty() && (text.front() == ' ' || text.front() == '\t')) text.remove_prefix(1);
  while (!text.empty() && (text.back() == ' ' || text.back() == '\t' || text.back() == '\r')) text.remove_suffix(1);
  return text;
}

// A number as Python prints it ("1.083297E+01", "nan", "-inf"); nullopt for anything else ("0:00:02").
std::optional<double> number(const std::string_view text) {
  const std::string copy(trim(text));
  if (copy.empty()) return std::nullopt;
  char* end = nullptr;
  errno = 0;
  const double value = std::strtod(copy.c_str(), &end);
  if (end != copy.c_str() + copy.size()) return std::nullopt;
  return value;
}

std::optional<int64_t> integer(const std::string_view text) {
  const std::optional<double> value = number(text);
  if (!value || !std::isfinite(*value) || *value != std::floor(*value)) return std::nullopt;
  return static_cast<int64_t>(*value);
}

// "a | b | c" -> its fields, trimmed, empty ones left out.
std::vector<std::string_view> fields(std::string_view text) {
  std::vector<std::string_view> out;
  while (!text.empty()) {
    const size_t bar = text.find('|');
    const std::string_view field = trim(text.substr(0, bar));
    if (!field.empty()) out.push_back(field);
    if (bar == std::string_view::npos) break;
    text.remove_prefix(bar + 1);
  }
  return out;
}

// Which chart and series an iteration-line field goes to (chart empty: not drawn).
std::pair<std::string, std::string> iteration_field_chart(const std::string& key) {
  if (key == "lm loss") return {"loss", "lm loss"};
  if (key.starts_with("mtp_") && key.ends_with(" loss")) return {"loss", key};
  if (key == "learning rate") return {"learning-rate", "learning rate"};
  if (key == "grad norm") return {"grad-norm", "grad norm"};
  if (key == "params norm") return {"params-norm", "params norm"};
  if (key == "num zeros") return {"num-zeros", "num zeros"};
  if (key == "loss scale") return {"loss-scale", "loss scale"};
  if (key == "throughput per GPU (TFLOP/s/GPU)") return {"throughput", "TFLOP/s per device"};
  if (key == "elapsed time per iteration (ms)") return {"iteration-time", "iteration time"};
  if (key == "number of skipped iterations" || key == "number of nan iterations") return {"skipped", key};
  if (key == "real tokens per iteration") return {"real-tokens", key};
  if (key.find("loss") != std::string::npos) return {"load-balancing", key};  // the MoE tracker's losses
  return {"", ""};  // consumed samples, global batch size, time left, ...
}

class LogParser {
 public:
  LogParser(RunReport& out) : out_(out) {}

  void line(const std::string_view text) {
    if (iteration_line(text) || validation_line(text) || expert_line(text) || alarm_line(text) || memory_line(text) ||
        comm_line(text)) {
      return;
    }
    throughput_line(text);
  }

 private:
  RunReport& out_;
  std::optional<int64_t> iteration_;  // of the last iteration line

  // " [2026-12-06 19:53:36.701150] iteration        1/      30 | consumed samples: 8 | ..."
  bool iteration_line(const std::string_view text) {
    const size_t at = text.find(" iteration ");
    if (at == std::string_view::npos || (at != 0 && text[at - 1] != ']')) return false;
    const size_t slash = text.find('/', at);
    const size_t bar = text.find('|', at);
    if (slash == std::string_view::npos || bar == std::string_view::npos || slash > bar) return false;
    const std::optional<int64_t> iteration = integer(text.substr(at + 11, slash - at - 11));
    if (!iteration || !integer(text.substr(slash + 1, bar - slash - 1))) return false;
    iteration_ = *iteration;
    const auto x = static_cast<double>(*iteration);
    for (const std::string_view field : fields(text.substr(bar + 1))) {
      const size_t colon = field.find(": ");
      if (colon == std::string_view::npos) continue;
      const std::string key(field.substr(0, colon));
      const std::optional<double> value = number(field.substr(colon + 2));
      const auto [chart, series] = iteration_field_chart(key);
      if (value && !chart.empty()) out_.add_point(chart, series, x, *value);
    }
    return true;
  }

  // " validation loss at iteration 10 | lm loss value: 7.489700E+00 | lm loss PPL: ... |"; after training
  // "... at iteration 30 on validation set |" and "... on test set |" go to the summary.
  bool validation_line(const std::string_view text) {
    constexpr std::string_view kMarker = "validation loss at iteration ";
    const size_t at = text.find(kMarker);
    if (at == std::string_view::npos) return false;
    const size_t bar = text.find('|', at);
    if (bar == std::string_view::npos) return false;
    const std::string_view where = trim(text.substr(at + kMarker.size(), bar - at - kMarker.size()));
    const size_t space = where.find(' ');
    const std::optional<int64_t> iteration = integer(where.substr(0, space));
    if (!iteration) return false;
    const std::string_view after = space == std::string_view::npos ? "" : trim(where.substr(space));
    for (const std::string_view field : fields(text.substr(bar + 1))) {
      const size_t colon = field.find(" value: ");
      if (colon == std::string_view::npos) continue;
      const std::string key(field.substr(0, colon));
      const std::optional<double> value = number(field.substr(colon + 8));
      if (!value) continue;
      if (after.empty()) {
        out_.add_point("loss", key + " validation", static_cast<double>(*iteration), *value);
      } else {  // "on validation set" / "on test set"
        std::ostringstream shown;
        shown << *value;
        // "on validation set" -> "validation"
        std::string set(after.starts_with("on ") ? after.substr(3) : after);
        if (set.ends_with(" set")) set.resize(set.size() - 4);
        out_.add_summary(key == "lm loss" ? "final " + set + " loss" : key + " (" + set + ", after training)",
                         shown.str());
      }
    }
    return true;
  }

  // " [MoE] layer 0 tokens per expert: [796 428 ...] | min/max load ratio: 0.264 / 1.555 |"
  bool expert_line(const std::string_view text) {
    constexpr std::string_view kMarker = "[MoE] layer ";
    const size_t at = text.find(kMarker);
    const size_t open = text.find(" tokens per expert: [");
    if (at == std::string_view::npos || open == std::string_view::npos || !iteration_) return false;
    const std::optional<int64_t> layer = integer(text.substr(at + kMarker.size(), open - at - kMarker.size()));
    const size_t close = text.find(']', open);
    if (!layer || close == std::string_view::npos) return false;
    std::vector<int64_t> tokens;
    std::istringstream counts(std::string(text.substr(open + 21, close - open - 21)));
    for (std::string count; counts >> count;) {
      const std::optional<int64_t> value = integer(count);
      if (!value) return false;
      tokens.push_back(*value);
    }
    const std::string id = "moe-layer-" + std::to_string(*layer);
    ExpertLoad& load = out_.expert_load(id, "MoE layer " + std::to_string(*layer) + ": tokens per expert");
    load.iterations.push_back(*iteration_);
    load.tokens.push_back(std::move(tokens));
    const size_t ratio = text.find("min/max load ratio: ", close);
    if (ratio != std::string_view::npos) {
      const std::string_view both = text.substr(ratio + 20);
      const size_t slash = both.find(" / ");
      const std::optional<double> low = number(both.substr(0, slash));
      const std::optional<double> high =
          slash == std::string_view::npos ? std::nullopt : number(both.substr(slash + 3, both.find('|') - slash - 3));
      if (load.under.empty()) load.under = {{"min load ratio", {}}, {"max load ratio", {}}};
      load.under[0].points.emplace_back(*iteration_, low.value_or(std::nan("")));
      load.under[1].points.emplace_back(*iteration_, high.value_or(std::nan("")));
    }
    return true;
  }

  // "WARNING: [MoE] layer 3: expert 7 (load ratio 0.000) has had under ..." / "experts 2 (load ratio ...), 5 (...)"
  bool alarm_line(const std::string_view text) {
    constexpr std::string_view kMarker = "WARNING: [MoE] layer ";
    const size_t at = text.find(kMarker);
    if (at == std::string_view::npos) return false;
    const std::string_view rest = text.substr(at + kMarker.size());
    const size_t colon = rest.find(':');
    const std::optional<int64_t> layer = integer(rest.substr(0, colon));
    const int64_t iteration = iteration_.value_or(0);
    out_.add_alarm(iteration, std::string(trim(text.substr(at))));
    if (!layer) return true;
    ExpertLoad& load = out_.expert_load("moe-layer-" + std::to_string(*layer),
                                        "MoE layer " + std::to_string(*layer) + ": tokens per expert");
    // Each named expert is a number followed by " (load ratio".
    std::string_view scan = rest.substr(colon + 1);
    for (size_t mark = scan.find(" (load ratio"); mark != std::string_view::npos; mark = scan.find(" (load ratio")) {
      size_t begin = mark;
      while (begin > 0 && scan[begin - 1] >= '0' && scan[begin - 1] <= '9') --begin;
      if (const std::optional<int64_t> expert = integer(scan.substr(begin, mark - begin))) {
        load.alarms.emplace_back(iteration, *expert);
      }
      scan.remove_prefix(mark + 12);
    }
    return true;
  }

  // "[Rank 0] (after 5 iterations) memory (MB) | params: 56.6 (peak 56.6) | ... | total peak: 344.6"
  bool memory_line(const std::string_view text) {
    constexpr std::string_view kMarker = "(after ";
    const size_t at = text.find(kMarker);
    const size_t memory = text.find(" iterations) memory (MB)");
    if (at == std::string_view::npos || memory == std::string_view::npos) return false;
    const std::optional<int64_t> iteration = integer(text.substr(at + kMarker.size(), memory - at - kMarker.size()));
    if (!iteration) return false;
    const auto x = static_cast<double>(*iteration);
    for (const std::string_view field : fields(text.substr(text.find('|', memory) + 1))) {
      const size_t colon = field.find(": ");
      if (colon == std::string_view::npos) continue;
      const std::string key(field.substr(0, colon));
      const std::string_view value = field.substr(colon + 2);
      const size_t peak = value.find(" (peak ");
      if (const std::optional<double> current = number(value.substr(0, peak)))
        out_.add_point("memory", key, x, *current);
      if (peak != std::string_view::npos) {
        if (const std::optional<double> high = number(value.substr(peak + 7, value.find(')', peak) - peak - 7))) {
          out_.add_point("memory", key + " peak", x, *high);
        }
      }
    }
    return true;
  }

  // " [comm] per iteration, max over ranks (ms / share of step [/ MB sent]): tp 1.2 / 3.4% / 5.6 MB | ep 0.5 / ..."
  bool comm_line(const std::string_view text) {
    const size_t at = text.find("[comm] per iteration");
    if (at == std::string_view::npos || !iteration_) return false;
    const size_t start = text.find("): ", at);
    if (start == std::string_view::npos) return true;
    for (const std::string_view field : fields(text.substr(start + 3))) {
      const size_t slash = field.find(" / ");
      const size_t space = field.substr(0, slash).rfind(' ');
      if (slash == std::string_view::npos || space == std::string_view::npos) continue;
      if (const std::optional<double> ms = number(field.substr(space + 1, slash - space - 1))) {
        out_.add_point("comm", std::string(field.substr(0, space)), static_cast<double>(*iteration_), *ms);
      }
    }
    return true;
  }

  // "> training throughput: 4812.8 tokens/s over 30 iterations"
  void throughput_line(const std::string_view text) {
    constexpr std::string_view kMarker = "> training throughput: ";
    if (!text.starts_with(kMarker)) return;
    const std::string_view rest = text.substr(kMarker.size());
    out_.add_summary("training throughput", std::string(trim(rest.substr(0, rest.find(" over ")))));
  }
};

}  // namespace

void read_training_log(std::istream& log, const std::string& name, RunReport& out) {
  out.add_source(name);
  LogParser parser(out);
  for (std::string line; std::getline(log, line);) parser.line(line);
}

}  // namespace moecore::report
