// The one-process model assembled from a distributed one (HF export, generation, layout-equivalence tests):
// tensor-parallel shards are all-gathered over TP / expert-TP, every EP rank's experts are sent to its stage's root,
// and every pipeline stage's root sends its tensors to world rank 0.
#pragma once

#include <cstdint>
#include <memory>

#include "moecore/model/gpt_model.h"

namespace moecore {

// Collective over the whole layout. World rank 0 gets a single-process GPTModel with the distributed model's
// parameter values and expert-bias buffers; the other ranks get null. With one process: a copy.
std::unique_ptr<GPTModel> gather_full_model(const GPTModel& model, uint64_t seed);

}  // namespace moecore
