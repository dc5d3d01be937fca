// Megatron-format log lines (megatron/training/training.py: training_log, evaluate_and_print_results) and the
// FLOPs count behind "throughput per GPU (TFLOP/s/GPU)" (num_floating_point_operations).
//
// Field formats follow Megatron's Python format specs: iteration {:8d}/{:8d}, consumed samples {:12d}, elapsed
// time {:.1f}, throughput {:.1f}, learning rate {:.6E}, global batch size {:5d}, losses {:.6E}, loss scale {:.1f},
// grad norm {:.3f}, params norm {:.3f}, skipped / nan iterations {:3d}. Non-finite values print as Python does
// ("nan", "NAN", "inf", "-INF": NaN never carries a sign).
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "moecore/model/config.h"

namespace moecore {

// Named values in print order, e.g. {{"lm loss", 6.12}, {"load_balancing_loss", 1.01}}.
using NamedValues = std::vector<std::pair<std::string, double>>;

struct IterationLog {
  std::string timestamp;  // "2026-11-29 17:40:00.123456" (format_log_timestamp); empty = no "[...]" prefix
  int64_t iteration = 0;
  int64_t train_iters = 0;
  int64_t consumed_samples = 0;
  int64_t skipped_samples = 0;  // printed only when > 0
  double elapsed_ms_per_iteration = 0.0;
  std::optional<double> throughput_tflops_per_gpu;  // printed when set (Megatron: --log-throughput)
  std::optional<double> learning_rate;              // printed when set
  int64_t global_batch_size = 0;
  // Packed sequences: real (document) tokens per iteration, averaged over the interval; printed when set.
  std::optional<int64_t> real_tokens_per_iteration;
  // Whole samples (--sample-data-path): the bins of an iteration and, of its bins' tokens, the padding, each averaged
  // over the interval; printed when set.
  std::optional<int64_t> packed_bins_per_iteration, padding_bins_per_iteration, padding_tokens_per_iteration;
  NamedValues losses;  // averages over the logging interval; as Megatron, only values >= 0 are printed
  double loss_scale = 1.0;
  std::optional<double> grad_norm;
  std::optional<int64_t> num_zeros_in_grad;
  std::optional<double> params_norm;
  int64_t skipped_iterations = 0;
  int64_t nan_iterations = 0;
  // moecore's addition at the end of the line: the remaining iterations at the interval's time per iteration,
  // printed as Python's timedelta ("0:12:34", "2 days, 3:04:05") when set.
  std::optional<double> seconds_left;
};

// Whole seconds as Python's str(datetime.timedelta(seconds=...)): "0:00:05", "1:02:03", "1 day, 0:00:00".
std::string timedelta_text(double seconds);

// " [2026-11-29 17:40:00] iteration       10/     100 | consumed samples:          640 | ... |"
std::string format_iteration_log(const IterationLog& log);

// Local time as Megatron's training_log prints it: datetime.now().strftime('%Y-%m-%d %H:%M:%S.%f'), i.e. with
// six digits of microseconds.
std::string format_log_timestamp(std::chrono::system_clock::time_point time);

// " validation loss at iteration 100 | lm loss value: 5.123456E+00 | lm loss PPL: 1.681856E+02 | "
// PPL = exp(min(20, value)). `prefix` is Megatron's, e.g. "iteration 100" or "iteration 100 on test set".
std::string format_validation_log(std::string_view prefix, const NamedValues& losses);
std::string format_validation_log(int64_t iteration, const NamedValues& losses);
// Megatron prints a rule of '-' * (len(line) + 1) above and below the validation line.
std::string validation_rule(std::string_view validation_line);

// Megatron's num_floating_point_operations (flops.h) of a model moecore trains (no MTP, no MLA): forward + backward
// FLOPs of one iteration of `batch_size` sequences of `seq_length` tokens. config.vocab_size (the padded vocabulary)
// must be set.
double num_floating_point_operations(const ModelConfig& config, int64_t batch_size, int64_t seq_length);
// The same for packed sequences: every per-token term over `tokens` = sum_i L_i, the causal attention term over
// sum_i L_i^2 (documents attend only within themselves). With one document per sequence (tokens = B * S, squared
// sum = B * S^2) it equals the form above.
double num_floating_point_operations_packed(const ModelConfig& config, double tokens, double seqlen_squared_sum);

// Megatron's throughput (training.py: training_log): the FLOPs of one global batch / (seconds per iteration * 1e12 *
// world size), world size being every process of the run, so the figure is per GPU (per process).
double throughput_tflops_per_gpu(double flops_per_iteration, double seconds_per_iteration, int64_t world_size);

}  // namespace moecore
