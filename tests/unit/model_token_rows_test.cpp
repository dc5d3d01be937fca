// TokenRows: Megatron's load-balanced context-parallel split (chunks r and 2 CP - 1 - r of 2 CP) and
// sequence-parallel slices of it, checked row by row against the one-process row numbers worked out by hand.
#include <gtest/gtest.h>

#include <vector>

#include "moecore/model/token_rows.h"

namespace moecore {
namespace {

std::vector<int64_t> globals(const TokenRows& rows) {
  std::vector<int64_t> out;
  for (int64_t t = 0; t < rows.count(); ++t) out.push_back(rows.global(t));
  return out;
}

TEST(TokenRows, ContextParallelSplitIsLoadBalanced) {
  // S = 8, B = 2, CP = 2: chunks of 2 positions (4 rows); rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2.
  EXPECT_EQ(globals(TokenRows::context_parallel(8, 2, 0, 2)), (std::vector<int64_t>{0, 1, 2, 3, 12, 13, 14, 15}));
  EXPECT_EQ(globals(TokenRows::context_parallel(8, 2, 1, 2)), (std::vector<int64_t>{4, 5, 6, 7, 8, 9, 10, 11}));
  EXPECT_EQ(globals(TokenRows::context_parallel(8, 1, 0, 1)), (std::vector<int64_t>{0, 1, 2, 3, 4, 5, 6, 7}));
  EXPECT_THROW(TokenRows::context_parallel(6, 1, 0, 2), std::invalid_argument);  // 6 % (2 x 2) != 0
}

TEST(TokenRows, SliceKeepsTheOneProcessRows) {
  const TokenRows rows = TokenRows::context_parallel(8, 2, 0, 2);              // 0 1 2 3 | 12 13 14 15
  EXPECT_EQ(globals(rows.slice(2, 4)), (std::vector<int64_t>{2, 3, 12, 13}));  // across the two chunks
  EXPECT_EQ(rows.slice(2, 4).runs().size(), 2u);
  EXPECT_EQ(globals(rows.slice(4, 4)), (std::vector<int64_t>{12, 13, 14, 15}));
  EXPECT_TRUE(rows.slice(4, 4).contiguous());
  EXPECT_EQ(globals(TokenRows::contiguous(5, 3)), (std::vector<int64_t>{5, 6, 7}));
  EXPECT_THROW(rows.slice(6, 4), std::out_of_range);
  EXPECT_THROW(rows.global(8), std::out_of_range);
}

}  // namespace
}  // namespace moecore
