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
//
// Rows travel in the activations' dtype, as Megatron dispatches: under 16-bit activation storage the token rows, the
// expert outputs and both gradients move in bf16 / fp16 (the same values the fp32 buffers would carry), the
// probabilities and their gradients in fp32. Only the combine's partial outputs under expert tensor parallelism,
// which the reduce-scatter sums, stay fp32 (Megatron sums them in the activation dtype). The bytes of the rows and
// probabilities each rank sends are counted for the [comm] line.
#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <functional>
#include <numeric>
#include <span>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "moecore/moe/token_dispatcher_internal.h"
#include "moecore/ops/moe_rows.h"
#include "moecore/ops/precision.h"
#include "moecore/parallel/comm_stats.h"
#include "moecore/parallel/turn_taking.h"

namespace moecore::detail {

namespace {

// MOECORE_EP_A2A_DELAY_US (token_dispatcher_internal.h: finish_link_delay), read once.
std::chrono::microseconds injected_link_delay() {
  static const std::chrono::microseconds delay = [] {
    const char *text = std::getenv("MOECORE_EP_A2A_DELAY_US");
    if (text == nullptr || *text == '\0') return std::chrono::microseconds(0);
    char *end = nullptr;
    const long long value = std::strtoll(text, &end, 10);
    if (*end != '\0' || value < 0 || value > 60'000'000) {
      throw std::invalid_argument(
          std::string("MOECORE_EP_A2A_DELAY_US must be microseconds from 0 to 60000000, got '") + text + "'");
    }
    return std::chrono::microseconds(value);
  }();
  return delay;
}

}  // namespace

void finish_link_delay(const std::chrono::steady_clock::time_point start) {
  const std::chrono::microseconds delay = injected_link_delay();
  if (delay.count() > 0) std::this_thread::sleep_until(start + delay);
}

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
      : E_(num_experts),
        El_(num_experts / parallel.ep_size()),
        host_(parallel.host),
        ep_(parallel.ep),
        etp_(parallel.etp) {}

