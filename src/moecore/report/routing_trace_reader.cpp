#include "moecore/report/routing_trace_reader.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <tuple>
#include <vector>

#include "moecore/util/json_error.h"

namespace moecore::report {

namespace {

std::vector<std::string> trace_files(const std::string& dir) {
  std::vector<std::string> files;
  std::error_code error;
  for (const auto& entry : std::filesystem::directory_iterator(dir, error)) {
    const std::string name = entry.path().filename().string();
    if (entry.is_regular_file() && name.starts_with("router_trace_rank") && name.ends_with(".jsonl")) {
      files.push_back(entry.path().string());
    }
  }
  std::sort(files.begin(), files.end());
  return files;
}

// A router's records: (block, mtp_idx or -1, layer).
using RouterKey = std::tuple<std::string, int64_t, int64_t>;

}  // namespace

bool is_routing_trace_dir(const std::string& dir) { return !trace_files(dir).empty(); }

void read_routing_trace_dir(const std::string& dir, RunReport& out) {
  const std::vector<std::string> files = trace_files(dir);
  if (files.empty()) throw std::runtime_error(dir + " holds no routing trace (router_trace_rank<r>.jsonl)");
  read_routing_trace_files(files, out);
}

void read_routing_trace_files(const std::vector<std::string>& files, RunReport& out) {
  std::map<RouterKey, std::map<int64_t, std::vector<int64_t>>> counts;  // router -> step -> tokens per expert
  int64_t experts = 0;
  for (const std::string& file : files) {
    out.add_source(file);
    std::ifstream in(file);
    if (!in) throw std::runtime_error("cannot read " + file);
    int64_t line_number = 0;
    for (std::string line; std::getline(in, line);) {
      ++line_number;
      if (line.empty()) continue;
      const auto bad = [&](const std::string& what) {
        return std::runtime_error(file + ":" + std::to_string(line_number) + ": not a routing trace record (" + what +
                                  ")");
      };
      try {
        const nlohmann::json record = nlohmann::json::parse(line);
        const RouterKey key{record.at("block").get<std::string>(), record.value("mtp_idx", int64_t{-1}),
                            record.at("layer").get<int64_t>()};
        const auto step = record.at("step").get<int64_t>();
        std::vector<int64_t>& column = counts[key][step];
        const nlohmann::json& tokens = record.at("top_indices");
        if (!tokens.is_array() || static_cast<int64_t>(tokens.size()) != record.at("num_tokens").get<int64_t>()) {
          throw bad("top_indices does not hold num_tokens rows");
        }
        for (const nlohmann::json& token : tokens) {
          for (const nlohmann::json& expert_json : token) {
            const auto expert = expert_json.get<int64_t>();
            if (expert < 0 || expert > (int64_t{1} << 20)) throw bad("expert index " + std::to_string(expert));
            if (expert >= static_cast<int64_t>(column.size())) column.resize(static_cast<size_t>(expert) + 1, 0);
            ++column[static_cast<size_t>(expert)];
            experts = std::max(experts, expert + 1);
          }
        }
      } catch (const nlohmann::json::exception& e) {
        throw bad(json_error_text(e));
      }
    }
  }
  for (auto& [key, steps] : counts) {
    const auto& [block, mtp_idx, layer] = key;
    const std::string name = block == "mtp" ? "MTP depth " + std::to_string(mtp_idx) : "layer " + std::to_string(layer);
    const std::string id =
        block == "mtp" ? "trace-mtp-" + std::to_string(mtp_idx) : "trace-layer-" + std::to_string(layer);
    ExpertLoad& load = out.expert_load(id, "routing trace, " + name + ": tokens per expert (all ranks)");
    load.under = {{"min load ratio", {}}, {"max load ratio", {}}};
    for (auto& [step, column] : steps) {
      column.resize(static_cast<size_t>(experts), 0);
      load.iterations.push_back(step + 1);
      load.tokens.push_back(column);
      // Each expert's tokens over the mean per expert, as the log's "min/max load ratio".
      int64_t total = 0;
      for (const int64_t tokens : column) total += tokens;
      const double mean = static_cast<double>(total) / static_cast<double>(experts);
      const auto [low, high] = std::minmax_element(column.begin(), column.end());
      const auto x = static_cast<double>(step + 1);
      load.under[0].points.emplace_back(x, total > 0 ? static_cast<double>(*low) / mean : 0.0);
      load.under[1].points.emplace_back(x, total > 0 ? static_cast<double>(*high) / mean : 0.0);
    }
  }
}

}  // namespace moecore::report
