// Every rank of one job must run with the same command line: under mpirun each rank parses its own argv, and ranks
// started with different --seed or --lr (an MPMD launch, a per-host wrapper script) would train and drift apart
// silently. At start-up the ranks compare their effective flags with rank 0's and all stop with one line naming the
// first flag that differs.
//
// The effective flags of a command line: each flag with the values of its last occurrence (argparse: the last one
// wins), `--flag=value` the same as `--flag value`, a value-less flag (a switch) present or not. They are compared
// in the order of the flag table (implemented_train_flags()), other names after it in alphabetical order; a flag
// given on one rank and absent on another differs. --threads is per rank (hosts may have different cores).
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "moecore/parallel/process_group.h"

namespace moecore {

// The flags that may legitimately differ between the ranks of one job.
const std::vector<std::string>& per_rank_train_flags();

// The first effective flag whose values differ between rank 0's arguments and rank `rank`'s, as the one-line message
// "ranks disagree on --seed: rank 0 has 1234, rank 1 has 7"; nullopt when they agree. Never throws on malformed
// command lines (parsing reports those later, alike on every rank once the ranks agree).
std::optional<std::string> first_argument_disagreement(const std::vector<std::string>& rank0_args,
                                                       const std::vector<std::string>& args, int rank);

// Collective over `world`: broadcasts rank 0's arguments and throws parallel::GroupFailure on every rank with the
// message of the lowest rank whose effective flags differ from rank 0's.
void check_ranks_agree_on_arguments(const parallel::ProcessGroup& world, const std::vector<std::string>& args);

}  // namespace moecore
