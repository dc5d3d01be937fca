// Memory that the ranks of one host share (MPI-3 shared-memory windows): the flex token dispatcher fans rows out
// inside a host through it, as DeepEP / HybridEP do over NVLink. And which host a rank is on, with the switch that
// splits one machine into pretend hosts for tests and benchmarks.
#pragma once

#include <cstddef>
#include <memory>

#include "moecore/parallel/process_group.h"

namespace moecore::parallel {

// A window over `group`, whose ranks must share memory (from ProcessGroup::split_shared_memory or a split of it): each
// rank's segment of its own size (rounded up to 64 bytes: every segment starts 64-byte aligned), readable and
// writable by every rank of the group. Creating and destroying it are collective over the group. The single-process
// group gets plain memory.
class SharedWindow {
 public:
  SharedWindow(const ProcessGroup& group, size_t bytes);
  ~SharedWindow();
  SharedWindow(const SharedWindow&) = delete;
  SharedWindow& operator=(const SharedWindow&) = delete;

  std::byte* segment(int rank) const;
  size_t segment_bytes(int rank) const;
  // Collective: every rank's writes so far become visible to all (MPI_Win_sync, barrier, MPI_Win_sync).
  void synchronize() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// This rank's host as a number the ranks of `world` agree on: ranks that share memory (MPI_COMM_TYPE_SHARED) are one
// host, numbered by their lowest rank in `world`; MOECORE_PRETEND_HOSTS=N splits each such host into N pretend hosts
// of consecutive ranks (its rank count must be a multiple of N), so several hosts can be tested on one machine.
// Collective over `world`. Throws CommError for a malformed variable.
int host_id(const ProcessGroup& world);

}  // namespace moecore::parallel
