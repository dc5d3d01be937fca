// Dynamic context parallelism's process groups (Megatron's parallel_state.create_hybrid_dp_cp_groups): for every size
// 2, 4, ..., N of the N data- and context-parallel ranks, the contiguous blocks of that many ranks, each a
// communicator, so that a sample the scheduler (data/hybrid_cp_schedule.h) gives to ranks [first, first + size) runs
// its context-parallel attention among exactly them. Megatron builds the aligned blocks; its scheduler can place a
// sample on an unaligned block in a later round, so every offset is built too. Size 1 is the rank alone.
#pragma once

#include <cstdint>
#include <map>
#include <utility>

#include "moecore/parallel/process_group.h"

namespace moecore {

class HybridCpGroups {
 public:
  // Collective over dp_cp (its size a power of two).
  explicit HybridCpGroups(const parallel::ProcessGroup& dp_cp);
  // The block [first_rank, first_rank + size) of dp_cp, which must hold this rank; std::invalid_argument otherwise.
  const parallel::ProcessGroup& group(int64_t first_rank, int64_t size) const;

 private:
  int64_t rank_ = 0, world_ = 1;
  parallel::ProcessGroup self_ = parallel::ProcessGroup::self();
  std::map<std::pair<int64_t, int64_t>, parallel::ProcessGroup> groups_;  // (first rank, size) -> the block
};

}  // namespace moecore
