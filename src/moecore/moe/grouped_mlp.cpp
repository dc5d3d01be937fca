// GroupedMLP: all local experts in one pass over the grouped buffer. The
// row-local work (fc1, activation, probs, fc2, and in backward the data
// gradients) runs as one OpenMP loop over (expert, row tile) tasks; the weight
// gradients as one loop over (expert, fc1|fc2) tasks, each reducing over all of
// its expert's rows, so no two tasks write the same output and the result does
// not depend on the thread count. Inside a parallel region OpenBLAS (OpenMP
// build) runs each GEMM single-threaded, so the GEMMs of all experts proceed
// together.
#include <algorithm>

#include "moecore/moe/experts_internal.h"

namespace moecore::experts_detail {
namespace {

// Rows per task: big enough for efficient GEMMs, small enough to balance uneven
// experts over the threads.
constexpr int64_t kTileRows = 64;

struct RowTile {
  int64_t expert, row_begin, rows;
};

std::vector<RowTile> row_tiles(const std::vector<int64_t> &offsets_E1) {
  std::vector<RowTile> tiles;
  const int64_t E = static_cast<int64_t>(offsets_E1.size()) - 1;
  for (int64_t e = 0; e < E; ++e) {
    for (int64_t r = offsets_E1[e]; r < offsets_E1[e + 1]; r += kTileRows) {
      tiles.push_back({e, r, std::min(kTileRows, offsets_E1[e + 1] - r)});
    }
  }
  return tiles;
}

class GroupedMLP final : public ExpertMLPBase {
 public:
  using ExpertMLPBase::ExpertMLPBase;

 private:
  void run_forward(const std::vector<int64_t> &offsets_E1, const ForwardBuffers &buf) const override {
    const std::vector<RowTile> tiles = row_tiles(offsets_E1);
    const int64_t n_tiles = static_cast<int64_t>(tiles.size());
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t i = 0; i < n_tiles; ++i) forward_rows(tiles[i].expert, tiles[i].row_begin, tiles[i].rows, buf);
  }

  void run_backward(const std::vector<int64_t> &offsets_E1, const BackwardBuffers &buf) const override {
    const std::vector<RowTile> tiles = row_tiles(offsets_E1);
    const int64_t n_tiles = static_cast<int64_t>(tiles.size());
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t i = 0; i < n_tiles; ++i) backward_rows(tiles[i].expert, tiles[i].row_begin, tiles[i].rows, buf);

    // Experts with zero rows get no task: their gradients stay present and
    // unchanged.
    std::vector<int64_t> busy_experts;
    for (int64_t e = 0; e < E_; ++e) {
      if (offsets_E1[e + 1] > offsets_E1[e]) busy_experts.push_back(e);
    }
    const int64_t n_tasks = 2 * static_cast<int64_t>(busy_experts.size());
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t i = 0; i < n_tasks; ++i) {
      const int64_t e = busy_experts[i / 2];
      backward_weights(e, offsets_E1[e], offsets_E1[e + 1] - offsets_E1[e], static_cast<int>(i % 2), buf);
    }
  }
};

}  // namespace

std::unique_ptr<ExpertMLP> make_grouped_mlp(const MoEConfig &moe, const ModelConfig &model, const std::string &prefix,
                                            std::vector<Param> &params, const parallel::ParallelState &parallel,
                                            const int module) {
  return std::make_unique<GroupedMLP>(moe, model, prefix, params, parallel, module);
}

}  // namespace moecore::experts_detail
