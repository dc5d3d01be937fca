#include "moecore/config/memory_estimate.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

namespace moecore {

double data_index_bytes(const TrainingArgs& args) {
  const double gbs = static_cast<double>(args.global_batch_size);
  const double eval_points = args.eval_interval ? static_cast<double>(args.train_iters / *args.eval_interval + 1) : 1.0;
  const double samples =
      static_cast<double>(args.train_iters) * gbs + (eval_points + 1.0) * static_cast<double>(args.eval_iters) * gbs;
  // Per sample: the sample index (two int64), the shuffle index (int64) and about one document-index entry (int32).
  return samples * 28.0;
}

std::optional<double> available_memory_per_rank() {
  std::ifstream meminfo("/proc/meminfo");
  if (!meminfo) return std::nullopt;
  double available_kib = -1, swap_free_kib = 0;
  std::string line;
  while (std::getline(meminfo, line)) {
    std::istringstream fields(line);
    std::string key;
    double kib = 0;
    if (!(fields >> key >> kib)) continue;
    if (key == "MemAvailable:") available_kib = kib;
    if (key == "SwapFree:") swap_free_kib = kib;
  }
  if (available_kib < 0) return std::nullopt;
  double local_ranks = 1;
  if (const char* local_size = std::getenv("OMPI_COMM_WORLD_LOCAL_SIZE")) {
    local_ranks = std::max(1.0, std::atof(local_size));
  }
  return (available_kib + swap_free_kib) * 1024.0 / local_ranks;
}

std::string format_bytes(const double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  double value = bytes;
  size_t unit = 0;
  while (value >= 1024.0 && unit + 1 < std::size(units)) {
    value /= 1024.0;
    ++unit;
  }
  char text[48];
  std::snprintf(text, sizeof(text), value < 1e6 ? "%.1f %s" : "%.3g %s", value, units[unit]);
  return text;
}

void check_memory_fits(const MemoryEstimate& estimate, const double available) {
  if (estimate.total() <= available) return;
  throw ConfigError("this configuration needs about " + format_bytes(estimate.total()) + " per rank (parameters " +
                    format_bytes(estimate.parameters) + ", gradients " + format_bytes(estimate.gradients) +
                    ", optimizer " + format_bytes(estimate.optimizer) + ", activations " +
                    format_bytes(estimate.activations) + ", data indices " + format_bytes(estimate.data_indices) +
                    ") but " + format_bytes(available) +
                    " of memory is available to it: use a smaller model, batch or --train-iters, or more ranks");
}

}  // namespace moecore
