// GroupedMLP: all local experts in one pass over the grouped buffer. The row-local work (fc1, activation, probs,
// fc2, and in backward the data gradients) runs as one OpenMP loop over (expert, row tile) tasks; the weight
// gradients as one loop over (expert, fc1|fc2) tasks, each reducing over all of its expert's rows, so no two
// tasks write the same output and the result does not depend on the thread count. Inside a parallel region the ops'
// kernels run single-threaded, so the GEMMs of all experts proceed together.
//
// Scheduling by shape: an expert's rows are cut into the fewest tiles of at most kMaxTileRows (evenly sized), so an
// expert with many rows gets GEMMs big enough to run near the GEMM's peak and an expert with few rows one task.
// Tasks run largest first (dynamic schedule), which keeps both threads busy to the end when the experts' loads are
// uneven. Tiles depend on the routing only, never on the thread count, so every row goes through the same GEMM
// calls whatever the threads. Under FP8 / FP4 (ops/quantization.h) each expert is one tile: Megatron's
// TEGroupedLinear quantizes each expert's rows as one tensor, and per-tensor scales must see all of them.
#include <algorithm>

#include "moecore/moe/experts_internal.h"
#include "moecore/ops/expert_activation.h"
#include "moecore/ops/linear.h"
#include "moecore/ops/quantization.h"
#include "moecore/ops/rows.h"
#include "moecore/parallel/process_group.h"

namespace moecore::experts_detail {
namespace {

// Rows per tile at most: past this the GEMMs gain little, and smaller tasks balance better.
constexpr int64_t kMaxTileRows = 256;

struct RowTile {
  int64_t expert, begin, end;
};

std::vector<RowTile> row_tiles(const std::vector<int64_t> &offsets_E1) {
  std::vector<RowTile> tiles;
  const int64_t E = static_cast<int64_t>(offsets_E1.size()) - 1;
  const bool whole_experts = ops::linear_quantization() != nullptr;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t first = offsets_E1[e], rows = offsets_E1[e + 1] - first;
    const int64_t n = whole_experts ? (rows > 0 ? 1 : 0) : (rows + kMaxTileRows - 1) / kMaxTileRows;
    for (int64_t i = 0; i < n; ++i) tiles.push_back({e, first + rows * i / n, first + rows * (i + 1) / n});
  }
  // Largest first (ties in expert order): the dynamic schedule then ends with the small tasks.
  std::stable_sort(tiles.begin(), tiles.end(),
                   [](const RowTile &a, const RowTile &b) { return a.end - a.begin > b.end - b.begin; });
  return tiles;
}

// One expert's weight-gradient task: fc1 (W1, b1) or fc2 (W2, b2).
struct WeightTask {
  int64_t expert;
  bool fc1;
};

Tensor activation_tensor(std::vector<int64_t> shape) {
  return Tensor(std::move(shape), DType::kF32, MemCategory::kActivations);
}

// Buffers of one backward call.
struct BackwardBuffers {
  Tensor &dx_RH, &dprobs_R;
  const Tensor &dy_RH;
  Tensor dfc1_RF1;  // zero-initialised
  Tensor dxs_RH;    // probs on input: d(fc1 input), zero-initialised
};

class GroupedMLP final : public ExpertMLPBase {
 public:
  using ExpertMLPBase::ExpertMLPBase;

 private:
  const Param *fc2_bias(const int64_t e) const { return experts_[static_cast<size_t>(e)].fc2().bias(); }
  // SwiGLU with the probability after it (Megatron's default expert MLP): the fused weighted SwiGLU, which saves
  // fc2's input h = swiglu(fc1) * p instead of the activation and recomputes swiglu in backward.
  bool weighted_swiglu() const { return activation_ == ops::Activation::kSwiGLU && !probs_on_input_; }

