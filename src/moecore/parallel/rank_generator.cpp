#include "moecore/parallel/rank_generator.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <limits>

namespace moecore {
namespace {

std::vector<std::string> split_order(std::string_view order) {
  std::vector<std::string> names;
  size_t start = 0;
  while (true) {
    const size_t dash = order.find('-', start);
    names.emplace_back(order.substr(start, dash == std::string_view::npos ? std::string_view::npos : dash - start));
    if (dash == std::string_view::npos) break;
    start = dash + 1;
  }
  return names;
}

// Products of the sizes before each axis: stride[i] = prod_{j<i} size_j.
std::vector<int64_t> prefix_strides(const std::vector<int>& sizes) {
  std::vector<int64_t> strides(sizes.size());
  int64_t product = 1;
  for (size_t i = 0; i < sizes.size(); ++i) {
    strides[i] = product;
    product *= sizes[i];
  }
  return strides;
}

}  // namespace

RankGroups masked_orthogonal_rank_groups(const std::vector<int>& axis_sizes, const std::vector<bool>& mask) {
  if (axis_sizes.size() != mask.size()) throw LayoutError("rank grid: mask and axis sizes differ in length");
  const std::vector<int64_t> global_strides = prefix_strides(axis_sizes);
  std::vector<int> masked_sizes, unmasked_sizes;
  std::vector<int64_t> masked_strides, unmasked_strides;
  for (size_t i = 0; i < axis_sizes.size(); ++i) {
    (mask[i] ? masked_sizes : unmasked_sizes).push_back(axis_sizes[i]);
    (mask[i] ? masked_strides : unmasked_strides).push_back(global_strides[i]);
  }
  // Global rank of the grid point whose masked/unmasked axis indices are decoded from two mixed-radix counters.
  const auto offset_of = [](int64_t counter, const std::vector<int>& sizes, const std::vector<int64_t>& strides) {
    int64_t offset = 0;
    for (size_t i = 0; i < sizes.size(); ++i) {
      offset += (counter % sizes[i]) * strides[i];
      counter /= sizes[i];
    }
    return offset;
  };
  int64_t group_size = 1, num_groups = 1;
  for (const int size : masked_sizes) group_size *= size;
  for (const int size : unmasked_sizes) num_groups *= size;
  RankGroups groups(static_cast<size_t>(num_groups));
  for (int64_t group = 0; group < num_groups; ++group) {
    const int64_t base = offset_of(group, unmasked_sizes, unmasked_strides);
    auto& members = groups[static_cast<size_t>(group)];
    members.reserve(static_cast<size_t>(group_size));
    for (int64_t member = 0; member < group_size; ++member) {
      members.push_back(static_cast<int>(base + offset_of(member, masked_sizes, masked_strides)));
    }
  }
  return groups;
}

RankGenerator::RankGenerator(const int tp, const int ep, const int dp, const int pp, const int cp,
                             const std::string_view order) {
  const std::array<std::pair<std::string_view, int>, 5> sizes = {
      {{"tp", tp}, {"ep", ep}, {"dp", dp}, {"pp", pp}, {"cp", cp}}};
  const std::string order_text(order);
  int64_t world = 1;
  for (const auto& [name, size] : sizes) {
    if (size < 1) {
      throw LayoutError("rank grid: size of '" + std::string(name) + "' must be >= 1, got " + std::to_string(size));
    }
    world *= size;
    if (world > std::numeric_limits<int>::max()) throw LayoutError("rank grid: world size exceeds the int range");
  }
  if (ep > 1 && cp > 1) {
    throw LayoutError(
        "rank grid: ep and cp cannot both exceed 1 in one grid (cp belongs to the dense grid, ep to the "
        "expert grid)");
  }
  for (const std::string& name : split_order(order)) {
    const auto known = std::find_if(sizes.begin(), sizes.end(), [&](const auto& entry) { return entry.first == name; });
    if (known == sizes.end()) {
      throw LayoutError("rank order '" + order_text + "': unknown parallel dimension '" + name +
                        "' (known: tp, cp, ep, dp, pp)");
    }
    if (std::find(axis_names_.begin(), axis_names_.end(), name) != axis_names_.end()) {
      throw LayoutError("rank order '" + order_text + "' names '" + name + "' twice");
    }
    axis_names_.push_back(name);
    axis_sizes_.push_back(known->second);
  }
  for (const auto& [name, size] : sizes) {
    if (std::find(axis_names_.begin(), axis_names_.end(), name) != axis_names_.end()) continue;
    if (size != 1) {
      throw LayoutError("rank order '" + order_text + "' does not name '" + std::string(name) + "', whose size is " +
                        std::to_string(size));
    }
    axis_names_.emplace_back(name);
    axis_sizes_.push_back(1);
  }
  world_size_ = static_cast<int>(world);
}

RankGroups RankGenerator::get_ranks(const std::string_view axes) const {
  std::vector<bool> mask(axis_names_.size(), false);
  for (const std::string& name : split_order(axes)) {
    const auto found = std::find(axis_names_.begin(), axis_names_.end(), name);
    if (found == axis_names_.end()) {
      throw LayoutError("rank groups '" + std::string(axes) + "': unknown parallel dimension '" + name + "'");
    }
    mask[static_cast<size_t>(found - axis_names_.begin())] = true;
  }
  return masked_orthogonal_rank_groups(axis_sizes_, mask);
}

std::string RankGenerator::order() const {
  std::string text;
  for (const std::string& name : axis_names_) {
    if (!text.empty()) text += '-';
    text += name;
  }
  return text;
}

}  // namespace moecore
