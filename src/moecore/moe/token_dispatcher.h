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

struct FlexDispatchPlan;  // token_dispatcher_flex.cpp

// The permutation of one micro-batch: row r of the expert input came from token source_token_R[r]
// (-1 for a padding row) and belongs to expert expert_R[r].
struct DispatchState {
  int64_t T = 0, H = 0, E = 0;
  int64_t capacity = -1;  // the router's capacity C (-1: none)
  std::vector<int64_t> source_token_R;
  std::vector<int64_t> expert_R;
  Tensor probs_R;                            // fp32 [R]: router prob of (source token, expert), 0 for padding rows
  std::vector<int64_t> tokens_per_expert_E;  // rows per local expert, in row order

  // Distributed dispatchers only (empty for the local one). The allgather dispatcher fills source_token_R with the
  // tokens of the owner rank source_rank_R (its rank in the ETP x EP group) and expert_R with local experts; the
  // alltoall dispatcher leaves both empty, as Megatron's (its expert side only knows the exchanged counts).
  std::vector<int64_t> source_rank_R;  // -1 for padding rows
  // allgather: row r's gathered token (rank * T + token, -1 for padding).
  std::vector<int64_t> gathered_row_R;
  // alltoall: this rank's permuted rows in the order sent (token, -1 for padding; global expert), rows to and from
  // each EP rank, rows each ETP rank got from its all-to-all, and their maximum; the expert input's chunks in the
  // ETP-gathered [ETP, etp_max_rows] buffer of all-to-all outputs, in expert-major order (sort_chunks_by_idxs).
  std::vector<int64_t> sent_token_L, sent_expert_L;
  std::vector<size_t> ep_send_rows, ep_recv_rows;
  std::vector<int64_t> etp_rows;
  int64_t etp_max_rows = 0;
  std::vector<int64_t> sorted_first_C, sorted_rows_C;
  // flex: the routing plan (which host needs which token, each host rank's rows), for combine and the backwards.
  std::shared_ptr<const FlexDispatchPlan> flex;
  // allgather: the routing map (kU8 [T, E]) and token counts (kI64 [E]) of this rank in dispatch_preprocess, of the
  // whole group ([S T, E], [S E]) after token_dispatch.
  Tensor routing_map, expert_counts;
};

// What one phase hands to the next: token rows [N, H] and, in dispatch, their probabilities (fp32 [N]). What the
// rows are between two phases is the dispatcher's business (e.g. the allgather dispatcher gathers the routing
// probabilities [T, E] as its probs).
struct DispatchBuffers {
  Tensor rows;
  Tensor probs;
};

// A dispatcher runs in Megatron's phases (token_dispatcher.py), so a schedule can interleave them with other work
// (EP overlap): dispatch_preprocess (local permutation and index bookkeeping), token_dispatch (the collectives),
// dispatch_postprocess (rows sorted by local expert); combine_preprocess, token_combine (the collectives),
// combine_postprocess (unpermute: scatter-add into tokens). Row moves are ops (ops/moe_rows.h); the dispatchers
// keep only communication and index bookkeeping. Token rows move in the activations' dtype (16-bit under 16-bit
// activation storage); probabilities and sums over ranks are fp32. Under the EP overlap (--overlap-moe-expert-
// parallel-comm) a dispatcher that starts a non-blocking exchange calls parallel::pass_turn() before waiting for it,
// so the other micro-batch of the combined 1F1B step computes while it travels.
class TokenDispatcher {
 public:
  virtual ~TokenDispatcher() = default;

  // Phases of dispatch; fill `state`. `overlapped` (may be null) runs while the token rows are in flight
  // (--moe-shared-expert-overlap); a dispatcher with no exchange to hide runs it first.
  virtual DispatchBuffers dispatch_preprocess(const Tensor& x_TH, const RouterOutput& routing,
                                              DispatchState& state) = 0;
  virtual DispatchBuffers token_dispatch(const DispatchBuffers& local, DispatchState& state,
                                         const std::function<void()>* overlapped) = 0;
  // Returns x_RH grouped by local expert and sets state.probs_R.
  virtual Tensor dispatch_postprocess(const DispatchBuffers& received, DispatchState& state) = 0;
  // Phases of combine: expert rows y_RH -> what the collectives move -> out_TH += its tokens' rows.
  virtual Tensor combine_preprocess(const Tensor& y_RH, const DispatchState& state) = 0;
  virtual Tensor token_combine(const Tensor& rows, const DispatchState& state) = 0;
  virtual void combine_postprocess(Tensor& out_TH, const Tensor& rows, const DispatchState& state) = 0;

  // x_TH [T, H] -> x_RH [R, H] grouped by expert (the three dispatch phases); fills `state`.
  Tensor dispatch(const Tensor& x_TH, const RouterOutput& routing, DispatchState& state) {
    return dispatch_overlapped(x_TH, routing, state, nullptr);
  }
  Tensor dispatch_overlapped(const Tensor& x_TH, const RouterOutput& routing, DispatchState& state,
                             const std::function<void()>* overlapped) {
    const DispatchBuffers local = dispatch_preprocess(x_TH, routing, state);
    return dispatch_postprocess(token_dispatch(local, state, overlapped), state);
  }
  // out_TH += sum over rows r of y_RH[r] into token source_token_R[r] (scatter-add; padding rows skipped).
  void combine(Tensor& out_TH, const Tensor& y_RH, const DispatchState& state) {
    combine_postprocess(out_TH, token_combine(combine_preprocess(y_RH, state), state), state);
  }

  // Backward of combine: dy_RH[r] = dout_TH[source_token_R[r]] (0 for padding rows). Overwrites dy_RH [R, H].
  // `overlapped` as in dispatch_overlapped.
  virtual void combine_backward(Tensor& dy_RH, const Tensor& dout_TH, const DispatchState& state,
                                const std::function<void()>* overlapped = nullptr) = 0;
  // Backward of dispatch: dx_TH[source_token_R[r]] += dx_RH[r] (the combine phases).
  void dispatch_backward(Tensor& dx_TH, const Tensor& dx_RH, const DispatchState& state) {
    combine(dx_TH, dx_RH, state);
  }
  // dprobs_TE[source_token_R[r], expert_R[r]] += dprobs_R[r] (fp32 [T, E] and [R]).
  virtual void probs_backward(Tensor& dprobs_TE, const Tensor& dprobs_R, const DispatchState& state) = 0;
  // Both backwards of dispatch, the rows' and their probabilities' gradients travelling together (as the dispatched
  // tensors' autograd does in Megatron); `overlapped` (may be null) runs while they travel (--delay-wgrad-compute:
  // the experts' weight gradients). The same sums as dispatch_backward then probs_backward.
  virtual void dispatch_backward_with_probs(Tensor& dx_TH, Tensor& dprobs_TE, const Tensor& dx_RH,
                                            const Tensor& dprobs_R, const DispatchState& state,
                                            const std::function<void()>* overlapped) {
    if (overlapped) (*overlapped)();
    dispatch_backward(dx_TH, dx_RH, state);
    probs_backward(dprobs_TE, dprobs_R, state);
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