  void run_forward(const std::vector<int64_t> &offsets_E1, Tensor &y_RH, ExpertActivations &saved) const override {
    const int64_t R = offsets_E1.back();
    saved.fc1_RF1 = activation_tensor({R, F1_});
    (weighted_swiglu() ? saved.h_RF : saved.act_RF) = activation_tensor({R, F_});
    if (probs_on_input_) {
      saved.xs_RH = activation_tensor({R, H_});
      ops::scale_rows(saved.xs_RH, saved.x_RH, saved.probs_R);
    }
    const Tensor &fc1_in = probs_on_input_ ? saved.xs_RH : saved.x_RH;
    const std::vector<RowTile> tiles = row_tiles(offsets_E1);
    const auto n_tiles = static_cast<int64_t>(tiles.size());
    saved.fc1_delayed_E.assign(static_cast<size_t>(E_), {});
    saved.fc2_delayed_E.assign(static_cast<size_t>(E_), {});
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t i = 0; i < n_tiles; ++i) {
      const RowTile &tile = tiles[static_cast<size_t>(i)];
      const auto e = static_cast<size_t>(tile.expert);
      const MLP &expert = experts_[e];
      const Tensor probs = saved.probs_R.slice_rows(tile.begin, tile.end);
      Tensor fc1 = saved.fc1_RF1.slice_rows(tile.begin, tile.end);
      const Param *b1 = expert.fc1().bias();
      const Param &w1 = expert.fc1().weight(), &w2 = expert.fc2().weight();
      // Under FP8 delayed scaling each expert is one tile (row_tiles), so no two tasks touch one scaling state.
      ops::linear_forward(fc1, fc1_in.slice_rows(tile.begin, tile.end), w1.value, b1 ? &b1->value : nullptr,
                          w1.delayed_scaling.get(), &saved.fc1_delayed_E[e]);
      // fc2's input: h = swiglu(fc1) * p (saved), the activation itself (probs on the input), or act * p in a
      // tile-sized buffer (kept in cache, not saved: backward recomputes it).
      Tensor h;
      if (weighted_swiglu()) {
        h = saved.h_RF.slice_rows(tile.begin, tile.end);
        ops::weighted_swiglu_forward(h, fc1, probs);
      } else {
        Tensor act = saved.act_RF.slice_rows(tile.begin, tile.end);
        h = probs_on_input_ ? act : activation_tensor({tile.end - tile.begin, F_});
        mlp_activation_forward(activation_, act, h, fc1, probs_on_input_ ? nullptr : &probs);
      }
      Tensor y = y_RH.slice_rows(tile.begin, tile.end);
      const Param *b2 = fc2_bias(tile.expert);
      ops::linear_forward(y, h, w2.value, probs_on_input_ && b2 ? &b2->value : nullptr, w2.delayed_scaling.get(),
                          &saved.fc2_delayed_E[e]);
      if (!probs_on_input_ && b2) ops::add_outer(y, probs, b2->value);  // y = W2 (act p) + p b2
    }
  }

  // Row-local gradients of one tile: dx, dprobs and d(fc1 output).
  void backward_tile(const RowTile &tile, BackwardBuffers &buf, const ExpertActivations &saved) const {
    const MLP &expert = experts_[static_cast<size_t>(tile.expert)];
    const Tensor probs = saved.probs_R.slice_rows(tile.begin, tile.end);
    const Tensor dy = buf.dy_RH.slice_rows(tile.begin, tile.end);
    Tensor dprobs = buf.dprobs_R.slice_rows(tile.begin, tile.end);
    Tensor dh = activation_tensor({tile.end - tile.begin, F_});
    const Param &w2 = expert.fc2().weight();
    const auto e = static_cast<size_t>(tile.expert);
    ops::linear_backward(&dh, nullptr, nullptr, dy, nullptr, w2.value, w2.delayed_scaling.get(),
                         &saved.fc2_delayed_E[e]);
    Tensor dfc1 = buf.dfc1_RF1.slice_rows(tile.begin, tile.end);
    const Tensor fc1 = saved.fc1_RF1.slice_rows(tile.begin, tile.end);
    const Param &w1 = expert.fc1().weight();
    if (!probs_on_input_) {
      if (weighted_swiglu()) {
        ops::weighted_swiglu_backward(dfc1, dprobs, dh, fc1, probs);
      } else {
        mlp_activation_backward(activation_, dfc1, &dprobs, dh, fc1, saved.act_RF.slice_rows(tile.begin, tile.end),
                                &probs);
      }
      if (const Param *b2 = fc2_bias(tile.expert)) ops::add_outer_backward(&dprobs, nullptr, dy, probs, b2->value);
      Tensor dx = buf.dx_RH.slice_rows(tile.begin, tile.end);
      ops::linear_backward(&dx, nullptr, nullptr, dfc1, nullptr, w1.value, w1.delayed_scaling.get(),
                           &saved.fc1_delayed_E[e]);
      return;
    }
    mlp_activation_backward(activation_, dfc1, nullptr, dh, fc1, saved.act_RF.slice_rows(tile.begin, tile.end),
                            nullptr);
    // fc1 input x * p: dx += d(fc1 input) p, dp = <d(fc1 input), x>.
    Tensor dxs = buf.dxs_RH.slice_rows(tile.begin, tile.end);
    ops::linear_backward(&dxs, nullptr, nullptr, dfc1, nullptr, w1.value, w1.delayed_scaling.get(),
                         &saved.fc1_delayed_E[e]);
    Tensor dx = buf.dx_RH.slice_rows(tile.begin, tile.end);
    ops::scale_rows_backward(&dx, &dprobs, dxs, saved.x_RH.slice_rows(tile.begin, tile.end), probs);
  }

