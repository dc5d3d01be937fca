// The arrival board: the side channel that tells which ranks of a process group reached a collective, even when a
// rank cannot answer (stopped, or computing without calling MPI). Each rank keeps, per group, how many collectives
// it has started on it in its own slot of one MPI window over the world: publishing is a plain store, no message.
// A rank whose wait timed out reads its peers' slots with one-sided gets, which the target takes no part in under
// Open MPI's shared-memory and RDMA windows; the reads are bounded by a short deadline, so a transport that would
// need the target's help leaves those ranks "unknown" instead of hanging the report.
// Internal to parallel/ (process_group.cpp).
#pragma once

#define OMPI_SKIP_MPICXX 1  // the C API only: OpenMPI's deprecated C++ bindings warn under -Wextra
#include <mpi.h>

#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "moecore/parallel/watchdog.h"

namespace moecore::parallel::arrival_board {

// Collective over MPI_COMM_WORLD, once per process (ProcessGroup::world()); the window is freed when MPI finalizes.
void open();
// Collective over `group`: a slot that is free on every member (-1 when the board is not open or full).
int claim_slot(MPI_Comm group);
// This rank's counts of collectives started and completed on the group of `slot` (no-op for slot -1).
void publish_started(int slot, int64_t started);
void publish_completed(int slot, int64_t completed);
// This rank is polling MPI (a wait's loop): peers that read the board see it move.
void beat();
// Every listed world rank's counts in `slot`, and whether its beat moved while this watched for `watch_seconds`;
// counts stay nullopt where the reads did not complete within `seconds`.
std::vector<PeerProgress> read(int slot, std::span<const int> world_ranks, double watch_seconds, double seconds);

}  // namespace moecore::parallel::arrival_board
