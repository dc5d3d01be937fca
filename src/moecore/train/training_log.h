// The training log of rank 0, as Megatron's training_log: interval averages of the lm loss and the MoE losses,
// timing and throughput, a line every --log-interval iterations and after the first iteration, then expert usage,
// communication time and (twice) memory.
#pragma once

#include <chrono>
#include <cstdint>
#include <iosfwd>

#include "moecore/config/arguments.h"
#include "moecore/optim/lr_schedule.h"
#include "moecore/parallel/parallel_state.h"
#include "moecore/train/expert_collapse.h"
#include "moecore/train/log_format.h"
#include "moecore/train/moe_logging.h"
#include "moecore/train/tensorboard_log.h"
#include "moecore/train/train_step.h"
#include "moecore/train/training_progress.h"

namespace moecore {

// Megatron's training_log prints `if iteration % args.log_interval == 0 or is_first_iteration`; the first iteration's
// line does not reset the interval averages (should_reset = not is_first_iteration).
bool logs_iteration(int64_t iteration, int64_t log_interval, int64_t first_iteration);

// This rank's MoE statistics turned into the logged ones (collective over the world), as Megatron's metrics tracker
// (moe_logging.py: MoEMetricsTracker._sync_metrics): each loss summed over its reduce group, then averaged over DP
// when the router asked for it. aux / seq-aux losses: summed over tp-cp, averaged over DP; global aux loss: summed
// over tp-dp-cp, not averaged (router.py: _apply_global_aux_loss, needs_dp_avg=False); z-loss: averaged over tp-dp-cp
// (moecore's ranks hold their 1/|tp-cp| share, so the tp-cp sum averaged over DP). Token counts: summed.
// The MoE layers of the Multi-Token Prediction depths (when the last decoder layer is one) follow the decoder's.
void reduce_moe_stats(MoEStats& stats, const ModelConfig& model, const parallel::ParallelState& parallel);

class TrainingLogger {
 public:
  using Clock = std::chrono::steady_clock;

  // `run_args` with the padded vocabulary (the FLOPs count needs it). Logs to `log` (rank 0's stream).
  // `schedule` is the run's scheduler: each line prints its learning rate after the iteration's step.
  TrainingLogger(const TrainingArgs& run_args, const LRSchedule& schedule, const parallel::ParallelState& parallel,
                 std::ostream& log);

  // Megatron's num_floating_point_operations of one global batch of unpacked sequences.
  double flops_per_iteration() const { return flops_per_iteration_; }
  // The FLOPs of the iteration `step` ran: with packed sequences (step.seqlen_stats) counted over its documents.
  double flops_of(const StepResult& step) const;
  // "throughput per GPU (TFLOP/s/GPU)": FLOPs of the global batch / (seconds * 1e12 * world size).
  double throughput_per_gpu(double seconds_per_iteration) const;
  double throughput_per_gpu(double flops_per_iteration, double seconds_per_iteration) const;
  // The line of `iteration` from interval averages (no timestamp when `timestamp` is empty).
  IterationLog iteration_log(const TrainingProgress& progress, double seconds_per_iteration, double lm_loss,
                             const NamedValues& moe_losses, double grad_norm, std::string timestamp) const;

  // Whether `iteration`'s figures reach the text log or TensorBoard (the same on every rank).
  bool reports(int64_t iteration) const;
  // Starts the interval clock (after any validation before training).
  void start();
  // Leaves `duration` (an evaluation) out of the interval time, as Megatron stops its interval timer.
  void exclude(Clock::duration duration) { interval_start_ += duration; }
  // Adds the iteration just completed (`progress` already counts it; collective: reduces the MoE statistics) and
  // prints its line when Megatron would; writes its TensorBoard scalars (--tensorboard-dir).
  void record(const TrainingProgress& progress, StepResult step);
  // A validation loss at `iteration` to TensorBoard (the text line is evaluate_and_print's).
  void validation(const TrainingProgress& progress, double lm_loss) {
    tensorboard_.validation(progress.iteration, progress.consumed_train_samples, lm_loss);
  }

 private:
  const TrainingArgs& args_;
  const parallel::ParallelState& parallel_;
  std::ostream& log_;
  const LRSchedule& schedule_;
  double flops_per_iteration_ = 0.0;
  int64_t first_iteration_ = 1;
  // The interval since the last reset.
  Clock::time_point interval_start_;
  double loss_sum_ = 0.0;   // lm loss over the advanced iterations
  int64_t iterations_ = 0;  // advanced + skipped
  int64_t advanced_iterations_ = 0;
  int64_t skipped_iterations_ = 0;  // loss scaling skipped them
  int64_t nan_iterations_ = 0;      // skipped with a non-finite loss
  bool loss_seen_ = false;          // an advanced iteration has been logged (Megatron's lm loss key exists)
  double flops_sum_ = 0.0;          // FLOPs of the interval's iterations
  int64_t real_tokens_sum_ = 0;     // packed sequences: their real tokens
  std::optional<StepResult::Packing> packing_sum_;  // whole samples: bins, padding bins and padding tokens
  MoEMetrics moe_metrics_;
  MoEMetrics iteration_moe_metrics_;  // the last iteration's alone (TensorBoard)
  TensorBoardLog tensorboard_;
  ExpertCollapseAlarm collapse_alarm_;
  int64_t interval_first_iteration_ = 0;  // the first iteration of the interval being summed
  std::vector<double> mtp_loss_sums_;     // --mtp-num-layers: each depth's loss over the interval's iterations
  bool report_memory_ = true;             // Megatron's report_memory_flag
};

}  // namespace moecore
