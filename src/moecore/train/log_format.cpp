#include "moecore/train/log_format.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <ctime>

#include "moecore/config/flops.h"

namespace moecore {
namespace {

// Python's "{:.Nf}": non-finite values as "nan", "inf", "-inf".
std::string fixed(const double value, const int precision) {
  if (std::isnan(value)) return "nan";
  if (std::isinf(value)) return value > 0 ? "inf" : "-inf";
  char buffer[512];
  std::snprintf(buffer, sizeof(buffer), "%.*f", precision, value);
  return buffer;
}

// Python's "{:.6E}": non-finite values as "NAN", "INF", "-INF".
std::string scientific(const double value) {
  if (std::isnan(value)) return "NAN";
  if (std::isinf(value)) return value > 0 ? "INF" : "-INF";
  char buffer[64];
  std::snprintf(buffer, sizeof(buffer), "%.6E", value);
  return buffer;
}

// Python's "{:Nd}".
std::string padded(const int64_t value, const int width) {
  char buffer[64];
  std::snprintf(buffer, sizeof(buffer), "%*lld", width, static_cast<long long>(value));
  return buffer;
}

}  // namespace

std::string format_iteration_log(const IterationLog& log) {
  std::string line;
  if (!log.timestamp.empty()) line += " [" + log.timestamp + "]";
  line += " iteration " + padded(log.iteration, 8) + "/" + padded(log.train_iters, 8) + " |";
  line += " consumed samples: " + padded(log.consumed_samples, 12) + " |";
  if (log.skipped_samples > 0) line += " skipped samples: " + padded(log.skipped_samples, 12) + " |";
  line += " elapsed time per iteration (ms): " + fixed(log.elapsed_ms_per_iteration, 1) + " |";
  if (log.throughput_tflops_per_gpu) {
    // Megatron prints one decimal; below 1 TFLOP/s (CPUs) three keep the figure readable.
    const double tflops = *log.throughput_tflops_per_gpu;
    line += " throughput per GPU (TFLOP/s/GPU): " + fixed(tflops, std::abs(tflops) < 1.0 ? 3 : 1) + " |";
  }
  if (log.learning_rate) line += " learning rate: " + scientific(*log.learning_rate) + " |";
  line += " global batch size: " + padded(log.global_batch_size, 5) + " |";
  if (log.real_tokens_per_iteration) {
    line += " real tokens per iteration: " + std::to_string(*log.real_tokens_per_iteration) + " |";
  }
  if (log.packed_bins_per_iteration) {
    line += " bins per iteration: " + std::to_string(*log.packed_bins_per_iteration) + " (+" +
            std::to_string(log.padding_bins_per_iteration.value_or(0)) + " padding) |";
    line += " padding tokens per iteration: " + std::to_string(log.padding_tokens_per_iteration.value_or(0)) + " |";
  }
  for (const auto& [name, value] : log.losses) {
    // Megatron's training_log prints an averaged loss only `if avg >= 0.0`: NaN and negative values are left out.
    if (value >= 0.0) line += " " + name + ": " + scientific(value) + " |";
  }
  line += " loss scale: " + fixed(log.loss_scale, 1) + " |";
  if (log.grad_norm) line += " grad norm: " + fixed(*log.grad_norm, 3) + " |";
  if (log.num_zeros_in_grad) line += " num zeros: " + std::to_string(*log.num_zeros_in_grad) + " |";
  if (log.params_norm) line += " params norm: " + fixed(*log.params_norm, 3) + " |";
  line += " number of skipped iterations: " + padded(log.skipped_iterations, 3) + " |";
  line += " number of nan iterations: " + padded(log.nan_iterations, 3) + " |";
  if (log.seconds_left) line += " time left (estimate): " + timedelta_text(*log.seconds_left) + " |";
  return line;
}

std::string timedelta_text(const double seconds) {
  const auto total = static_cast<int64_t>(std::max(0.0, std::round(seconds)));
  const int64_t days = total / 86400, rest = total % 86400;
  char clock[32];
  std::snprintf(clock, sizeof clock, "%d:%02d:%02d", static_cast<int>(rest / 3600), static_cast<int>(rest / 60 % 60),
                static_cast<int>(rest % 60));
  if (days == 0) return clock;
  return std::to_string(days) + (days == 1 ? " day, " : " days, ") + clock;
}

std::string format_log_timestamp(const std::chrono::system_clock::time_point time) {
  const auto since_epoch = time.time_since_epoch();
  const auto whole_seconds = std::chrono::floor<std::chrono::seconds>(since_epoch);
  const auto microseconds = std::chrono::duration_cast<std::chrono::microseconds>(since_epoch - whole_seconds).count();
  const std::time_t seconds = std::chrono::system_clock::to_time_t(std::chrono::system_clock::time_point(
      std::chrono::duration_cast<std::chrono::system_clock::duration>(whole_seconds)));
  std::tm local{};
  localtime_r(&seconds, &local);
  char buffer[48];
  const size_t length = std::strftime(buffer, sizeof(buffer), "%Y-%m-%d %H:%M:%S", &local);
  std::snprintf(buffer + length, sizeof(buffer) - length, ".%06lld", static_cast<long long>(microseconds));
  return buffer;
}

std::string format_validation_log(const std::string_view prefix, const NamedValues& losses) {
  std::string line = " validation loss at " + std::string(prefix) + " | ";
  for (const auto& [name, value] : losses) {
    line += name + " value: " + scientific(value) + " | ";
    line += name + " PPL: " + scientific(std::exp(std::min(20.0, value))) + " | ";
  }
  return line;
}

std::string format_validation_log(const int64_t iteration, const NamedValues& losses) {
  return format_validation_log("iteration " + std::to_string(iteration), losses);
}

std::string validation_rule(const std::string_view validation_line) {
  return std::string(validation_line.size() + 1, '-');
}

double num_floating_point_operations_packed(const ModelConfig& config, const double tokens,
                                            const double seqlen_squared_sum) {
  return num_floating_point_operations(flops_shape(config), tokens, seqlen_squared_sum);
}

double num_floating_point_operations(const ModelConfig& config, const int64_t batch_size, const int64_t seq_length) {
  const double sequences = static_cast<double>(batch_size);
  const auto seq = static_cast<double>(seq_length);
  return num_floating_point_operations_packed(config, sequences * seq, sequences * seq * seq);
}

double throughput_tflops_per_gpu(const double flops_per_iteration, const double seconds_per_iteration,
                                 const int64_t world_size) {
  return flops_per_iteration / (seconds_per_iteration * 1e12 * static_cast<double>(world_size));
}

}  // namespace moecore
