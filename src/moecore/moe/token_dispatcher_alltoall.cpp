// Megatron's alltoall token dispatcher (megatron/core/transformer/moe/token_dispatcher.py,
// MoEAlltoAllTokenDispatcher). Forward: permute this rank's T tokens expert-major over all E experts (tokens
// ascending within an expert, padded to C rows per expert with pad-to-capacity); exchange the rows per expert as
// integers (preprocess: input_splits, output_splits, num_global_tokens_per_local_expert); all-to-all the rows and
// their probs over EP (EP rank d gets the rows of its experts); all-gather-v over ETP (every ETP rank gets its
// peers' rows too); sort the chunks from [ETP rank][EP source][local expert] to [local expert][ETP rank][EP source]
// (sort_chunks_by_idxs), a permutation computed from the counts alone: only token rows and probs travel, no
// per-row metadata. Combine runs the reverse: unsort, reduce-scatter-v over ETP (summing the ETP partial outputs),
// all-to-all back, scatter-add into tokens. The group has no v-variants of all-gather / reduce-scatter, so they run
// on buffers padded to the largest count.
//
// The expert side knows each row's local expert (expert_R) and prob, not its source token: as in Megatron, the
// state's source_token_R and source_rank_R stay empty; the sender keeps its own rows (sent_token_L) for combine.
#include <algorithm>
#include <cstring>
#include <functional>
#include <numeric>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "moecore/moe/token_dispatcher_internal.h"
#include "moecore/parallel/comm_stats.h"

namespace moecore::detail {

AllToAllCounts exchange_alltoall_counts(const parallel::ProcessGroup &ep, const parallel::ProcessGroup &etp,
                                        const std::vector<int64_t> &rows_E, const int64_t El) {
  AllToAllCounts counts;
  counts.ETP = etp.size();
  counts.EP = ep.size();
  counts.El = El;
  if (El <= 0 || static_cast<int64_t>(rows_E.size()) != counts.EP * El) {
    throw std::invalid_argument("alltoall dispatcher: " + std::to_string(rows_E.size()) + " expert counts for " +
                                std::to_string(counts.EP) + " EP ranks x " + std::to_string(El) + " local experts");
  }
  const std::vector<size_t> per_peer(static_cast<size_t>(counts.EP), static_cast<size_t>(El));
  std::vector<int64_t> from_sources_SL(rows_E.size());
  counts.rows_JSL.resize(static_cast<size_t>(counts.ETP) * rows_E.size());
  parallel::CommTimer timer(parallel::CommKind::kAllToAll);
  ep.all_to_all_v<int64_t>(rows_E, per_peer, from_sources_SL, per_peer);
  etp.all_gather<int64_t>(from_sources_SL, counts.rows_JSL);
  return counts;
}

AllToAllPlan plan_alltoall(const AllToAllCounts &counts, const int64_t etp_rank) {
  const int64_t ETP = counts.ETP, EP = counts.EP, El = counts.El;
  AllToAllPlan plan;
  plan.ep_recv_rows.assign(static_cast<size_t>(EP), 0);
  plan.etp_rows.assign(static_cast<size_t>(ETP), 0);
  plan.tokens_per_expert_El.assign(static_cast<size_t>(El), 0);
  // first_JSL: where chunk (j, s, le) starts inside ETP rank j's all-to-all output.
  std::vector<int64_t> first_JSL(counts.rows_JSL.size());
  for (int64_t j = 0; j < ETP; ++j) {
    int64_t row = 0;
    for (int64_t s = 0; s < EP; ++s) {
      for (int64_t le = 0; le < El; ++le) {
        const int64_t rows = counts.rows(j, s, le);
        if (rows < 0) throw std::invalid_argument("alltoall dispatcher: negative row count " + std::to_string(rows));
        first_JSL[static_cast<size_t>((j * EP + s) * El + le)] = row;
        row += rows;
        plan.tokens_per_expert_El[static_cast<size_t>(le)] += rows;
        if (j == etp_rank) plan.ep_recv_rows[static_cast<size_t>(s)] += static_cast<size_t>(rows);
      }
    }
    plan.etp_rows[static_cast<size_t>(j)] = row;
  }
  plan.etp_max_rows = *std::max_element(plan.etp_rows.begin(), plan.etp_rows.end());
  plan.sorted_chunks.reserve(counts.rows_JSL.size());
  for (int64_t le = 0; le < El; ++le) {
    for (int64_t j = 0; j < ETP; ++j) {
      for (int64_t s = 0; s < EP; ++s) {
        const size_t c = static_cast<size_t>((j * EP + s) * El + le);
        plan.sorted_chunks.push_back({j * plan.etp_max_rows + first_JSL[c], counts.rows_JSL[c], le});
      }
    }
  }
  return plan;
}

namespace {

std::vector<size_t> scaled(const std::vector<size_t> &rows, const int64_t width) {
  std::vector<size_t> out(rows.size());
  for (size_t i = 0; i < rows.size(); ++i) out[i] = rows[i] * static_cast<size_t>(width);
  return out;
}

int64_t total(const std::vector<size_t> &rows) {
  int64_t sum = 0;
  for (const size_t n : rows) sum += static_cast<int64_t>(n);
  return sum;
}

class AllToAllDispatcher final : public TokenDispatcher {
 public:
  AllToAllDispatcher(const int64_t num_experts, const parallel::ParallelState &parallel)
      : E_(num_experts), El_(num_experts / parallel.ep_size()), ep_(parallel.ep), etp_(parallel.etp) {}

