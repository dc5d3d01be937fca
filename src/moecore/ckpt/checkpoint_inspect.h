// What `moecore checkpoint DIR` does: prints a checkpoint's iteration, parallel layout and tensors (key, dtype, global
// shape, pieces), then verifies it with the loader's own reader: metadata.json's structure, each tensor's pieces
// covering it exactly once, every file's and every piece's CRC-32, and what `check_contents` (the training layer's
// checks of the state a load reads) requires. DIR is a save folder (its tracker's iteration) or one iter_ folder.
// Returns 0 when intact; throws CheckpointError naming the first damaged file and tensor.
#pragma once

#include <functional>
#include <iosfwd>
#include <string>

namespace moecore {

class ShardedCheckpoint;

int inspect_checkpoint(std::string dir, std::ostream& out,
                       const std::function<void(const ShardedCheckpoint&)>& check_contents = nullptr);

}  // namespace moecore
