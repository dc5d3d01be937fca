// The training run's TensorBoard scalars, with Megatron's tags and steps (training.py: training_log and
// evaluate_and_print_results; moe_logging.py: MoEMetricsTracker.report; the MTP loss helper), written by the last
// rank as Megatron's SummaryWriter is (global_vars.py: _set_tensorboard_writer). Every --tensorboard-log-interval
// iterations: learning-rate, batch-size, lm loss, loss-scale (unless --no-log-loss-scale-to-tensorboard), world-size
// (--log-world-size-to-tensorboard), grad-norm, and moecore's memory figures (--log-memory-to-tensorboard), each also
// "<tag> vs samples" against the consumed samples; every iteration: the MoE auxiliary losses averaged over the MoE
// layers (per layer as moe/<name>_layer_<i> with --moe-per-layer-logging) and the MTP depths' losses; at each text
// log line after the first, with --log-timers-to-tensorboard: iteration-time (seconds) and, with --log-throughput,
// throughput, and moecore's expert-load figures (expert_load); after each validation: "lm loss validation" (and its
// ppl with --log-validation-ppl-to-tensorboard).
// The values are the iteration's own, not the text line's interval averages. The file is flushed at each text log
// line, after each validation and at the end, so a killed run keeps its curves up to the last of those.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>

#include "moecore/config/arguments.h"
#include "moecore/parallel/parallel_state.h"
#include "moecore/train/expert_collapse.h"
#include "moecore/train/log_format.h"
#include "moecore/util/tensorboard_events.h"

namespace moecore {

// What one training iteration contributes to TensorBoard.
struct TensorBoardIteration {
  int64_t iteration = 0;         // after the step: 1 for the first
  int64_t consumed_samples = 0;  // after the step
  double learning_rate = 0.0;
  double loss_scale = 1.0;
  bool skipped = false;  // no lm loss or grad norm then, as Megatron's None values
  double lm_loss = 0.0;
  double grad_norm = 0.0;
  std::optional<int64_t> num_zeros_in_grad;  // --log-num-zeros-in-grad
  std::optional<double> params_norm;         // --log-params-norm
  NamedValues moe_losses;                    // this iteration's, as MoEMetrics::losses() names them
  NamedValues mtp_losses;                    // "mtp_1 loss", ...
};

class TensorBoardLog {
 public:
  // Opens an event file in args.tensorboard_dir on the last rank; elsewhere, or without the flag, every call is a
  // no-op. Throws std::runtime_error naming the directory when it cannot be written.
  TensorBoardLog(const TrainingArgs& args, const parallel::ParallelState& parallel);

  bool enabled() const { return writer_ != nullptr; }
  void iteration(const TensorBoardIteration& step);
  // At a text log line: the interval's seconds per iteration and throughput (TFLOP/s per device, if logged).
  void timers(int64_t iteration, double seconds_per_iteration, const std::optional<double>& throughput);
  void validation(int64_t iteration, int64_t consumed_samples, double lm_loss);
  // At a text log line after the first: each MoE layer's min / max load ratio over the interval and its collapsed
  // (overloaded) experts, as moe/min_load_ratio_layer_<i>, moe/max_load_ratio_layer_<i>,
  // moe/collapsed_experts_layer_<i> (and moe/overloaded_experts_layer_<i> when that alarm is on): moecore's tags.
  void expert_load(int64_t iteration, const std::vector<LayerLoad>& loads);
  void flush();

 private:
  void scalar_with_samples(const std::string& tag, double value, int64_t iteration, int64_t consumed_samples);

  const TrainingArgs& args_;
  int64_t world_size_ = 1;
  std::unique_ptr<TensorBoardWriter> writer_;
};

}  // namespace moecore
