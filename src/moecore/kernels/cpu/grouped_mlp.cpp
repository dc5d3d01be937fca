// Grouped expert MLP over row tiles of all experts at once (scheduling: grouped_mlp.h). Each tile's steps
// (grouped_mlp_steps.h) run inside the parallel loop, where the kernels they call run on one thread.
#include "moecore/kernels/cpu/grouped_mlp.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "moecore/kernels/cpu/activation.h"
#include "moecore/kernels/cpu/convert.h"
#include "moecore/kernels/cpu/expert_activation.h"
#include "moecore/kernels/cpu/gemm.h"
#include "moecore/kernels/cpu/grouped_mlp_steps.h"
#include "moecore/kernels/cpu/rows.h"

namespace moecore::kernels::cpu {
namespace {

MOECORE_GROUPED_MLP_KERNELS(Kernels, cpu)

template <typename T>
using Steps = grouped_mlp_detail::Steps<Kernels, T>;

struct RowTile {
  int64_t expert, begin, end;
};

// Every expert's rows in the fewest even tiles of at most kGroupedMlpTileRows, largest first (ties in expert
// order): the dynamic schedule then ends with the small tasks.
std::vector<RowTile> row_tiles(const GroupedMlpShape& s) {
  std::vector<RowTile> tiles;
  for (int64_t e = 0; e < s.E; ++e) {
    const int64_t first = s.offsets_E1[e], rows = s.offsets_E1[e + 1] - first;
    const int64_t n = (rows + kGroupedMlpTileRows - 1) / kGroupedMlpTileRows;
    for (int64_t i = 0; i < n; ++i) tiles.push_back({e, first + rows * i / n, first + rows * (i + 1) / n});
  }
  std::stable_sort(tiles.begin(), tiles.end(),
                   [](const RowTile& a, const RowTile& b) { return a.end - a.begin > b.end - b.begin; });
  return tiles;
}

}  // namespace

template <typename T>
void grouped_mlp_forward(T* y_RH, T* fc1_RF1, T* act_RF, T* h_RF, T* xs_RH, const T* x_RH, const T* probs_R,
                         const GroupedMlpWeights<T>& w, const GroupedMlpShape& s) {
  const Steps<T> steps(w, s);
  const std::vector<RowTile> tiles = row_tiles(s);
  const auto n_tiles = static_cast<int64_t>(tiles.size());
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t i = 0; i < n_tiles; ++i) {
    const RowTile& tile = tiles[static_cast<size_t>(i)];
    steps.forward(tile.expert, tile.begin, tile.end, y_RH, fc1_RF1, act_RF, h_RF, xs_RH, x_RH, probs_R);
  }
}

template <typename T>
void grouped_mlp_backward(T* dx_RH, T* dprobs_R, const GroupedMlpGrads<T>& g, T* dfc1_RF1, const T* dy_RH,
                          const T* x_RH, const T* xs_RH, const T* fc1_RF1, const T* act_RF, const T* h_RF,
                          const T* probs_R, const GroupedMlpWeights<T>& w, const GroupedMlpShape& s) {
  const Steps<T> steps(w, s);
  const std::vector<RowTile> tiles = row_tiles(s);
  const auto n_tiles = static_cast<int64_t>(tiles.size());
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t i = 0; i < n_tiles; ++i) {
    const RowTile& tile = tiles[static_cast<size_t>(i)];
    steps.backward_data(tile.expert, tile.begin, tile.end, dx_RH, dprobs_R, dfc1_RF1, dy_RH, x_RH, fc1_RF1, act_RF,
                        probs_R);
  }
  // One task per (expert, fc1 | fc2), experts with rows only (the others keep their gradients), costliest first:
  // rows x F1 x H for fc1, rows x H x F for fc2.
  std::vector<std::pair<int64_t, bool>> tasks;
  for (int64_t e = 0; e < s.E; ++e) {
    if (s.offsets_E1[e + 1] == s.offsets_E1[e]) continue;
    tasks.emplace_back(e, true);
    tasks.emplace_back(e, false);
  }
  const auto cost = [&](const std::pair<int64_t, bool>& t) {
    return (s.offsets_E1[t.first + 1] - s.offsets_E1[t.first]) * (t.second ? s.F1() : s.F);
  };
  std::stable_sort(tasks.begin(), tasks.end(), [&](const auto& a, const auto& b) { return cost(a) > cost(b); });
  const auto n_tasks = static_cast<int64_t>(tasks.size());
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t i = 0; i < n_tasks; ++i) {
    const auto [e, fc1] = tasks[static_cast<size_t>(i)];
    steps.weight_grads(e, fc1, s.offsets_E1[e], s.offsets_E1[e + 1], g, dfc1_RF1, dy_RH, x_RH, xs_RH, act_RF, h_RF,
                       probs_R);
  }
}

#define MOECORE_INSTANTIATE(T)                                                                                         \
  template void grouped_mlp_forward<T>(T*, T*, T*, T*, T*, const T*, const T*, const GroupedMlpWeights<T>&,            \
                                       const GroupedMlpShape&);                                                        \
  template void grouped_mlp_backward<T>(T*, T*, const GroupedMlpGrads<T>&, T*, const T*, const T*, const T*, const T*, \
                                        const T*, const T*, const T*, const GroupedMlpWeights<T>&,                     \
                                        const GroupedMlpShape&);
MOECORE_INSTANTIATE(float)
MOECORE_INSTANTIATE(double)
#undef MOECORE_INSTANTIATE

}  // namespace moecore::kernels::cpu
