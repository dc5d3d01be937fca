#include "moecore/train/moe_logging.h"

#include <algorithm>
#include <iomanip>
#include <numeric>
#include <sstream>

namespace moecore {
namespace {

std::string metric_name(const LoadBalancingType type) {
  switch (type) {
    case LoadBalancingType::kAuxLoss: return "load_balancing_loss";
    case LoadBalancingType::kSeqAuxLoss: return "seq_load_balancing_loss";
    case LoadBalancingType::kGlobalAuxLoss: return "global_load_balancing_loss";
    case LoadBalancingType::kSinkhorn:
    case LoadBalancingType::kNone: break;
  }
  return "";
}

}  // namespace

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
  for (size_t j = 0; j < config_.load_balancing_types.size(); ++j) {
    const std::string name = metric_name(config_.load_balancing_types[j]);
    if (name.empty() || config_.aux_loss_coeffs[j] == 0.0) continue;
    double sum = 0.0;
    for (const auto& per_layer : total_.load_balancing_losses) sum += per_layer[j];
    out.emplace_back(name, sum / (layers * forwards));
    if (config_.per_layer_logging) {
      for (size_t l = 0; l < total_.moe_layers.size(); ++l) {
        out.emplace_back("moe/" + name + "_layer_" + std::to_string(total_.moe_layers[l]),
                         total_.load_balancing_losses[l][j] / forwards);
      }
    }
  }
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
