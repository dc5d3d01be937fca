#include "moecore/train/hybrid_cp_groups.h"

#include <stdexcept>
#include <string>

namespace moecore {

HybridCpGroups::HybridCpGroups(const parallel::ProcessGroup& dp_cp) : rank_(dp_cp.rank()), world_(dp_cp.size()) {
  for (int64_t size = 2; size <= world_; size *= 2) {
    for (int64_t offset = 0; offset < size && offset + size <= world_; ++offset) {
      // One split per (size, offset): the blocks offset + k size; ranks outside every block get a colour of their own.
      const int64_t block = rank_ >= offset ? (rank_ - offset) / size : -1;
      const bool inside = block >= 0 && offset + (block + 1) * size <= world_;
      const int colour = inside ? static_cast<int>(block) : static_cast<int>(world_ + rank_);
      parallel::ProcessGroup group = dp_cp.split(colour, static_cast<int>(rank_));
      if (!inside) continue;
      group.set_name("hybrid-cp/" + std::to_string(offset + block * size) + "+" + std::to_string(size));
      groups_.emplace(std::make_pair(offset + block * size, size), std::move(group));
    }
  }
}

const parallel::ProcessGroup& HybridCpGroups::group(const int64_t first_rank, const int64_t size) const {
  if (size == 1 && first_rank == rank_) return self_;
  const auto it = groups_.find({first_rank, size});
  if (it == groups_.end()) {
    throw std::invalid_argument("dynamic context parallelism: no group of ranks [" + std::to_string(first_rank) + ", " +
                                std::to_string(first_rank + size) + ") holds rank " + std::to_string(rank_));
  }
  return it->second;
}

}  // namespace moecore