  // Local permutation over all experts (EP rank d's experts form one contiguous block of it) and the count
  // exchange that plans the all-to-all (Megatron's preprocess).
  DispatchBuffers dispatch_preprocess(const Tensor &x_TH, const RouterOutput &routing, DispatchState &state) override {
    check_tokens("alltoall dispatcher", x_TH);
    const int64_t T = x_TH.dim(0), H = x_TH.dim(1);
    if (static_cast<int64_t>(routing.tokens_per_expert_E.size()) != E_) {
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
    state.capacity = routing.capacity;

    Tensor probs_L = expert_major_rows(state.sent_token_L, routing.routing_map_TE.view({T, E}),
                                       routing.probs_TE.view({T, E}), 0, routing.tokens_per_expert_E, routing.capacity);
    state.ep_send_rows.assign(static_cast<size_t>(EP), 0);
    for (int64_t e = 0; e < E; ++e) {
      const int64_t expert_rows = routing.tokens_per_expert_E[e];
      state.sent_expert_L.insert(state.sent_expert_L.end(), static_cast<size_t>(expert_rows), e);
      state.ep_send_rows[static_cast<size_t>(e / El_)] += static_cast<size_t>(expert_rows);
    }
    if (ep_hosts_.empty()) {  // each EP peer's host, for the inter-host bytes
      ep_hosts_.resize(static_cast<size_t>(ep_.size()));
      ep_.all_gather<int>(std::span<const int>(&host_, 1), ep_hosts_);
    }
    const AllToAllPlan plan =
        plan_alltoall(exchange_alltoall_counts(ep_, etp_, routing.tokens_per_expert_E, El_), etp_.rank());
    state.ep_recv_rows = plan.ep_recv_rows;
    state.etp_rows = plan.etp_rows;
    state.etp_max_rows = plan.etp_max_rows;
    state.tokens_per_expert_E = plan.tokens_per_expert_El;
    for (const RowChunk &chunk : plan.sorted_chunks) {
      state.sorted_first_C.push_back(chunk.first_row);
      state.sorted_rows_C.push_back(chunk.rows);
      state.expert_R.insert(state.expert_R.end(), static_cast<size_t>(chunk.rows), chunk.local_expert);
    }

    DispatchBuffers out{activation_rows({static_cast<int64_t>(state.sent_token_L.size()), H}, x_TH.dtype()),
                        std::move(probs_L)};
    ops::moe_permute(out.rows, x_TH, state.sent_token_L);  // padding rows are zero
    return out;
  }

  // The rows and their probabilities to the experts' ranks, both in flight together.
  DispatchBuffers token_dispatch(const DispatchBuffers &local, DispatchState &state,
                                 const std::function<void()> *overlapped) override {
    InFlight rows =
        start_to_experts(local.rows, state, overlapped ? "all-to-all under the shared experts" : "all-to-all");
    InFlight probs =
        start_to_experts(local.probs.view({local.probs.numel(), 1}), state, "all-to-all (probabilities)", false);
    if (overlapped) (*overlapped)();
    parallel::pass_turn();
    DispatchBuffers out;
    out.rows = finish_to_experts(rows, state);
    out.probs = finish_to_experts(probs, state);
    return out;
  }

  // sort_chunks_by_idxs: [ETP rank][EP source][local expert] -> [local expert][ETP rank][EP source].
  Tensor dispatch_postprocess(const DispatchBuffers &received, DispatchState &state) override {
    const int64_t R = std::accumulate(state.sorted_rows_C.begin(), state.sorted_rows_C.end(), int64_t{0});
    Tensor x_RH = activation_rows({R, state.H}, received.rows.dtype());
    ops::sort_chunks(x_RH, received.rows, state.sorted_first_C, state.sorted_rows_C);
    state.probs_R = activation_rows({R});
    Tensor probs_R1 = state.probs_R.view({R, 1});
    ops::sort_chunks(probs_R1, received.probs, state.sorted_first_C, state.sorted_rows_C);
    return x_RH;
  }

  Tensor combine_preprocess(const Tensor &y_RH, const DispatchState &state) override { return unsort(y_RH, state); }
  Tensor token_combine(const Tensor &gathered, const DispatchState &state) override {
    InFlight rows = start_from_experts(gathered, state, "all-to-all");
    parallel::pass_turn();
    return finish_from_experts(rows);
  }
  void combine_postprocess(Tensor &out_TH, const Tensor &rows_LH, const DispatchState &state) override {
    ops::moe_unpermute(out_TH, rows_LH, state.sent_token_L);
  }

  void combine_backward(Tensor &dy_RH, const Tensor &dout_TH, const DispatchState &state,
                        const std::function<void()> *overlapped) override {
    Tensor rows_LH = activation_rows({static_cast<int64_t>(state.sent_token_L.size()), state.H}, dout_TH.dtype());
    ops::moe_permute(rows_LH, dout_TH, state.sent_token_L);
    InFlight rows = start_to_experts(rows_LH, state, overlapped ? "all-to-all under the shared experts" : "all-to-all");
    if (overlapped) (*overlapped)();
    parallel::pass_turn();
    ops::sort_chunks(dy_RH, finish_to_experts(rows, state), state.sorted_first_C, state.sorted_rows_C);
  }

  void probs_backward(Tensor &dprobs_TE, const Tensor &dprobs_R, const DispatchState &state) override {
    InFlight probs =
        start_from_experts(unsort(dprobs_R.view({dprobs_R.numel(), 1}), state), state, "all-to-all", false);
    add_probs(dprobs_TE, finish_from_experts(probs), state);
  }

  void dispatch_backward_with_probs(Tensor &dx_TH, Tensor &dprobs_TE, const Tensor &dx_RH, const Tensor &dprobs_R,
                                    const DispatchState &state, const std::function<void()> *overlapped) override {
    InFlight rows = start_from_experts(combine_preprocess(dx_RH, state), state, "all-to-all");
    InFlight probs = start_from_experts(unsort(dprobs_R.view({dprobs_R.numel(), 1}), state), state,
                                        "all-to-all (probabilities)", false);
    if (overlapped) (*overlapped)();
    parallel::pass_turn();
    combine_postprocess(dx_TH, finish_from_experts(rows), state);
    add_probs(dprobs_TE, finish_from_experts(probs), state);
  }

 private:
  // One all-to-all in flight: its request, the buffers it reads and writes, and when it started (the injected delay).
  struct InFlight {
    parallel::Work work;
    Tensor sent, received;
    std::chrono::steady_clock::time_point started;
  };

  // Rows in send order [L, W] -> all-to-all over EP (started here) ...
  InFlight start_to_experts(const Tensor &rows_LW, const DispatchState &state, const char *name,
                            const bool token_rows = true) const {
    const int64_t M = state.etp_max_rows, ETP = etp_.size(), W = rows_LW.dim(1);
    InFlight exchange;
    if (token_rows) count_inter_host(state.ep_send_rows, W * static_cast<int64_t>(dtype_size(rows_LW.dtype())), true);
    exchange.sent = rows_LW;
    exchange.received = activation_rows({M, W}, rows_LW.dtype());
    count_dispatch_bytes(rows_LW.dtype(), total(state.ep_send_rows) * W + (ETP > 1 ? M * W : 0));
    exchange.started = std::chrono::steady_clock::now();
    parallel::CommTimer timer(parallel::CommKind::kAllToAll);
    Tensor received_rows = exchange.received.slice_rows(0, total(state.ep_recv_rows));
    exchange.work =
        ep_.all_to_all_v_async(rows_LW, scaled(state.ep_send_rows, W), received_rows, scaled(state.ep_recv_rows, W));
    exchange.work.trace_as(name);
    return exchange;
  }
  // ... waited for -> all-gather over ETP: [ETP etp_max_rows, W].
  Tensor finish_to_experts(InFlight &exchange, const DispatchState &state) const {
    parallel::CommTimer timer(parallel::CommKind::kAllToAll);
    exchange.work.wait();
    finish_link_delay(exchange.started);
    if (etp_.size() == 1) return exchange.received;
    const Tensor &received = exchange.received;
    Tensor gathered = activation_rows({etp_.size() * state.etp_max_rows, received.dim(1)}, received.dtype());
    etp_.all_gather(received, gathered);
    return gathered;
  }

  // The reverse: [ETP etp_max_rows, W] summed over ETP (reduce-scatter, fp32) -> all-to-all back (started here) ...
  InFlight start_from_experts(const Tensor &gathered, const DispatchState &state, const char *name,
                              const bool token_rows = true) const {
    const int64_t M = state.etp_max_rows, W = gathered.dim(1), ETP = etp_.size();
    InFlight exchange;
    if (token_rows) {
      count_inter_host(state.ep_recv_rows, W * static_cast<int64_t>(dtype_size(gathered.dtype())), false);
    }
    exchange.received = activation_rows({static_cast<int64_t>(state.sent_token_L.size()), W}, gathered.dtype());
    count_dispatch_bytes(gathered.dtype(), total(state.ep_recv_rows) * W + (ETP > 1 ? ETP * M * W : 0));
    parallel::CommTimer timer(parallel::CommKind::kAllToAll);
    exchange.sent = gathered;
    if (ETP > 1) {
      exchange.sent = activation_rows({M, W}, gathered.dtype());
      etp_.reduce_scatter(gathered, exchange.sent, parallel::ReduceOp::kSum);
    }
    exchange.started = std::chrono::steady_clock::now();
    exchange.work =
        ep_.all_to_all_v_async(exchange.sent.slice_rows(0, total(state.ep_recv_rows)), scaled(state.ep_recv_rows, W),
                               exchange.received, scaled(state.ep_send_rows, W));
    exchange.work.trace_as(name);
    return exchange;
  }
  // ... waited for: rows in send order, in the dtype of `gathered` (without ETP nothing is summed).
  static Tensor finish_from_experts(InFlight &exchange) {
    parallel::CommTimer timer(parallel::CommKind::kAllToAll);
    exchange.work.wait();
    finish_link_delay(exchange.started);
    return exchange.received;
  }

  static void add_probs(Tensor &dprobs_TE, const Tensor &dprobs_L, const DispatchState &state) {
    add_probs_gradients(dprobs_TE, dprobs_L, state.sent_token_L, state.sent_expert_L, state.T, state.E);
  }

  // The token-row bytes of an EP all-to-all that go to ranks on other hosts (rows_P: rows to each EP peer).
  void count_inter_host(const std::vector<size_t> &rows_P, const int64_t row_bytes, const bool to_experts) const {
    double bytes = 0.0;
    for (size_t d = 0; d < rows_P.size(); ++d) {
      if (ep_hosts_[d] != ep_hosts_[static_cast<size_t>(ep_.rank())])
        bytes += static_cast<double>(rows_P[d] * row_bytes);
    }
    parallel::CommStats::instance().add_inter_host_bytes(bytes, to_experts);
  }

  // Rows of the expert-major order [R, W] back to their places in the zero-padded [ETP etp_max_rows, W] buffer:
  // fp32 where the ETP reduce-scatter sums them, else in their own dtype.
  Tensor unsort(const Tensor &rows_RW, const DispatchState &state) const {
    Tensor gathered = activation_rows({etp_.size() * state.etp_max_rows, rows_RW.dim(1)},
                                      etp_.size() > 1 ? DType::kF32 : rows_RW.dtype());
    ops::unsort_chunks(gathered, rows_RW, state.sorted_first_C, state.sorted_rows_C);
    return gathered;
  }

  int64_t E_, El_;
  int host_;
  std::vector<int> ep_hosts_;
  parallel::ProcessGroup ep_, etp_;
};

}  // namespace

std::unique_ptr<TokenDispatcher> make_alltoall_dispatcher(const int64_t num_experts,
                                                          const parallel::ParallelState &parallel) {
  return std::make_unique<AllToAllDispatcher>(num_experts, parallel);
}

}  // namespace moecore::detail