  Tensor dispatch(const float *x_TH, const int64_t T, const int64_t H, const RouterOutput &routing,
                  DispatchState &state) override {
    return dispatch_impl(x_TH, T, H, routing, state, nullptr);
  }

  Tensor dispatch_overlapped(const float *x_TH, const int64_t T, const int64_t H, const RouterOutput &routing,
                             DispatchState &state, const std::function<void()> &overlapped) override {
    return dispatch_impl(x_TH, T, H, routing, state, &overlapped);
  }

  void combine(float *out_TH, const float *y_RH, const DispatchState &state) override {
    const std::vector<float> rows_LH = from_experts(unsort(y_RH, state.H, state), state.H, state);
    scatter_add_rows(out_TH, state.T, rows_LH.data(), state.sent_token_L, state.H);
  }

  void combine_backward(float *dy_RH, const float *dout_TH, const DispatchState &state) override {
    combine_backward_impl(dy_RH, dout_TH, state, nullptr);
  }

  void combine_backward_overlapped(float *dy_RH, const float *dout_TH, const DispatchState &state,
                                   const std::function<void()> &overlapped) override {
    combine_backward_impl(dy_RH, dout_TH, state, &overlapped);
  }

  void dispatch_backward(float *dx_TH, const float *dx_RH, const DispatchState &state) override {
    combine(dx_TH, dx_RH, state);
  }

  void probs_backward(float *dprobs_TE, const float *dprobs_R, const DispatchState &state) override {
    const std::vector<float> dprobs_L = from_experts(unsort(dprobs_R, 1, state), 1, state);
    const int64_t L = static_cast<int64_t>(dprobs_L.size());
    for (int64_t l = 0; l < L; ++l) {
      const int64_t t = state.sent_token_L[l];
      if (t >= 0) dprobs_TE[t * state.E + state.sent_expert_L[l]] += dprobs_L[l];
    }
  }

 private:
  // `overlapped` (may be null) runs while the token rows are in flight.
  Tensor dispatch_impl(const float *x_TH, const int64_t T, const int64_t H, const RouterOutput &routing,
                       DispatchState &state, const std::function<void()> *overlapped) {
    if (T < 0 || H <= 0 || static_cast<int64_t>(routing.tokens_per_expert_E.size()) != E_) {
      throw std::invalid_argument("alltoall dispatcher: bad sizes T=" + std::to_string(T) + " H=" + std::to_string(H) +
                                  " E=" + std::to_string(routing.tokens_per_expert_E.size()) +
                                  ", expected E=" + std::to_string(E_));
    }
    check_routing(routing, T, E_);
    const int64_t E = E_, EP = ep_.size();
    state = DispatchState{};
    state.T = T;
    state.H = H;
    state.E = E;

    // Local permutation over all experts; EP rank d's experts form one contiguous block of it.
    ExpertMajorRows rows = expert_major_rows(routing.routing_map_TE.data<uint8_t>(), routing.probs_TE.data<float>(), T,
                                             E, 0, E, routing.tokens_per_expert_E, routing.capacity);
    state.sent_token_L = std::move(rows.token_R);
    std::vector<float> sent_probs_L = std::move(rows.probs_R);
    state.ep_send_rows.assign(static_cast<size_t>(EP), 0);
    for (int64_t e = 0; e < E; ++e) {
      const int64_t expert_rows = routing.tokens_per_expert_E[e];
      state.sent_expert_L.insert(state.sent_expert_L.end(), static_cast<size_t>(expert_rows), e);
      state.ep_send_rows[static_cast<size_t>(e / El_)] += static_cast<size_t>(expert_rows);
    }
    const AllToAllPlan plan =
        plan_alltoall(exchange_alltoall_counts(ep_, etp_, routing.tokens_per_expert_E, El_), etp_.rank());
    state.ep_recv_rows = plan.ep_recv_rows;
    state.etp_rows = plan.etp_rows;
    state.etp_max_rows = plan.etp_max_rows;
    state.tokens_per_expert_E = plan.tokens_per_expert_El;

    const int64_t L = static_cast<int64_t>(state.sent_token_L.size());
    std::vector<float> sent_LH(static_cast<size_t>(L * H));
    gather_rows(sent_LH.data(), x_TH, state.sent_token_L, H);  // padding rows are zero
    const std::vector<float> gathered_x = to_experts(sent_LH, H, state, overlapped);
    sent_LH = std::vector<float>();
    const std::vector<float> gathered_probs = to_experts(sent_probs_L, 1, state);

    const int64_t R = std::accumulate(plan.tokens_per_expert_El.begin(), plan.tokens_per_expert_El.end(), int64_t{0});
    state.gathered_row_R.reserve(static_cast<size_t>(R));
    state.expert_R.reserve(static_cast<size_t>(R));
    for (const RowChunk &chunk : plan.sorted_chunks) {
      for (int64_t i = 0; i < chunk.rows; ++i) state.gathered_row_R.push_back(chunk.first_row + i);
      state.expert_R.insert(state.expert_R.end(), static_cast<size_t>(chunk.rows), chunk.local_expert);
    }
    Tensor x_RH({R, H}, DType::kF32, MemCategory::kActivations);
    gather_rows(x_RH.data<float>(), gathered_x.data(), state.gathered_row_R, H);
    state.probs_R.resize(static_cast<size_t>(R));
    gather_rows(state.probs_R.data(), gathered_probs.data(), state.gathered_row_R, 1);
    return x_RH;
  }

