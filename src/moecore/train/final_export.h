// After training: the one-process model gathered on rank 0, handed to the caller, exported HuggingFace-style and
// sampled greedily.
#pragma once

#include <iosfwd>

#include "moecore/config/arguments.h"
#include "moecore/model/gpt_model.h"
#include "moecore/optim/ddp.h"
#include "moecore/parallel/parallel_state.h"
#include "moecore/train/trainer.h"
#include "moecore/train/training_setup.h"

namespace moecore {

// Collective (every rank gathers its shards); the export, the callback and the sample run on world rank 0.
void finish_training(const TrainingArgs& args, GPTModel& model, DistributedDataParallel& ddp,
                     const Vocabulary& vocabulary, const parallel::ParallelState& parallel,
                     const FullModelCallback& on_full_model, std::ostream& log);

}  // namespace moecore
