// Megatron's allgather token dispatcher: tokens, probs and routing map are all-gathered over the ETP x EP group
// (S ranks, equal T everywhere); each rank permutes the gathered tokens routed to its local experts (experts in
// order; within an expert, source ranks in order, tokens ascending, and with pad-to-capacity each source's rows
// padded to C). Combine scatter-adds the expert outputs into a gathered [S T, H] buffer that is reduce-scattered
// back to [T, H]: that sum also adds the partial outputs of the ETP ranks.
#include <algorithm>
#include <cstring>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "moecore/moe/token_dispatcher_internal.h"
#include "moecore/parallel/comm_stats.h"

namespace moecore::detail {
namespace {

class AllGatherDispatcher final : public TokenDispatcher {
 public:
  AllGatherDispatcher(const int64_t num_experts, const parallel::ParallelState &parallel)
      : E_(num_experts),
        El_(num_experts / parallel.ep_size()),
        first_expert_(parallel.ep_rank() * (num_experts / parallel.ep_size())),
        group_(parallel.tp_ep) {}

  Tensor dispatch(const float *x_TH, const int64_t T, const int64_t H, const RouterOutput &routing,
                  DispatchState &state) override {
    if (T < 0 || H <= 0 || static_cast<int64_t>(routing.tokens_per_expert_E.size()) != E_) {
      throw std::invalid_argument("allgather dispatcher: bad sizes T=" + std::to_string(T) + " H=" + std::to_string(H) +
                                  " E=" + std::to_string(routing.tokens_per_expert_E.size()) +
                                  ", expected E=" + std::to_string(E_));
    }
    check_routing(routing, T, E_);
    const int64_t S = group_.size(), E = E_;
    // One all-gather of [x_TH | probs_TE | map_TE | tokens_per_expert_E] per rank (counts are exact in fp32).
    const int64_t chunk = T * H + 2 * T * E + E;
    std::vector<float> mine(static_cast<size_t>(chunk));
    std::memcpy(mine.data(), x_TH, sizeof(float) * static_cast<size_t>(T * H));
    std::memcpy(mine.data() + T * H, routing.probs_TE.data<float>(), sizeof(float) * static_cast<size_t>(T * E));
    float *map_part = mine.data() + T * H + T * E;
    for (int64_t i = 0; i < T * E; ++i) map_part[i] = routing.routing_map_TE.data<uint8_t>()[i] != 0 ? 1.0f : 0.0f;
    float *counts_part = map_part + T * E;
    for (int64_t e = 0; e < E; ++e) counts_part[e] = static_cast<float>(routing.tokens_per_expert_E[e]);
    std::vector<float> all(static_cast<size_t>(S * chunk));
    {
      parallel::CommTimer timer(parallel::CommKind::kAllToAll);
      group_.all_gather<float>(mine, all);
    }
    mine = std::vector<float>();

    state = DispatchState{};
    state.T = T;
    state.H = H;
    state.E = E;
    // Each source's rows for the local experts, then laid out expert-major: [local expert][source][token].
    std::vector<ExpertMajorRows> by_source;
    by_source.reserve(static_cast<size_t>(S));
    for (int64_t s = 0; s < S; ++s) {
      const float *base = all.data() + s * chunk;
      std::vector<int64_t> rows_X(static_cast<size_t>(El_));
      for (int64_t le = 0; le < El_; ++le) {
        rows_X[static_cast<size_t>(le)] = static_cast<int64_t>(base[T * H + 2 * T * E + first_expert_ + le]);
      }
      by_source.push_back(expert_major_rows(base + T * H + T * E, base + T * H, T, E, first_expert_,
                                            first_expert_ + El_, rows_X, routing.capacity));
    }
    state.tokens_per_expert_E.assign(static_cast<size_t>(El_), 0);
    for (int64_t le = 0; le < El_; ++le) {
      for (int64_t s = 0; s < S; ++s) {
        const ExpertMajorRows &src = by_source[static_cast<size_t>(s)];
        for (int64_t r = src.offsets_X1[le]; r < src.offsets_X1[le + 1]; ++r) {
          const int64_t t = src.token_R[static_cast<size_t>(r)];
          state.source_token_R.push_back(t);
          state.probs_R.push_back(src.probs_R[static_cast<size_t>(r)]);
          state.source_rank_R.push_back(t < 0 ? -1 : s);
          state.gathered_row_R.push_back(t < 0 ? -1 : s * T + t);
        }
        state.tokens_per_expert_E[le] += src.offsets_X1[le + 1] - src.offsets_X1[le];
      }
      state.expert_R.insert(state.expert_R.end(), static_cast<size_t>(state.tokens_per_expert_E[le]), le);
    }

    const int64_t R = static_cast<int64_t>(state.source_token_R.size());
    Tensor x_RH({R, H}, DType::kF32, MemCategory::kActivations);
    // Gathered x rows of rank s start at s * chunk, not s * T * H: gather row by row.
#pragma omp parallel for schedule(static) if (R * H > 16384)
    for (int64_t r = 0; r < R; ++r) {
      float *dst = x_RH.data<float>() + r * H;
      const int64_t t = state.source_token_R[r];
      if (t < 0) {
        std::fill_n(dst, H, 0.0f);
      } else {
        std::memcpy(dst, all.data() + state.source_rank_R[r] * chunk + t * H, sizeof(float) * static_cast<size_t>(H));
      }
    }
    return x_RH;
  }

