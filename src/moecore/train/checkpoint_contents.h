// What `train --load` reads from a moecore checkpoint beyond the format's own checks (ckpt/sharded_checkpoint.h):
// the model flags it recorded, the model state those flags imply, the optimizer, scheduler and progress state.
// `moecore checkpoint DIR` runs these checks too, so that a checkpoint it reports verified is one a run with the
// recorded flags loads.
#pragma once

#include <nlohmann/json.hpp>

#include "moecore/ckpt/sharded_checkpoint.h"
#include "moecore/model/config.h"

namespace moecore {

// metadata.json's "args.model" (the flags a loading run must repeat); CheckpointError naming the file when absent.
const nlohmann::ordered_json& recorded_model_flags(const ShardedCheckpoint& checkpoint);

// The model those flags describe, as far as its state's keys and shapes go (model_state_keys); the vocabulary from
// "args.training.padded_vocab_size", 0 when not recorded. CheckpointError naming the flag for a missing value, one of
// the wrong type, or a size outside [0, 2^30].
ModelConfig recorded_model_config(const ShardedCheckpoint& checkpoint);

// Every key of the recorded model (model_state_keys) with its global shape; iteration, consumed samples and FLOPs;
// with optimizer.step, both Adam moments of every parameter and the LR scheduler's scalars. CheckpointError naming
// metadata.json and the key otherwise.
void check_checkpoint_contents(const ShardedCheckpoint& checkpoint);

}  // namespace moecore
