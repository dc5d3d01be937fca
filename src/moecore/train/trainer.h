// The training loop of `moecore train`: data, model, AdamW with Megatron's schedule, gradient accumulation
// over micro-batches, clipping, Megatron-format logs, periodic validation, HF export and a sample at the end.
#pragma once

#include <functional>
#include <iosfwd>
#include <stdexcept>
#include <vector>

#include "moecore/config/arguments.h"
#include "moecore/model/gpt_model.h"
#include "moecore/parallel/parallel_state.h"
#include "moecore/train/training_progress.h"

namespace moecore {

// The run cannot go on (NaN/Inf loss, ...): one line.
class TrainingError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct TrainResult {
  double first_train_loss = 0.0;     // lm loss of iteration 1 (token-weighted over the global batch)
  double last_train_loss = 0.0;      // lm loss of the last iteration
  double first_valid_loss = -1.0;    // validation lm loss before training (-1 without a validation split)
  double last_valid_loss = -1.0;     // validation lm loss after the last iteration
  double tokens_per_second = 0.0;    // training tokens / training wall time
  double unigram_baseline = -1.0;    // validation cross-entropy of a context-free unigram model (-1: not computed)
  std::vector<double> train_losses;  // lm loss of every iteration (token-weighted over the global batch)
  TrainingProgress progress;         // where the run ended
  bool exited_early = false;         // --exit-interval, --exit-duration-in-mins or SIGTERM ended the run
};

// Called on world rank 0 after training with the one-process model gathered from every rank (tests, tools).
using FullModelCallback = std::function<void(const GPTModel&)>;

// Runs the whole training described by `args` over `parallel` (every rank of the layout calls it), logging to
// `log` on world rank 0 only.
TrainResult run_training(const TrainingArgs& args, std::ostream& log, const parallel::ParallelState& parallel,
                         const FullModelCallback& on_full_model = {});
// One process.
TrainResult run_training(const TrainingArgs& args, std::ostream& log);

// The ParallelState for `args` in this process: single_process() without an MPI launcher, else the layout's
// communicators over MPI's world (collective).
parallel::ParallelState make_parallel_state(const TrainingArgs& args);

}  // namespace moecore
