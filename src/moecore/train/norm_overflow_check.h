// Norm overflows agreed over ranks: a norm that overflowed on one rank (its rows, its pipeline stage) stops every
// rank together, with the same norm named everywhere.
#pragma once

#include <optional>

#include "moecore/model/gpt_model.h"
#include "moecore/model/norm_overflow.h"
#include "moecore/parallel/process_group.h"

namespace moecore {

// The first norm overflow in model order over every rank of `group` since the last call (GPTModel::
// take_norm_overflow; ties go to the lowest rank); collective, every rank returns the same. One all-reduce of a flag
// when no rank overflowed.
std::optional<NormOverflow> agree_on_norm_overflow(GPTModel& model, const parallel::ProcessGroup& group);

}  // namespace moecore