  void combine_backward_impl(float *dy_RH, const float *dout_TH, const DispatchState &state,
                             const std::function<void()> *overlapped) const {
    const int64_t H = state.H;
    std::vector<float> rows_LH(state.sent_token_L.size() * static_cast<size_t>(H));
    gather_rows(rows_LH.data(), dout_TH, state.sent_token_L, H);
    const std::vector<float> gathered = to_experts(rows_LH, H, state, overlapped);
    gather_rows(dy_RH, gathered.data(), state.gathered_row_R, H);
  }

  // Rows in send order (W values each) -> all-to-all over EP -> all-gather over ETP: [ETP, etp_max_rows, W].
  // `overlapped` (may be null) runs between starting the all-to-all and waiting for it.
  std::vector<float> to_experts(const std::vector<float> &rows_LW, const int64_t W, const DispatchState &state,
                                const std::function<void()> *overlapped = nullptr) const {
    const int64_t M = state.etp_max_rows, ETP = etp_.size();
    std::vector<float> received(static_cast<size_t>(M * W), 0.0f);
    std::vector<float> gathered(static_cast<size_t>(ETP * M * W));
    parallel::Work exchange;
    {
      parallel::CommTimer timer(parallel::CommKind::kAllToAll);
      exchange = ep_.all_to_all_v_async<float>(
          rows_LW, scaled(state.ep_send_rows, W),
          std::span<float>(received.data(), static_cast<size_t>(total(state.ep_recv_rows) * W)),
          scaled(state.ep_recv_rows, W));
    }
    exchange.trace_as(overlapped ? "all-to-all under the shared experts" : "all-to-all");
    if (overlapped) (*overlapped)();
    parallel::CommTimer timer(parallel::CommKind::kAllToAll);
    exchange.wait();
    etp_.all_gather<float>(received, gathered);
    return gathered;
  }

  // The reverse: [ETP, etp_max_rows, W] summed over ETP (reduce-scatter) -> all-to-all back: rows in send order.
  std::vector<float> from_experts(const std::vector<float> &gathered, const int64_t W,
                                  const DispatchState &state) const {
    const int64_t M = state.etp_max_rows;
    std::vector<float> reduced(static_cast<size_t>(M * W));
    std::vector<float> rows_LW(state.sent_token_L.size() * static_cast<size_t>(W));
    parallel::CommTimer timer(parallel::CommKind::kAllToAll);
    etp_.reduce_scatter<float>(gathered, reduced, parallel::ReduceOp::kSum);
    ep_.all_to_all_v<float>(std::span<const float>(reduced.data(), static_cast<size_t>(total(state.ep_recv_rows) * W)),
                            scaled(state.ep_recv_rows, W), rows_LW, scaled(state.ep_send_rows, W));
    return rows_LW;
  }

  // Rows of the expert-major order [R, W] back to their places in the zero-padded [ETP, etp_max_rows, W] buffer.
  std::vector<float> unsort(const float *rows_RW, const int64_t W, const DispatchState &state) const {
    std::vector<float> gathered(static_cast<size_t>(etp_.size() * state.etp_max_rows * W), 0.0f);
    const int64_t R = static_cast<int64_t>(state.gathered_row_R.size());
#pragma omp parallel for schedule(static) if (R * W > 16384)
    for (int64_t r = 0; r < R; ++r) {
      std::memcpy(gathered.data() + state.gathered_row_R[r] * W, rows_RW + r * W,
                  sizeof(float) * static_cast<size_t>(W));
    }
    return gathered;
  }

  int64_t E_, El_;
  parallel::ProcessGroup ep_, etp_;
};

}  // namespace

std::unique_ptr<TokenDispatcher> make_alltoall_dispatcher(const int64_t num_experts,
                                                          const parallel::ParallelState &parallel) {
  return std::make_unique<AllToAllDispatcher>(num_experts, parallel);
}

}  // namespace moecore::detail
