// Megatron's --log-progress: rank 0 appends to <--save>/progress.txt one line per event, tab-separated as Megatron's
// append_to_progress_log writes them ("%Y-%m-%d %H:%M:%S\tJob ID: $SLURM_JOB_ID\t# GPUs: <world size>\t<event>"):
// "Starting job" when the run starts; after each persistent checkpoint save "Saved checkpoint\tIteration: N\tJob
// throughput: X TFLOP/s/GPU\tCumulative throughput: Y TFLOP/s/GPU\tFloating-point operations: Z\tTokens (in
// billions): T" (training.py: compute_throughputs_and_append_to_progress_log); an async save writes that line as
// "Saving async checkpoint" when it is scheduled and "Saved async checkpoint\tIteration: N" once it is complete.
// Job throughput: the FLOPs trained by this job over its run time (from its earliest process start, as Megatron's
// _TRAIN_START_TIME); cumulative throughput: since the earliest "Starting job" of the file's latest run of
// jobs with this world size, from the FLOPs of the last checkpoint saved before it (get_start_time_from_progress_log).
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "moecore/config/arguments.h"
#include "moecore/parallel/parallel_state.h"
#include "moecore/train/training_progress.h"

namespace moecore {

class ProgressLog {
 public:
  // Appends "Starting job" (rank 0) when args.log_progress; `floating_point_operations_at_start`: the loaded
  // checkpoint's count (0 for a new run).
  ProgressLog(const TrainingArgs& args, const parallel::ParallelState& parallel,
              double floating_point_operations_at_start);

  // A persistent save of `progress` is complete (async: scheduled); `job_start_seconds`: the job's earliest process
  // start (Unix seconds).
  void saved(const TrainingProgress& progress, bool async_scheduled, double job_start_seconds);
  // An async save of `iteration` has completed.
  void async_saved(int64_t iteration);

 private:
  void append(const std::string& event) const;

  const TrainingArgs& args_;
  int64_t world_size_ = 1;
  bool writes_ = false;  // --log-progress on rank 0
  double flops_at_start_ = 0.0;
};

// The start of the file's latest run of jobs with `world_size` processes and the FLOPs saved before it, as Megatron's
// get_start_time_from_progress_log reads progress.txt: {Unix seconds, FLOPs}; nullopt without such a "Starting job".
struct ProgressStart {
  double seconds = 0.0;
  double floating_point_operations = 0.0;
};
std::optional<ProgressStart> progress_start(const std::string& progress_text, int64_t world_size);

}  // namespace moecore
