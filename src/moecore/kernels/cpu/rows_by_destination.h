// Internal to kernels/cpu: the rows that go to each destination, in ascending row order (CSR), so the scatter-adds
// (scatter_add_rows, moe_unpermute) run destinations in parallel and each sums its rows in one order whatever the
// thread count.
#pragma once

#include <cstdint>
#include <vector>

namespace moecore::kernels::cpu::detail {

struct RowsByDestination {
  std::vector<int64_t> begin_N1;  // destination n's rows are rows[begin_N1[n] .. begin_N1[n + 1])
  std::vector<int64_t> rows;
};

// Rows with a negative index go nowhere.
inline RowsByDestination rows_by_destination(const int64_t* index_R, const int64_t R, const int64_t N) {
  RowsByDestination out;
  out.begin_N1.assign(static_cast<size_t>(N + 1), 0);
  for (int64_t r = 0; r < R; ++r) {
    if (index_R[r] >= 0) ++out.begin_N1[static_cast<size_t>(index_R[r] + 1)];
  }
  for (int64_t n = 0; n < N; ++n) out.begin_N1[n + 1] += out.begin_N1[n];
  out.rows.resize(static_cast<size_t>(out.begin_N1.back()));
  std::vector<int64_t> fill(out.begin_N1.begin(), out.begin_N1.end() - 1);
  for (int64_t r = 0; r < R; ++r) {
    if (index_R[r] >= 0) out.rows[static_cast<size_t>(fill[static_cast<size_t>(index_R[r])]++)] = r;
  }
  return out;
}

}  // namespace moecore::kernels::cpu::detail
