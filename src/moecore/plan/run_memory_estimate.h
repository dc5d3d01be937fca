// train's start-up memory estimate, made with the planner's accounting: `moecore plan --gpu cpu`'s model of what the
// engine's MemoryTracker counts (moecore_engine_memory.h), so that the estimate a run checks before allocating and
// the plan of the same flags are one number.
#pragma once

#include "moecore/config/arguments.h"
#include "moecore/config/memory_estimate.h"

namespace moecore::plan {

// `args` finalised, with the padded vocabulary in args.model.vocab_size. The model's parts are the peaks of the rank
// holding the most; the data indices come from data_index_bytes.
MemoryEstimate estimate_run_memory(const TrainingArgs& args);

}  // namespace moecore::plan
