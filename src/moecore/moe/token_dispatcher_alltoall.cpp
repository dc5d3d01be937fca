// Megatron's alltoall token dispatcher. Forward: permute this rank's T tokens expert-major over all E experts
// (tokens ascending within an expert, padded to C rows per expert with pad-to-capacity); all-to-all over EP (EP
// rank d gets the rows of its experts); all-gather-v over ETP (every ETP rank gets its peers' rows too); sort the
// chunks from [ETP rank][EP source][local expert] to [local expert][ETP rank][EP source]. Combine runs the reverse:
// unsort, reduce-scatter-v over ETP (summing the ETP partial outputs), all-to-all back, scatter-add into tokens.
// The group has no v-variants of all-gather / reduce-scatter, so they run on buffers padded to the largest count.
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

// Per-row payload of dispatch after the H values of x: prob, local expert, source token, source rank.
constexpr int64_t kExtra = 4;

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
      : E_(num_experts),
        El_(num_experts / parallel.ep_size()),
        ep_(parallel.ep),
        etp_(parallel.etp),
        tp_ep_rank_(parallel.tp_ep.rank()) {}

  Tensor dispatch(const float *x_TH, const int64_t T, const int64_t H, const RouterOutput &routing,
                  DispatchState &state) override {
    if (T < 0 || H <= 0 || static_cast<int64_t>(routing.tokens_per_expert_E.size()) != E_) {
      throw std::invalid_argument("alltoall dispatcher: bad sizes T=" + std::to_string(T) + " H=" + std::to_string(H) +
                                  " E=" + std::to_string(routing.tokens_per_expert_E.size()) +
                                  ", expected E=" + std::to_string(E_));
    }
    check_routing(routing, T, E_);
    const int64_t E = E_, EP = ep_.size(), ETP = etp_.size();
    state = DispatchState{};
    state.T = T;
    state.H = H;
    state.E = E;

    // Local permutation over all experts; EP rank d's experts form one contiguous block of it.
    std::vector<float> sent_probs_L;
    state.ep_send_rows.assign(static_cast<size_t>(EP), 0);
    for (int64_t e = 0; e < E; ++e) {
      const int64_t rows = routing.tokens_per_expert_E[e];
      append_expert_rows(routing.routing_map_TE.data(), routing.probs_TE.data<float>(), T, E, e, rows, routing.capacity,
                         state.sent_token_L, sent_probs_L);
      state.sent_expert_L.insert(state.sent_expert_L.end(), static_cast<size_t>(rows), e);
      state.ep_send_rows[static_cast<size_t>(e / El_)] += static_cast<size_t>(rows);
    }
    {
      parallel::CommTimer timer(parallel::CommKind::kAllToAll);
      state.ep_recv_rows = ep_.exchange_counts(state.ep_send_rows);
    }
    std::vector<float> etp_rows(static_cast<size_t>(ETP));
    {
      const float received = static_cast<float>(total(state.ep_recv_rows));
      parallel::CommTimer timer(parallel::CommKind::kAllToAll);
      etp_.all_gather<float>(std::span<const float>(&received, 1), etp_rows);
    }
    state.etp_rows.assign(etp_rows.begin(), etp_rows.end());
    state.etp_max_rows = *std::max_element(state.etp_rows.begin(), state.etp_rows.end());

    const int64_t W = H + kExtra, L = static_cast<int64_t>(state.sent_token_L.size());
    std::vector<float> packed_LW(static_cast<size_t>(L * W));
#pragma omp parallel for schedule(static) if (L * W > 16384)
    for (int64_t l = 0; l < L; ++l) {
      float *dst = packed_LW.data() + l * W;
      const int64_t t = state.sent_token_L[l];
      if (t < 0) {
        std::fill_n(dst, H, 0.0f);
      } else {
        std::memcpy(dst, x_TH + t * H, sizeof(float) * static_cast<size_t>(H));
      }
      dst[H] = sent_probs_L[l];
      dst[H + 1] = static_cast<float>(state.sent_expert_L[l] % El_);
      dst[H + 2] = static_cast<float>(t);
      dst[H + 3] = static_cast<float>(t < 0 ? -1 : tp_ep_rank_);
    }
    const std::vector<float> gathered = to_experts(packed_LW, W, state);
    packed_LW = std::vector<float>();

    // Counting sort of the gathered rows by (local expert, ETP rank); stable, so EP sources and tokens keep order.
    const int64_t M = state.etp_max_rows;
    std::vector<int64_t> count(static_cast<size_t>(El_ * ETP), 0);
    for (int64_t j = 0; j < ETP; ++j) {
      for (int64_t i = 0; i < state.etp_rows[j]; ++i) {
        ++count[static_cast<size_t>(static_cast<int64_t>(gathered[(j * M + i) * W + H + 1]) * ETP + j)];
      }
    }
    std::vector<int64_t> offset(count.size() + 1, 0);
    for (size_t c = 0; c < count.size(); ++c) offset[c + 1] = offset[c] + count[c];
    const int64_t R = offset.back();
    state.tokens_per_expert_E.assign(static_cast<size_t>(El_), 0);
    for (int64_t le = 0; le < El_; ++le) state.tokens_per_expert_E[le] = offset[(le + 1) * ETP] - offset[le * ETP];
    state.gathered_row_R.resize(static_cast<size_t>(R));
    for (int64_t j = 0; j < ETP; ++j) {
      for (int64_t i = 0; i < state.etp_rows[j]; ++i) {
        const int64_t g = j * M + i;
        const int64_t c = static_cast<int64_t>(gathered[g * W + H + 1]) * ETP + j;
        state.gathered_row_R[offset[c]++] = g;
      }
    }

    Tensor x_RH({R, H}, DType::kF32, MemCategory::kActivations);
    state.source_token_R.resize(static_cast<size_t>(R));
    state.source_rank_R.resize(static_cast<size_t>(R));
    state.expert_R.resize(static_cast<size_t>(R));
    state.probs_R.resize(static_cast<size_t>(R));
#pragma omp parallel for schedule(static) if (R * H > 16384)
    for (int64_t r = 0; r < R; ++r) {
      const float *src = gathered.data() + state.gathered_row_R[r] * W;
      std::memcpy(x_RH.data<float>() + r * H, src, sizeof(float) * static_cast<size_t>(H));
      state.probs_R[r] = src[H];
      state.expert_R[r] = static_cast<int64_t>(src[H + 1]);
      state.source_token_R[r] = static_cast<int64_t>(src[H + 2]);
      state.source_rank_R[r] = static_cast<int64_t>(src[H + 3]);
    }
    return x_RH;
  }

  void combine(float *out_TH, const float *y_RH, const DispatchState &state) override {
    const std::vector<float> rows_LH = from_experts(unsort(y_RH, state.H, state), state.H, state);
    scatter_add_rows(out_TH, state.T, rows_LH.data(), state.sent_token_L, state.H);
  }

  void combine_backward(float *dy_RH, const float *dout_TH, const DispatchState &state) override {
    const int64_t H = state.H;
    std::vector<float> rows_LH(state.sent_token_L.size() * static_cast<size_t>(H));
    gather_rows(rows_LH.data(), dout_TH, state.sent_token_L, H);
    const std::vector<float> gathered = to_experts(rows_LH, H, state);
    gather_rows(dy_RH, gathered.data(), state.gathered_row_R, H);
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
  // Rows in send order (W values each) -> all-to-all over EP -> all-gather over ETP: [ETP, etp_max_rows, W].
  std::vector<float> to_experts(const std::vector<float> &rows_LW, const int64_t W, const DispatchState &state) const {
    const int64_t M = state.etp_max_rows, ETP = etp_.size();
    std::vector<float> received(static_cast<size_t>(M * W), 0.0f);
    std::vector<float> gathered(static_cast<size_t>(ETP * M * W));
    parallel::CommTimer timer(parallel::CommKind::kAllToAll);
    ep_.all_to_all_v<float>(rows_LW, scaled(state.ep_send_rows, W),
                            std::span<float>(received.data(), static_cast<size_t>(total(state.ep_recv_rows) * W)),
                            scaled(state.ep_recv_rows, W));
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
  int tp_ep_rank_;
};

}  // namespace

std::unique_ptr<TokenDispatcher> make_alltoall_dispatcher(const int64_t num_experts,
                                                          const parallel::ParallelState &parallel) {
  return std::make_unique<AllToAllDispatcher>(num_experts, parallel);
}

}  // namespace moecore::detail
