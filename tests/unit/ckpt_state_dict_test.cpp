// StateDict: placements (tensor-parallel cut, then a flat range) map local elements to the right global elements,
// scalars, and the checks add() makes. Expected global indices are worked out by hand.
#include <gtest/gtest.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "moecore/ckpt/state_dict.h"

namespace moecore {
namespace {

StatePlacement placement(const std::vector<int64_t>& full_shape, const int dim, const int segments,
                         const int num_shards, const int shard_index) {
  StatePlacement p;
  p.shard = ParamShard{dim, segments, num_shards, shard_index, full_shape};
  return p;
}

TEST(StatePlacement, ReplicatedIsTheIdentity) {
  const StatePlacement p = placement({3, 2}, 0, 1, 1, 0);
  EXPECT_EQ(local_numel(p), 6);
  for (int64_t i = 0; i < 6; ++i) EXPECT_EQ(global_index(p, i), i);
}

// Global [4, 2] with two segments along rows (SwiGLU's [gate; up]) cut over 2 ranks: rank 1 holds row 1 (its half of
// the gate rows 0-1) and row 3 (its half of the up rows 2-3).
TEST(StatePlacement, SegmentedRowShard) {
  const StatePlacement p = placement({4, 2}, 0, 2, 2, 1);
  EXPECT_EQ(local_numel(p), 4);
  const std::vector<int64_t> want = {2, 3, 6, 7};
  for (int64_t i = 0; i < 4; ++i) EXPECT_EQ(global_index(p, i), want[static_cast<size_t>(i)]) << i;
}

// Global [2, 4] cut along columns over 2 ranks: rank 0 holds columns 0-1 of both rows.
TEST(StatePlacement, ColumnShard) {
  const StatePlacement p = placement({2, 4}, 1, 1, 2, 0);
  const std::vector<int64_t> want = {0, 1, 4, 5};
  for (int64_t i = 0; i < 4; ++i) EXPECT_EQ(global_index(p, i), want[static_cast<size_t>(i)]) << i;
}

// A distributed-optimizer piece: flat elements [1, 3) of rank 1's segmented row shard above (global 3 and 6).
TEST(StatePlacement, FlatRangeOfAShard) {
  StatePlacement p = placement({4, 2}, 0, 2, 2, 1);
  p.flat_begin = 1;
  p.flat_end = 3;
  EXPECT_TRUE(p.flat());
  EXPECT_EQ(local_numel(p), 2);
  EXPECT_EQ(global_index(p, 0), 3);
  EXPECT_EQ(global_index(p, 1), 6);
}

TEST(StateDict, ScalarsAndOrder) {
  StateDict state;
  state.add_i64("iteration", 12);
  state.add_f64("num_floating_point_operations_so_far", 2.5e12);
  Tensor w(std::vector<int64_t>{2, 2}, DType::kF32);
  state.add_tensor("w", w, placement({2, 2}, 0, 1, 1, 0));
  EXPECT_EQ(state.keys(), (std::vector<std::string>{"iteration", "num_floating_point_operations_so_far", "w"}));
  EXPECT_EQ(state.i64("iteration"), 12);
  EXPECT_EQ(state.f64("num_floating_point_operations_so_far"), 2.5e12);
  EXPECT_TRUE(state.at("iteration").global_shape.empty());
  EXPECT_EQ(state.at("iteration").dtype, DType::kI64);
  EXPECT_EQ(state.at("num_floating_point_operations_so_far").dtype, DType::kF64);
  EXPECT_THROW((void)state.f64("iteration"), std::logic_error);
  EXPECT_THROW((void)state.at("missing"), std::out_of_range);
  EXPECT_EQ(state.find("missing"), nullptr);
  // Tensor entries are views: writing the live tensor shows through.
  w.data<float>()[3] = 4.0f;
  EXPECT_EQ(state.at("w").local.data<float>()[3], 4.0f);
}

TEST(StateDict, RejectsInconsistentEntries) {
  StateDict state;
  state.add_i64("step", 1);
  EXPECT_THROW(state.add_i64("step", 2), std::logic_error);  // duplicate key
  Tensor local(std::vector<int64_t>{2, 2}, DType::kF32);
  // A [4, 2] row shard over 2 ranks is [2, 2]: fine; over 4 ranks it would be [1, 2].
  EXPECT_NO_THROW(state.add_tensor("a", local, placement({4, 2}, 0, 1, 2, 1)));
  EXPECT_THROW(state.add_tensor("b", local, placement({4, 2}, 0, 1, 4, 1)), std::logic_error);
  StateEntry shape_mismatch;
  shape_mismatch.key = "c";
  shape_mismatch.global_shape = {8};
  shape_mismatch.placement = placement({4, 2}, 0, 1, 2, 1);
  shape_mismatch.local = local;
  EXPECT_THROW(state.add(shape_mismatch), std::logic_error);
  StatePlacement outside = placement({4, 2}, 0, 1, 2, 1);  // the shard has 4 elements
  outside.flat_begin = 2;
  outside.flat_end = 6;
  EXPECT_THROW(state.add_tensor("d", Tensor(std::vector<int64_t>{4}, DType::kF32), outside), std::logic_error);
  EXPECT_THROW(state.add_tensor("e", Tensor(std::vector<int64_t>{3}, DType::kF32), placement({2, 2}, 0, 1, 1, 0)),
               std::logic_error);  // 3 values for a [2, 2] tensor
  EXPECT_EQ(state.keys(), (std::vector<std::string>{"step", "a"}));
}

}  // namespace
}  // namespace moecore
