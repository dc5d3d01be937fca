// `moecore checkpoint DIR`: prints a checkpoint's iteration, parallel layout and tensors (key, dtype, global shape,
// pieces), then verifies every file's and every piece's CRC-32 with the loader's own reader. DIR is a save folder
// (its tracker's iteration) or one iter_ folder. Returns 0 when intact; throws CheckpointError naming the first
// damaged file and tensor.
#pragma once

#include <iosfwd>
#include <string>
#include <vector>

namespace moecore {

int checkpoint_inspect_main(const std::vector<std::string>& args, std::ostream& out);

}  // namespace moecore
