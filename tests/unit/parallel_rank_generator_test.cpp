#include <gtest/gtest.h>

#include <map>
#include <string>
#include <vector>

#include "moecore/parallel/rank_generator.h"

namespace moecore {
namespace {

// Independent reference: visit every grid point with nested mixed-radix counting, compute its rank from the
// stride rule, and bucket ranks by their coordinates on the unmasked axes. Buckets are then ordered by the
// unmasked coordinates read as a number with the first unmasked axis least significant, and members likewise by
// their masked coordinates; this is the enumeration order Megatron documents.
RankGroups brute_force_groups(const std::vector<int>& sizes, const std::vector<bool>& mask) {
  const size_t axes = sizes.size();
  int world = 1;
  for (const int size : sizes) world *= size;
  // key: (unmasked coordinate number) -> (masked coordinate number -> rank)
  std::map<int, std::map<int, int>> buckets;
  std::vector<int> coords(axes, 0);
  for (int point = 0; point < world; ++point) {
    int rank = 0, stride = 1, masked_key = 0, masked_radix = 1, unmasked_key = 0, unmasked_radix = 1;
    for (size_t a = 0; a < axes; ++a) {
      rank += coords[a] * stride;
      stride *= sizes[a];
      if (mask[a]) {
        masked_key += coords[a] * masked_radix;
        masked_radix *= sizes[a];
      } else {
        unmasked_key += coords[a] * unmasked_radix;
        unmasked_radix *= sizes[a];
      }
    }
    buckets[unmasked_key][masked_key] = rank;
    for (size_t a = 0; a < axes; ++a) {  // odometer increment
      if (++coords[a] < sizes[a]) break;
      coords[a] = 0;
    }
  }
  RankGroups groups;
  for (const auto& [key, members] : buckets) {
    groups.emplace_back();
    for (const auto& [member_key, rank] : members) groups.back().push_back(rank);
  }
  return groups;
}

TEST(MaskedOrthogonalRankGroups, TpPpDpExampleByHand) {
  // tp=2, pp=3, dp=4 in order tp-pp-dp: rank = t + 2p + 6d.
  const std::vector<int> sizes = {2, 3, 4};
  EXPECT_EQ(
      masked_orthogonal_rank_groups(sizes, {false, false, true}),
      (RankGroups{{0, 6, 12, 18}, {1, 7, 13, 19}, {2, 8, 14, 20}, {3, 9, 15, 21}, {4, 10, 16, 22}, {5, 11, 17, 23}}));
  EXPECT_EQ(masked_orthogonal_rank_groups(sizes, {true, false, true}),
            (RankGroups{{0, 1, 6, 7, 12, 13, 18, 19}, {2, 3, 8, 9, 14, 15, 20, 21}, {4, 5, 10, 11, 16, 17, 22, 23}}));
  EXPECT_EQ(masked_orthogonal_rank_groups(sizes, {false, true, false}),
            (RankGroups{
                {0, 2, 4}, {1, 3, 5}, {6, 8, 10}, {7, 9, 11}, {12, 14, 16}, {13, 15, 17}, {18, 20, 22}, {19, 21, 23}}));
  EXPECT_EQ(masked_orthogonal_rank_groups(sizes, {true, true, true}),
            (RankGroups{{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23}}));
  RankGroups singletons;
  for (int r = 0; r < 24; ++r) singletons.push_back({r});
  EXPECT_EQ(masked_orthogonal_rank_groups(sizes, {false, false, false}), singletons);
}

TEST(MaskedOrthogonalRankGroups, MatchesBruteForceForEveryMask) {
  const std::vector<std::vector<int>> grids = {{2, 3, 1, 4, 2}, {3, 1, 2, 2, 5}, {1, 4, 3, 1, 2}, {2, 2, 2, 2, 2}};
  for (const auto& sizes : grids) {
    for (int bits = 0; bits < (1 << sizes.size()); ++bits) {
      std::vector<bool> mask(sizes.size());
      for (size_t a = 0; a < sizes.size(); ++a) mask[a] = (bits >> a) & 1;
      EXPECT_EQ(masked_orthogonal_rank_groups(sizes, mask), brute_force_groups(sizes, mask))
          << "grid " << ::testing::PrintToString(sizes) << " mask " << bits;
    }
  }
}

TEST(RankGenerator, AppendsOmittedUnitAxesToTheOrder) {
  const RankGenerator generator(/*tp=*/2, /*ep=*/1, /*dp=*/3, /*pp=*/2, /*cp=*/1, "tp-pp-dp");
  EXPECT_EQ(generator.order(), "tp-pp-dp-ep-cp");
  EXPECT_EQ(generator.world_size(), 12);
  // rank = t + 2p + 4d
  EXPECT_EQ(generator.get_ranks("pp"), (RankGroups{{0, 2}, {1, 3}, {4, 6}, {5, 7}, {8, 10}, {9, 11}}));
  EXPECT_EQ(generator.get_ranks("dp"), (RankGroups{{0, 4, 8}, {1, 5, 9}, {2, 6, 10}, {3, 7, 11}}));
  EXPECT_EQ(generator.get_ranks("cp").size(), 12u);
}

TEST(RankGenerator, AxisNamesInAGroupTokenMayComeInAnyOrder) {
  const RankGenerator generator(2, 1, 2, 2, 2, "tp-cp-ep-dp-pp");
  EXPECT_EQ(generator.get_ranks("dp-cp"), generator.get_ranks("cp-dp"));
  EXPECT_EQ(generator.get_ranks("tp-dp-cp"), generator.get_ranks("cp-tp-dp"));
}

TEST(RankGenerator, RejectsBadOrdersAndSizes) {
  EXPECT_THROW(RankGenerator(1, 4, 2, 1, 1, "tp-dp-pp"), LayoutError);  // ep=4 absent from the order
  EXPECT_THROW(RankGenerator(1, 1, 2, 1, 1, "tp-xx-dp"), LayoutError);
  EXPECT_THROW(RankGenerator(1, 1, 2, 1, 1, "tp-dp-tp"), LayoutError);
  EXPECT_THROW(RankGenerator(1, 2, 2, 1, 2, "tp-cp-ep-dp-pp"), LayoutError);  // ep and cp both > 1
  EXPECT_THROW(RankGenerator(0, 1, 2, 1, 1, "tp-cp-ep-dp-pp"), LayoutError);
  const RankGenerator generator(2, 1, 2, 1, 1, "tp-cp-ep-dp-pp");
  EXPECT_THROW(generator.get_ranks("tp-zz"), LayoutError);
  try {
    RankGenerator(1, 4, 2, 1, 1, "tp-dp-pp");
    FAIL();
  } catch (const LayoutError& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("'ep'"), std::string::npos) << message;
    EXPECT_NE(message.find("tp-dp-pp"), std::string::npos) << message;
    EXPECT_EQ(message.find('\n'), std::string::npos);
  }
}

}  // namespace
}  // namespace moecore
