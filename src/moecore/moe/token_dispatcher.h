// Token dispatchers: move routed tokens to their experts and back (megatron/core/transformer/moe/token_dispatcher.py).
// The interface is what the allgather and alltoall dispatchers of the distributed engine implement; in one
// process the local dispatcher permutes tokens into expert-major order (tokens ascending within each expert,
// dropless gives T*k rows; with padding every expert gets exactly C rows, padded rows have prob 0 and no
// source token) and restores them by scatter-add.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "moecore/moe/moe_config.h"
#include "moecore/moe/router.h"
#include "moecore/parallel/parallel_state.h"
#include "moecore/tensor/tensor.h"

namespace moecore {

// The permutation of one micro-batch: row r of the expert input came from token source_token_R[r]
// (-1 for a padding row) and belongs to expert expert_R[r].
struct DispatchState {
  int64_t T = 0, H = 0, E = 0;
  std::vector<int64_t> source_token_R;
  std::vector<int64_t> expert_R;
  std::vector<float> probs_R;                // router prob of (source token, expert), 0 for padding rows
  std::vector<int64_t> tokens_per_expert_E;  // rows per local expert, in row order

  // Distributed dispatchers only (empty for the local one). The allgather dispatcher fills source_token_R with the
  // tokens of the owner rank source_rank_R (its rank in the ETP x EP group) and expert_R with local experts; the
  // alltoall dispatcher leaves both empty, as Megatron's (its expert side only knows the exchanged counts).
  std::vector<int64_t> source_rank_R;  // -1 for padding rows
  // Row r's place in the buffer the dispatcher gathers: allgather: gathered token (rank * T + token, -1 for
  // padding); alltoall: row in the ETP-gathered [ETP, etp_max_rows] buffer of all-to-all outputs.
  std::vector<int64_t> gathered_row_R;
  // alltoall: this rank's permuted rows in the order sent (token, -1 for padding; global expert), rows to and from
  // each EP rank, rows each ETP rank got from its all-to-all, and their maximum.
  std::vector<int64_t> sent_token_L, sent_expert_L;
  std::vector<size_t> ep_send_rows, ep_recv_rows;
  std::vector<int64_t> etp_rows;
  int64_t etp_max_rows = 0;
};

class TokenDispatcher {
 public:
  virtual ~TokenDispatcher() = default;
  // x_TH -> x_RH (returned, [R, H]) grouped by expert; fills `state`.
  virtual Tensor dispatch(const float* x_TH, int64_t T, int64_t H, const RouterOutput& routing,
                          DispatchState& state) = 0;
  // out_TH += sum over rows r of y_RH[r] into token source_token_R[r] (scatter-add; padding rows skipped).
  virtual void combine(float* out_TH, const float* y_RH, const DispatchState& state) = 0;
  // Backward of combine: dy_RH[r] = dout_TH[source_token_R[r]] (0 for padding rows). Overwrites dy_RH.
  virtual void combine_backward(float* dy_RH, const float* dout_TH, const DispatchState& state) = 0;
  // Backward of dispatch: dx_TH[source_token_R[r]] += dx_RH[r].
  virtual void dispatch_backward(float* dx_TH, const float* dx_RH, const DispatchState& state) = 0;
  // dprobs_TE[source_token_R[r], expert_R[r]] += dprobs_R[r].
  virtual void probs_backward(float* dprobs_TE, const float* dprobs_R, const DispatchState& state) = 0;

  // dispatch and combine_backward (both move token rows to the experts) running `overlapped` while the rows are in
  // flight (--moe-shared-expert-overlap); a dispatcher with no exchange to hide runs it first.
  virtual Tensor dispatch_overlapped(const float* x_TH, int64_t T, int64_t H, const RouterOutput& routing,
                                     DispatchState& state, const std::function<void()>& overlapped) {
    overlapped();
    return dispatch(x_TH, T, H, routing, state);
  }
  virtual void combine_backward_overlapped(float* dy_RH, const float* dout_TH, const DispatchState& state,
                                           const std::function<void()>& overlapped) {
    overlapped();
    combine_backward(dy_RH, dout_TH, state);
  }
};

// Single-process dispatcher (all experts local).
std::unique_ptr<TokenDispatcher> make_local_dispatcher();

// The dispatcher for `type` over the expert grid of `parallel`: the local one when ETP x EP is 1, else the
// allgather dispatcher (all-gather over ETP x EP, local experts' columns, reduce-scatter back) or the alltoall
// dispatcher (all-to-all over EP, all-gather-v / reduce-scatter-v over ETP, chunks sorted by local expert).
// Rank r of EP owns experts [r E/EP, (r+1) E/EP); DispatchState::tokens_per_expert_E and expert_R then count and
// index the LOCAL experts (expert_R in [0, E/EP)). Every call is collective over the expert grid.
std::unique_ptr<TokenDispatcher> make_token_dispatcher(TokenDispatcherType type, int64_t num_experts,
                                                       const parallel::ParallelState& parallel);

}  // namespace moecore
