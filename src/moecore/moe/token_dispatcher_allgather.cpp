// Megatron's allgather token dispatcher: tokens, probs, routing map and token counts are all-gathered over the
// ETP x EP group (S ranks, equal T everywhere), four all-gathers in flight together, nothing packed; each rank
// permutes the gathered tokens routed to its local experts (experts in order; within an expert, source ranks in
// order, tokens ascending, and with pad-to-capacity each source's rows padded to C). Combine scatter-adds the expert
// outputs into a gathered [S T, H] buffer that is reduce-scattered back to [T, H]: that sum also adds the partial
// outputs of the ETP ranks.
#include <algorithm>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "moecore/moe/token_dispatcher_internal.h"
#include "moecore/ops/elementwise.h"
#include "moecore/ops/moe_rows.h"
#include "moecore/ops/precision.h"
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

  // Nothing to pack: token_dispatch gathers the tokens, probs, routing map and token counts as they are.
  DispatchBuffers dispatch_preprocess(const Tensor &x_TH, const RouterOutput &routing, DispatchState &state) override {
    check_tokens("allgather dispatcher", x_TH);
    const int64_t T = x_TH.dim(0), H = x_TH.dim(1), E = E_;
    if (static_cast<int64_t>(routing.tokens_per_expert_E.size()) != E_) {
      throw std::invalid_argument("allgather dispatcher: bad sizes T=" + std::to_string(T) + " H=" + std::to_string(H) +
                                  " E=" + std::to_string(routing.tokens_per_expert_E.size()) +
                                  ", expected E=" + std::to_string(E_));
    }
    check_routing(routing, T, E_);
    if (routing_map_entries(routing) != T * E) {
      throw std::invalid_argument("allgather dispatcher: the routing map must be a kU8 [T, E] tensor, got " +
                                  routing.routing_map_TE.shape_str());
    }
    state = DispatchState{};
    state.T = T;
    state.H = H;
    state.E = E;
    state.capacity = routing.capacity;
    Tensor counts_E({E}, DType::kI64, MemCategory::kActivations);
    std::copy(routing.tokens_per_expert_E.begin(), routing.tokens_per_expert_E.end(), counts_E.data<int64_t>());
    state.routing_map = routing.routing_map_TE;
    state.expert_counts = std::move(counts_E);
    return {x_TH, routing.probs_TE};
  }

  // The four all-gathers in flight together; rank s's blocks are rows [s T, s T + T) (counts [s E, s E + E)).
  DispatchBuffers token_dispatch(const DispatchBuffers &local, DispatchState &state,
                                 const std::function<void()> *overlapped) override {
    if (overlapped) (*overlapped)();
    const int64_t S = group_.size(), T = state.T, E = state.E;
    DispatchBuffers all{activation_rows({S * T, state.H}, local.rows.dtype()), activation_rows({S * T, E})};
    Tensor maps({S * T, E}, DType::kU8, MemCategory::kActivations);
    Tensor counts({S * E}, DType::kI64, MemCategory::kActivations);
    count_dispatch_bytes(local.rows.dtype(), local.rows.numel());
    count_dispatch_bytes(local.probs.dtype(), local.probs.numel());
    {
      parallel::CommTimer timer(parallel::CommKind::kAllToAll);
      parallel::Work works[] = {
          group_.all_gather_async(local.rows, all.rows), group_.all_gather_async(local.probs, all.probs),
          group_.all_gather_async(state.routing_map, maps), group_.all_gather_async(state.expert_counts, counts)};
      for (parallel::Work &work : works) work.wait();
    }
    state.routing_map = std::move(maps);
    state.expert_counts = std::move(counts);
    return all;
  }

  // Each source's rows for the local experts, laid out expert-major: [local expert][source][token].
  Tensor dispatch_postprocess(const DispatchBuffers &received, DispatchState &state) override {
    const int64_t S = group_.size(), T = state.T, H = state.H, E = E_;
    const uint8_t *maps = state.routing_map.data<uint8_t>();
    const float *probs = received.probs.data<float>();
    const int64_t *counts = state.expert_counts.data<int64_t>();
    // Source s's rows for the local experts: tokens token_SR[s], probabilities probs_SR[s], expert le's from
    // first_SX1[s][le].
    std::vector<std::vector<int64_t>> token_SR(static_cast<size_t>(S)), first_SX1(static_cast<size_t>(S));
    std::vector<Tensor> probs_SR;
    probs_SR.reserve(static_cast<size_t>(S));
    for (int64_t s = 0; s < S; ++s) {
      const std::span<const int64_t> rows_X(counts + s * E + first_expert_, static_cast<size_t>(El_));
      probs_SR.push_back(
          expert_major_rows(token_SR[static_cast<size_t>(s)], Tensor::from_blob(maps + s * T * E, {T, E}),
                            Tensor::from_blob(probs + s * T * E, {T, E}), first_expert_, rows_X, state.capacity));
      std::vector<int64_t> &first_X1 = first_SX1[static_cast<size_t>(s)];
      first_X1.assign(static_cast<size_t>(El_ + 1), 0);
      for (int64_t le = 0; le < El_; ++le) first_X1[le + 1] = first_X1[le] + rows_X[static_cast<size_t>(le)];
    }
    std::vector<float> probs_R;
    state.tokens_per_expert_E.assign(static_cast<size_t>(El_), 0);
    for (int64_t le = 0; le < El_; ++le) {
      for (int64_t s = 0; s < S; ++s) {
        const std::vector<int64_t> &token_R = token_SR[static_cast<size_t>(s)];
        const std::vector<int64_t> &first_X1 = first_SX1[static_cast<size_t>(s)];
        const float *source_probs_R = probs_SR[static_cast<size_t>(s)].data<float>();
        for (int64_t r = first_X1[le]; r < first_X1[le + 1]; ++r) {
          const int64_t t = token_R[static_cast<size_t>(r)];
          state.source_token_R.push_back(t);
          probs_R.push_back(source_probs_R[r]);
          state.source_rank_R.push_back(t < 0 ? -1 : s);
          state.gathered_row_R.push_back(t < 0 ? -1 : s * T + t);
        }
        state.tokens_per_expert_E[le] += first_X1[le + 1] - first_X1[le];
      }
      state.expert_R.insert(state.expert_R.end(), static_cast<size_t>(state.tokens_per_expert_E[le]), le);
    }
    state.probs_R = probs_tensor(probs_R);
    state.routing_map = Tensor();  // read into the bookkeeping above
    state.expert_counts = Tensor();
    Tensor x_RH = activation_rows({static_cast<int64_t>(state.gathered_row_R.size()), H}, received.rows.dtype());
    ops::moe_permute(x_RH, received.rows, state.gathered_row_R);
    return x_RH;
  }

  // Every rank's rows scatter-added into the gathered [S T, H] buffer ...
  Tensor combine_preprocess(const Tensor &y_RH, const DispatchState &state) override {
    Tensor all = activation_rows({group_.size() * state.T, state.H});
    ops::moe_unpermute(all, y_RH, state.gathered_row_R);
    return all;
  }
  // ... summed over the group, this rank's slice ...
  Tensor token_combine(const Tensor &all, const DispatchState &state) override {
    Tensor mine = activation_rows({state.T, state.H});
    count_dispatch_bytes(all.dtype(), all.numel());
    parallel::CommTimer timer(parallel::CommKind::kAllToAll);
    group_.reduce_scatter(all, mine, parallel::ReduceOp::kSum);
    return mine;
  }
  // ... added to the output.
  void combine_postprocess(Tensor &out_TH, const Tensor &mine, const DispatchState & /*state*/) override {
    const ops::ScopedActivationDType fp32(DType::kF32);  // the reduced sum is added as it came (16-bit rows summed)
    ops::add_(out_TH, mine);
  }

  void combine_backward(Tensor &dy_RH, const Tensor &dout_TH, const DispatchState &state,
                        const std::function<void()> *overlapped) override {
    if (overlapped) (*overlapped)();
    Tensor all = activation_rows({group_.size() * state.T, state.H}, dout_TH.dtype());
    count_dispatch_bytes(dout_TH.dtype(), dout_TH.numel());
    {
      parallel::CommTimer timer(parallel::CommKind::kAllToAll);
      group_.all_gather(dout_TH, all);
    }
    ops::moe_unpermute_backward(&dy_RH, nullptr, all, state.gathered_row_R);
  }

  void probs_backward(Tensor &dprobs_TE, const Tensor &dprobs_R, const DispatchState &state) override {
    const int64_t T = state.T, E = state.E;
    std::vector<int64_t> element_R(state.gathered_row_R.size());
    for (size_t r = 0; r < element_R.size(); ++r) {
      const int64_t g = state.gathered_row_R[r];
      element_R[r] = g < 0 ? -1 : g * E + first_expert_ + state.expert_R[r];
    }
    const ops::ScopedActivationDType fp32(DType::kF32);  // router gradients stay fp32
    Tensor all = activation_rows({group_.size() * T * E, 1});
    ops::moe_unpermute(all, dprobs_R, element_R);
    Tensor mine = activation_rows({T, E});
    count_dispatch_bytes(all.dtype(), all.numel());
    {
      parallel::CommTimer timer(parallel::CommKind::kAllToAll);
      group_.reduce_scatter(all, mine, parallel::ReduceOp::kSum);
    }
    ops::add_(dprobs_TE, mine);
  }

 private:
  int64_t E_, El_, first_expert_;
  parallel::ProcessGroup group_;
};

}  // namespace

std::unique_ptr<TokenDispatcher> make_allgather_dispatcher(const int64_t num_experts,
                                                           const parallel::ParallelState &parallel) {
  return std::make_unique<AllGatherDispatcher>(num_experts, parallel);
}

}  // namespace moecore::detail