  void combine(float *out_TH, const float *y_RH, const DispatchState &state) override {
    scatter_and_reduce(out_TH, y_RH, state);
  }

  void combine_backward(float *dy_RH, const float *dout_TH, const DispatchState &state) override {
    const int64_t T = state.T, H = state.H;
    std::vector<float> all(static_cast<size_t>(group_.size() * T * H));
    {
      parallel::CommTimer timer(parallel::CommKind::kAllToAll);
      group_.all_gather<float>(std::span<const float>(dout_TH, static_cast<size_t>(T * H)), all);
    }
    gather_rows(dy_RH, all.data(), state.gathered_row_R, H);
  }

  void dispatch_backward(float *dx_TH, const float *dx_RH, const DispatchState &state) override {
    scatter_and_reduce(dx_TH, dx_RH, state);
  }

  void probs_backward(float *dprobs_TE, const float *dprobs_R, const DispatchState &state) override {
    const int64_t T = state.T, E = state.E;
    std::vector<float> all(static_cast<size_t>(group_.size() * T * E), 0.0f);
    const int64_t R = static_cast<int64_t>(state.gathered_row_R.size());
    for (int64_t r = 0; r < R; ++r) {
      const int64_t g = state.gathered_row_R[r];
      if (g >= 0) all[g * E + first_expert_ + state.expert_R[r]] += dprobs_R[r];
    }
    std::vector<float> mine(static_cast<size_t>(T * E));
    {
      parallel::CommTimer timer(parallel::CommKind::kAllToAll);
      group_.reduce_scatter<float>(all, mine, parallel::ReduceOp::kSum);
    }
    for (int64_t i = 0; i < T * E; ++i) dprobs_TE[i] += mine[i];
  }

 private:
  // out_TH += this rank's slice of the sum over the group of every rank's rows scatter-added into [S T, H].
  void scatter_and_reduce(float *out_TH, const float *rows_RH, const DispatchState &state) const {
    const int64_t T = state.T, H = state.H, S = group_.size();
    std::vector<float> all(static_cast<size_t>(S * T * H), 0.0f);
    scatter_add_rows(all.data(), S * T, rows_RH, state.gathered_row_R, H);
    std::vector<float> mine(static_cast<size_t>(T * H));
    {
      parallel::CommTimer timer(parallel::CommKind::kAllToAll);
      group_.reduce_scatter<float>(all, mine, parallel::ReduceOp::kSum);
    }
    for (int64_t i = 0; i < T * H; ++i) out_TH[i] += mine[i];
  }

  int64_t E_, El_, first_expert_;
  parallel::ProcessGroup group_;
};

}  // namespace

std::unique_ptr<TokenDispatcher> make_allgather_dispatcher(const int64_t num_experts,
                                                           const parallel::ParallelState &parallel) {
  return std::make_unique<AllGatherDispatcher>(num_experts, parallel);
}

}  // namespace moecore::detail
