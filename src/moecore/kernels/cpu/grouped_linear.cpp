// Grouped linear layer over row tiles of all experts at once (scheduling: grouped_linear.h). Each tile is one call
// of the linear kernels (gemm.h) inside the parallel loop, where they run on one thread.
#include "moecore/kernels/cpu/grouped_linear.h"

#include <algorithm>
#include <vector>

#include "moecore/kernels/cpu/gemm.h"

namespace moecore::kernels::cpu {
namespace {

struct RowTile {
  int64_t expert, begin, end;
};

// Every expert's rows in the fewest even tiles of at most kGroupedLinearTileRows, largest first (ties in expert
// order): the dynamic schedule then ends with the small tasks.
std::vector<RowTile> row_tiles(const int64_t* offsets_E1, const int64_t E) {
  std::vector<RowTile> tiles;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t first = offsets_E1[e], rows = offsets_E1[e + 1] - first;
    const int64_t n = (rows + kGroupedLinearTileRows - 1) / kGroupedLinearTileRows;
    for (int64_t i = 0; i < n; ++i) tiles.push_back({e, first + rows * i / n, first + rows * (i + 1) / n});
  }
  std::stable_sort(tiles.begin(), tiles.end(),
                   [](const RowTile& a, const RowTile& b) { return a.end - a.begin > b.end - b.begin; });
  return tiles;
}

}  // namespace

template <typename T>
void grouped_linear_forward(T* out_RO, const T* x_RI, const T* const* weight_E, const T* const* bias_E,
                            const int64_t* offsets_E1, const int64_t E, const int64_t I, const int64_t O) {
  const std::vector<RowTile> tiles = row_tiles(offsets_E1, E);
  const auto n_tiles = static_cast<int64_t>(tiles.size());
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t i = 0; i < n_tiles; ++i) {
    const RowTile& tile = tiles[static_cast<size_t>(i)];
    linear_forward(out_RO + tile.begin * O, x_RI + tile.begin * I, weight_E[tile.expert],
                   bias_E == nullptr ? nullptr : bias_E[tile.expert], tile.end - tile.begin, I, O);
  }
}

template <typename T>
void grouped_linear_backward(T* dx_RI, T* const* dweight_E, T* const* dbias_E, const T* dout_RO, const T* x_RI,
                             const T* const* weight_E, const int64_t* offsets_E1, const int64_t E, const int64_t I,
                             const int64_t O) {
  if (dx_RI != nullptr) {
    const std::vector<RowTile> tiles = row_tiles(offsets_E1, E);
    const auto n_tiles = static_cast<int64_t>(tiles.size());
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t i = 0; i < n_tiles; ++i) {
      const RowTile& tile = tiles[static_cast<size_t>(i)];
      linear_backward(dx_RI + tile.begin * I, static_cast<T*>(nullptr), static_cast<T*>(nullptr),
                      dout_RO + tile.begin * O, static_cast<const T*>(nullptr), weight_E[tile.expert],
                      tile.end - tile.begin, I, O);
    }
  }
  // One task per expert with rows and a gradient to form, costliest (most rows) first; an expert without rows
  // keeps its gradients as they are.
  std::vector<int64_t> experts;
  for (int64_t e = 0; e < E; ++e) {
    const bool wanted =
        (dweight_E != nullptr && dweight_E[e] != nullptr) || (dbias_E != nullptr && dbias_E[e] != nullptr);
    if (wanted && offsets_E1[e + 1] > offsets_E1[e]) experts.push_back(e);
  }
  std::stable_sort(experts.begin(), experts.end(), [&](const int64_t a, const int64_t b) {
    return offsets_E1[a + 1] - offsets_E1[a] > offsets_E1[b + 1] - offsets_E1[b];
  });
  const auto n_tasks = static_cast<int64_t>(experts.size());
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t i = 0; i < n_tasks; ++i) {
    const int64_t e = experts[static_cast<size_t>(i)], begin = offsets_E1[e];
    linear_backward(static_cast<T*>(nullptr), dweight_E == nullptr ? nullptr : dweight_E[e],
                    dbias_E == nullptr ? nullptr : dbias_E[e], dout_RO + begin * O, x_RI + begin * I, weight_E[e],
                    offsets_E1[e + 1] - begin, I, O);
  }
}

#define MOECORE_INSTANTIATE(T)                                                                                     \
  template void grouped_linear_forward<T>(T*, const T*, const T* const*, const T* const*, const int64_t*, int64_t, \
                                          int64_t, int64_t);                                                       \
  template void grouped_linear_backward<T>(T*, T* const*, T* const*, const T*, const T*, const T* const*,          \
                                           const int64_t*, int64_t, int64_t, int64_t);
MOECORE_INSTANTIATE(float)
MOECORE_INSTANTIATE(double)
#undef MOECORE_INSTANTIATE

}  // namespace moecore::kernels::cpu
