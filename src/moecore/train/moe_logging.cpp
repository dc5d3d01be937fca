#include "moecore/train/moe_logging.h"

#include <algorithm>
#include <iomanip>
#include <numeric>
#include <sstream>

namespace moecore {
namespace {

// Value of balancing type `type` in one layer's per-type values: what the router recorded for the first listed
// occurrence of the type with a non-zero coefficient, else 0 (Megatron's router records nothing for a type whose
// coefficient is 0, and the metrics tracker's force_initialize entry stays at 0).
double layer_value(const MoEConfig& config, const std::vector<double>& per_type, const LoadBalancingType type) {
  for (size_t j = 0; j < config.load_balancing_types.size() && j < per_type.size(); ++j) {
    if (config.load_balancing_types[j] == type) return config.aux_loss_coeffs[j] == 0.0 ? 0.0 : per_type[j];
  }
  return 0.0;
}

}  // namespace

std::vector<std::pair<std::string, LoadBalancingType>> tracked_balancing_losses(const MoEConfig& config) {
  // Megatron's training_log: `if "aux_loss" in args.moe_router_load_balancing_type`, etc. A single type is a string
  // there (arguments.py unwraps a one-element list), so the test is a substring test and "seq_aux_loss" or
  // "global_aux_loss" alone also track "load_balancing_loss"; several types are a list, tested by membership.
  const auto& types = config.load_balancing_types;
  const auto tracks = [&](const LoadBalancingType type) {
    if (types.size() == 1) return to_string(types[0]).find(to_string(type)) != std::string::npos;
    return std::find(types.begin(), types.end(), type) != types.end();
  };
  std::vector<std::pair<std::string, LoadBalancingType>> out;
  if (tracks(LoadBalancingType::kAuxLoss)) out.emplace_back("load_balancing_loss", LoadBalancingType::kAuxLoss);
  if (tracks(LoadBalancingType::kSeqAuxLoss)) {
    out.emplace_back("seq_load_balancing_loss", LoadBalancingType::kSeqAuxLoss);
  }
  if (tracks(LoadBalancingType::kGlobalAuxLoss)) {
    out.emplace_back("global_load_balancing_loss", LoadBalancingType::kGlobalAuxLoss);
  }
  return out;
}

void MoEMetrics::add(const MoEStats& stats) {
  if (stats.num_forwards == 0) return;
  if (total_.num_forwards == 0) {
    total_ = stats;
    return;
  }
  total_.num_forwards += stats.num_forwards;
  for (size_t l = 0; l < stats.moe_layers.size() && l < total_.moe_layers.size(); ++l) {
    for (size_t j = 0; j < stats.load_balancing_losses[l].size(); ++j) {
      total_.load_balancing_losses[l][j] += stats.load_balancing_losses[l][j];
    }
    total_.z_losses[l] += stats.z_losses[l];
    for (size_t e = 0; e < stats.tokens_per_expert[l].size(); ++e) {
      total_.tokens_per_expert[l][e] += stats.tokens_per_expert[l][e];
    }
  }
}

NamedValues MoEMetrics::losses() const {
  NamedValues out;
  if (empty()) return out;
  const auto layers = static_cast<double>(total_.moe_layers.size());
  const auto forwards = static_cast<double>(total_.num_forwards);
  for (const auto& [name, type] : tracked_balancing_losses(config_)) {
    double sum = 0.0;
    for (const auto& per_layer : total_.load_balancing_losses) sum += layer_value(config_, per_layer, type);
    out.emplace_back(name, sum / (layers * forwards));
    if (config_.per_layer_logging) {
      for (size_t l = 0; l < total_.moe_layers.size(); ++l) {
        out.emplace_back("moe/" + name + "_layer_" + std::to_string(total_.moe_layers[l]),
                         layer_value(config_, total_.load_balancing_losses[l], type) / forwards);
      }
    }
  }
  // Megatron tracks z_loss when --moe-z-loss-coeff is given; a coefficient of 0 logs 0/0 = NaN, which training_log
  // does not print, so the line shows z_loss exactly when the coefficient is non-zero.
  if (config_.z_loss_coeff != 0.0) {
    out.emplace_back("z_loss",
                     std::accumulate(total_.z_losses.begin(), total_.z_losses.end(), 0.0) / (layers * forwards));
    if (config_.per_layer_logging) {
      for (size_t l = 0; l < total_.moe_layers.size(); ++l) {
        out.emplace_back("moe/z_loss_layer_" + std::to_string(total_.moe_layers[l]), total_.z_losses[l] / forwards);
      }
    }
  }
  return out;
}

std::vector<std::string> MoEMetrics::usage_lines() const {
  std::vector<std::string> lines;
  for (size_t l = 0; l < total_.moe_layers.size(); ++l) {
    const std::vector<int64_t>& counts = total_.tokens_per_expert[l];
    if (counts.empty()) continue;
    const double mean = static_cast<double>(std::accumulate(counts.begin(), counts.end(), int64_t{0})) /
                        static_cast<double>(counts.size());
    const auto [min_it, max_it] = std::minmax_element(counts.begin(), counts.end());
    std::ostringstream line;
    line << " [MoE] layer " << total_.moe_layers[l] << " tokens per expert: [";
    for (size_t e = 0; e < counts.size(); ++e) line << (e ? " " : "") << counts[e];
    line << std::fixed << std::setprecision(3)
         << "] | min/max load ratio: " << (mean > 0 ? static_cast<double>(*min_it) / mean : 0.0) << " / "
         << (mean > 0 ? static_cast<double>(*max_it) / mean : 0.0) << " |";
    lines.push_back(line.str());
  }
  return lines;
}

}  // namespace moecore
