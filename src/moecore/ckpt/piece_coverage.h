// Whether the stored pieces of a tensor hold each of its elements exactly once (docs/checkpoint-format.md): a load
// counts the elements it copies, which a gap hidden by an overlap of the same size would pass.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "moecore/ckpt/state_source.h"

namespace moecore {

// Null when `pieces` (boxes inside `global_shape`, as metadata.json's validation ensures) tile the tensor exactly;
// otherwise the first problem, e.g. "overlap at element 12" or "leave element 40 out". The work grows with the
// pieces' rows (runs of the last dimension), not with their elements.
std::optional<std::string> piece_coverage_problem(const std::vector<int64_t>& global_shape,
                                                  const std::vector<StateBox>& pieces);

}  // namespace moecore
