// Saving and loading training runs as Megatron's checkpointing.py does, in moecore's sharded format
// (ckpt/sharded_checkpoint.h).
//
// Save (--save DIR --save-interval N): DIR/iter_%07d/ and DIR/latest_checkpointed_iteration.txt, after every N-th
// iteration and after the last one (when not a multiple of N), with Megatron's log lines and the save time
// ("(min, max) time across ranks (ms)" / "save-checkpoint"). --no-save-optim drops the optimizer (loss scalers
// included) and scheduler state, --no-save-rng the RNG seed. --async-save writes in the background; the next save, or
// the end of the run, waits for it; the tracker names it only once every rank has written.
// --non-persistent-save-interval M (--non-persistent-ckpt-type global) also saves into DIR/non_persistent/ (or
// --non-persistent-global-ckpt-dir) every M iterations when the persistent save did not fire; before each such save
// every non-persistent checkpoint but the newest is removed (Megatron's cleanup_old_non_persistent_checkpoint).
//
// Load (--load DIR): the tracker's iteration (or --ckpt-step; with --non-persistent-ckpt-type global a non-persistent
// checkpoint of a later or equal iteration wins), in any parallel layout: each rank reads the pieces that overlap its
// own shards. A `release` tracker names DIR/release: its weights, at iteration 0, nothing else. Model flags must
// equal the saved ones (one line naming the first that differs); parallel sizes, batch sizes and thread counts may
// change. Restored: parameters and buffers (the router's expert bias); Adam moments and step, the fp16 loss scalers
// and the LR / weight-decay scheduler (none of them with --no-load-optim or --finetune: the schedule then restarts at
// step 0), the scheduler's fields checked against the flags unless --override-opt_param-scheduler (the flags win and
// the position becomes the consumed samples) or --use-checkpoint-opt_param-scheduler (the checkpoint wins);
// iteration and consumed samples (not with --finetune, which starts at iteration 0); the FLOPs so far (always); the
// RNG seed (not with --no-load-rng or --finetune; moecore's RNG is a counter keyed by seed and position, so it reloads
// in any layout, where Megatron drops it on a TP/PP change). No tracker: a fresh start, or an error with
// --exit-on-missing-checkpoint. DIR may also be a HuggingFace folder (config.json): its weights under any layout,
// iteration 0, fresh optimizer. --moe-use-upcycling builds the MoE model from a dense checkpoint (moecore's or
// HuggingFace's; ckpt/upcycling.h).
//
// A failed save (a full disk, a folder that became read-only, an I/O error; every rank learns of it) removes its
// ITER.tmp and never moves the tracker. By default the run then stops with one line naming the file and the OS error
// (the previous checkpoint stays the one to resume from); with --ckpt-save-failure continue it warns with one line
// per failed save, trains on, and names the count at the end (Megatron has no such choice: a failed save raises).
//
// Exits (Megatron's checkpoint_and_decide_exit, after each iteration): --exit-signal (default SIGTERM) with
// --exit-signal-handler, then the regular saves, then --exit-duration-in-mins (minutes since the earliest process
// start of the job, decided together by every rank), then --exit-interval; each saves first (with --save) and ends the
// run with exit status 0, skipping the evaluation and export after training.
#pragma once

#include <chrono>
#include <csignal>
#include <cstdint>
#include <iosfwd>
#include <memory>
#include <optional>
#include <string>

#include "moecore/ckpt/sharded_checkpoint.h"
#include "moecore/config/arguments.h"
#include "moecore/model/gpt_model.h"
#include "moecore/optim/distributed_optimizer.h"
#include "moecore/optim/grad_scaler.h"
#include "moecore/optim/lr_schedule.h"
#include "moecore/parallel/parallel_state.h"
#include "moecore/train/progress_log.h"
#include "moecore/train/training_progress.h"

