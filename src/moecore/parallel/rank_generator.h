// Megatron's RankGenerator (megatron/core/parallel_state.py): ranks laid out on a grid of parallel axes named
// by an order string such as "tp-cp-ep-dp-pp", the leftmost axis varying fastest. Pure logic, no MPI.
#pragma once

#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace moecore {

// Invalid parallel sizes or order string; the message is one line naming the problem.
class LayoutError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// One entry per group; each entry lists the group's global ranks in their in-group order.
using RankGroups = std::vector<std::vector<int>>;

// The groups of ranks that differ only along the masked axes. axis_sizes[i] is the size of axis i (axis 0 varies
// fastest: rank = sum_i index_i * prod_{j<i} size_j). Groups are enumerated with the unmasked axes' indices, first
// unmasked axis fastest; members with the masked axes' indices, first masked axis fastest.
RankGroups masked_orthogonal_rank_groups(const std::vector<int>& axis_sizes, const std::vector<bool>& mask);

class RankGenerator {
 public:
  // Axes absent from `order` are appended to it when their size is 1; an absent axis of size > 1 is an error.
  RankGenerator(int tp, int ep, int dp, int pp, int cp, std::string_view order);

  // Groups over the axes named by `axes` ("tp", "dp-cp", "tp-ep", ...); the order of names in `axes` does not
  // matter, the order string decides the member order.
  RankGroups get_ranks(std::string_view axes) const;

  int world_size() const { return world_size_; }
  // The order string with the omitted size-1 axes appended, e.g. "tp-pp-dp-cp-ep".
  std::string order() const;

 private:
  std::vector<std::string> axis_names_;  // in order-string order
  std::vector<int> axis_sizes_;
  int world_size_ = 1;
};

}  // namespace moecore
