#include "moecore/ckpt/piece_coverage.h"

#include <algorithm>
#include <utility>

namespace moecore {
namespace {

// [begin, end) of the global tensor's row-major elements.
using Range = std::pair<int64_t, int64_t>;

void append_merged(std::vector<Range>& ranges, const int64_t begin, const int64_t end) {
  if (!ranges.empty() && ranges.back().second == begin) {
    ranges.back().second = end;
  } else {
    ranges.emplace_back(begin, end);
  }
}

// The global ranges of the elements a piece stores: one per row of its box (merged where they follow each other),
// clipped to its flat range; only the rows the flat range reaches are visited.
void append_ranges(const StateBox& box, const std::vector<int64_t>& global_shape, std::vector<Range>& ranges) {
  const size_t rank = global_shape.size();
  if (rank == 0) {
    if (box.numel() > 0) append_merged(ranges, 0, 1);
    return;
  }
  const int64_t row_length = box.shape[rank - 1];
  const int64_t first = box.flat() ? box.flat_begin : 0;
  const int64_t end = box.flat() ? box.flat_end : box.box_numel();
  if (row_length == 0 || first >= end) return;
  std::vector<int64_t> strides(rank, 1);
  for (size_t d = rank - 1; d-- > 0;) strides[d] = strides[d + 1] * global_shape[d + 1];
  for (int64_t row = first / row_length; row * row_length < end; ++row) {
    const int64_t lo = std::max(first, row * row_length) - row * row_length;
    const int64_t hi = std::min(end, (row + 1) * row_length) - row * row_length;
    int64_t global = (box.offsets[rank - 1] + lo) * strides[rank - 1];
    int64_t rest = row;
    for (size_t d = rank - 1; d-- > 0;) {
      global += (box.offsets[d] + rest % box.shape[d]) * strides[d];
      rest /= box.shape[d];
    }
    append_merged(ranges, global, global + (hi - lo));
  }
}

}  // namespace

std::optional<std::string> piece_coverage_problem(const std::vector<int64_t>& global_shape,
                                                  const std::vector<StateBox>& pieces) {
  std::vector<Range> ranges;
  for (const StateBox& box : pieces) append_ranges(box, global_shape, ranges);
  std::sort(ranges.begin(), ranges.end());
  int64_t covered = 0;  // every element before it is in exactly one piece
  for (const auto& [begin, end] : ranges) {
    if (begin < covered) return "overlap at element " + std::to_string(begin);
    if (begin > covered) return "leave element " + std::to_string(covered) + " out";
    covered = end;
  }
  if (covered != shape_numel(global_shape)) return "leave element " + std::to_string(covered) + " out";
  return std::nullopt;
}

}  // namespace moecore