namespace moecore {

// The arguments a checkpoint records in metadata.json: "model" (flags that must match on load, by flag name) and
// "training" (the rest worth knowing; free to change).
nlohmann::ordered_json checkpoint_args(const TrainingArgs& run_args);
nlohmann::ordered_json checkpoint_layout(const TrainingArgs& args, const parallel::ParallelState& parallel);

// What --load holds, found before the model is built (the RNG seed changes how the run draws).
struct LoadPlan {
  enum class Kind { kNone, kSharded, kHuggingFace };
  Kind kind = Kind::kNone;
  std::string dir;  // the iteration folder, or the HF folder
  int64_t iteration = 0;
  bool release = false;         // DIR/release: weights only, iteration 0 (Megatron's release checkpoints)
  std::optional<int64_t> seed;  // the checkpoint's RNG seed when it is to be loaded
  // kSharded: the iteration folder, opened and validated once (metadata.json, every file's size and header).
  std::shared_ptr<const ShardedCheckpoint> checkpoint;
};
// Reads the tracker (and metadata.json) on every rank; throws ConfigError / CheckpointError with one line.
LoadPlan plan_load(const TrainingArgs& args, std::ostream& log);

// The model and optimizer state of a run, as the checkpoint code sees it.
struct CheckpointTarget {
  GPTModel& model;
  DistributedDataParallel& ddp;
  DistributedAdamW& optimizer;
  LRSchedule& schedule;
  int64_t vocab_tokens = 0;  // the tokenizer's vocabulary before padding: the embedding rows a checkpoint must hold
  LossScalers* loss_scalers = nullptr;  // saved and loaded with the optimizer state
};

// Loads `plan` into `target` and `progress` as described above (collective; every rank fails together with one
// line).
void load_checkpoint(const LoadPlan& plan, const TrainingArgs& run_args, const CheckpointTarget& target,
                     TrainingProgress& progress, const parallel::ParallelState& parallel, std::ostream& log);
// Where non-persistent checkpoints of `root` live: --non-persistent-global-ckpt-dir, else root/non_persistent.
std::string non_persistent_root(const TrainingArgs& args, const std::string& root);

// Saves, async saves and exits during training.
class Checkpointer {
 public:
  // `floating_point_operations_at_start`: the loaded checkpoint's count (--log-progress's job throughput).
  Checkpointer(const TrainingArgs& run_args, const parallel::ParallelState& parallel, std::ostream& log,
               double floating_point_operations_at_start = 0.0);
  ~Checkpointer();
  Checkpointer(const Checkpointer&) = delete;
  Checkpointer& operator=(const Checkpointer&) = delete;

  // Megatron's checkpoint_and_decide_exit after `progress.iteration`: saves as the flags say; true to end the run.
  bool after_iteration(const CheckpointTarget& target, const TrainingProgress& progress);
  // After the last iteration: the final save (iteration not a multiple of --save-interval), then waits for any
  // async save to complete.
  void finish(const CheckpointTarget& target, const TrainingProgress& progress);
  // Saves now (persistent, or into DIR/non_persistent).
  void save(const CheckpointTarget& target, const TrainingProgress& progress, bool non_persistent);

 private:
  void wait_for_pending();
  // Finalizes the pending save (non-blocking: only when every rank has written); logs it or handles its failure.
  void complete_pending(bool blocking);
  // Stops the run (parallel::GroupFailure, the same on every rank) or, with --ckpt-save-failure continue, warns.
  void handle_failed_save(int64_t iteration, bool non_persistent, const std::string& why);
  void report_failed_saves();
  const TrainingArgs& args_;
  const parallel::ParallelState& parallel_;
  std::ostream& log_;
  ProgressLog progress_log_;
  std::unique_ptr<ShardedSave> pending_;
  bool pending_non_persistent_ = false;
  int64_t last_saved_ = -1;
  int64_t last_started_ = -1;  // the last persistent save begun (it may still be in flight, or have failed)
  int64_t failed_saves_ = 0;
  double start_seconds_ = 0.0;  // the job's start (--exit-duration-in-mins), Unix seconds
  int exit_signal_ = SIGTERM;
  struct sigaction previous_handler_ {};
  sigset_t previous_mask_{};
  // The exit signal arrived: the handler's flag, or the signal pending on the threads that block it (taken here).
  bool exit_signal_pending() const;
  bool handler_installed_ = false;
};

}  // namespace moecore
