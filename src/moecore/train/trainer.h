// The training loop of `moecore train`: data, model, AdamW with Megatron's schedule, gradient accumulation
// over micro-batches, clipping, Megatron-format logs, periodic validation, HF export and a sample at the end.
#pragma once

#include <iosfwd>
#include <stdexcept>

#include "moecore/train/arguments.h"

namespace moecore {

// The run cannot go on (NaN/Inf loss, ...): one line.
class TrainingError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct TrainResult {
  double first_train_loss = 0.0;   // mean lm loss of iteration 1
  double last_train_loss = 0.0;    // mean lm loss of the last iteration
  double first_valid_loss = -1.0;  // validation lm loss before training (-1 without a validation split)
  double last_valid_loss = -1.0;   // validation lm loss after the last iteration
  double tokens_per_second = 0.0;  // training tokens / training wall time
  double unigram_baseline = -1.0;  // validation cross-entropy of a context-free unigram model (-1: not computed)
};

// Runs the whole training described by `args`, logging to `log`.
TrainResult run_training(const TrainingArgs& args, std::ostream& log);

}  // namespace moecore