  // Weight gradients of one task over its expert's rows [begin, end).
  void backward_weights(const WeightTask &task, const int64_t begin, const int64_t end, const BackwardBuffers &buf,
                        const ExpertActivations &saved) const {
    const MLP &expert = experts_[static_cast<size_t>(task.expert)];
    if (task.fc1) {
      Param &w1 = expert.fc1().weight();
      Param *b1 = expert.fc1().bias();
      const Tensor &fc1_in = probs_on_input_ ? saved.xs_RH : saved.x_RH;
      const Tensor in = fc1_in.slice_rows(begin, end);
      ops::linear_backward(nullptr, &w1.grad, b1 ? &b1->grad : nullptr, buf.dfc1_RF1.slice_rows(begin, end), &in,
                           w1.value, w1.delayed_scaling.get(), &saved.fc1_delayed_E[static_cast<size_t>(task.expert)]);
      return;
    }
    Param &w2 = expert.fc2().weight();
    Param *b2 = expert.fc2().bias();
    const Tensor dy = buf.dy_RH.slice_rows(begin, end);
    // fc2's input: saved (weighted SwiGLU, or the activation itself with probs on the input), else recomputed as
    // act * p in a buffer of this expert's rows.
    Tensor h = weighted_swiglu() ? saved.h_RF.slice_rows(begin, end) : saved.act_RF.slice_rows(begin, end);
    if (!weighted_swiglu() && !probs_on_input_) {
      h = activation_tensor({end - begin, F_});
      ops::scale_rows(h, saved.act_RF.slice_rows(begin, end), saved.probs_R.slice_rows(begin, end));
    }
    ops::linear_backward(nullptr, &w2.grad, probs_on_input_ && b2 ? &b2->grad : nullptr, dy, &h, w2.value,
                         w2.delayed_scaling.get(), &saved.fc2_delayed_E[static_cast<size_t>(task.expert)]);
    if (!probs_on_input_ && b2) {  // d(p b2)/d b2 = p
      ops::add_outer_backward(nullptr, &b2->grad, dy, saved.probs_R.slice_rows(begin, end), b2->value);
    }
  }

  void run_backward(const std::vector<int64_t> &offsets_E1, Tensor &dx_RH, Tensor &dprobs_R, const Tensor &dy_RH,
                    const ExpertActivations &saved) const override {
    const int64_t R = offsets_E1.back();
    BackwardBuffers buf{dx_RH, dprobs_R, dy_RH, activation_tensor({R, F1_}),
                        probs_on_input_ ? activation_tensor({R, H_}) : Tensor()};
    const std::vector<RowTile> tiles = row_tiles(offsets_E1);
    const auto n_tiles = static_cast<int64_t>(tiles.size());
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t i = 0; i < n_tiles; ++i) backward_tile(tiles[static_cast<size_t>(i)], buf, saved);
    parallel::drive_progress();

    // Experts with zero rows get no task: their gradients stay present and unchanged. Costliest first: rows x F1
    // x H for fc1, rows x H x F for fc2.
    std::vector<WeightTask> tasks;
    for (int64_t e = 0; e < E_; ++e) {
      if (offsets_E1[e + 1] == offsets_E1[e]) continue;
      tasks.push_back({e, true});
      tasks.push_back({e, false});
    }
    auto cost = [&](const WeightTask &t) {
      return (offsets_E1[t.expert + 1] - offsets_E1[t.expert]) * (t.fc1 ? F1_ : F_);
    };
    std::stable_sort(tasks.begin(), tasks.end(),
                     [&](const WeightTask &a, const WeightTask &b) { return cost(a) > cost(b); });
    const auto n_tasks = static_cast<int64_t>(tasks.size());
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t i = 0; i < n_tasks; ++i) {
      const WeightTask &task = tasks[static_cast<size_t>(i)];
      backward_weights(task, offsets_E1[task.expert], offsets_E1[task.expert + 1], buf, saved);
    }
  }
};

}  // namespace

std::unique_ptr<ExpertMLP> make_grouped_mlp(const MoEConfig &moe, const ModelConfig &model, const std::string &prefix,
                                            ParamStore &params, const parallel::ParallelState &parallel,
                                            const int module) {
  return std::make_unique<GroupedMLP>(moe, model, prefix, params, parallel, module);
}

}  // namespace moecore::experts_detail
