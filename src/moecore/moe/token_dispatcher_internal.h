// Helpers shared by the local, allgather and alltoall token dispatchers (not part of the public interface).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "moecore/moe/router.h"
#include "moecore/moe/token_dispatcher.h"
#include "moecore/parallel/comm_stats.h"
#include "moecore/parallel/parallel_state.h"
#include "moecore/parallel/process_group.h"

namespace moecore::detail {

// The number of entries of the router's [T, E] byte routing map (1: token t goes to expert e); 0 when it is none.
inline int64_t routing_map_entries(const RouterOutput& routing) {
  const Tensor& map = routing.routing_map_TE;
  return map.defined() && map.dtype() == DType::kU8 ? map.numel() : 0;
}

// Throws std::invalid_argument unless routing holds an fp32 [T, E] probs tensor and a [T, E] map.
void check_routing(const RouterOutput& routing, int64_t T, int64_t E);
// Throws std::invalid_argument unless x_TH is an fp32 [T, H] tensor of this rank's tokens with H > 0.
void check_tokens(const char* dispatcher, const Tensor& x_TH);

// A fresh fp32 activation tensor (zeros).
inline Tensor activation_rows(std::vector<int64_t> shape) {
  return Tensor(std::move(shape), DType::kF32, MemCategory::kActivations);
}
// Rows that move exactly (permutations, gathers, all-to-alls): in the dtype of the rows they come from, bf16 / fp16
// under 16-bit activation storage (ops/precision.h). Sums over ranks stay in fp32 buffers (activation_rows above).
inline Tensor activation_rows(std::vector<int64_t> shape, const DType dtype) {
  return Tensor(std::move(shape), dtype, MemCategory::kActivations);
}

// `elements` of `dtype` this rank sends into a dispatch or combine collective: the [comm] line's all-to-all bytes.
inline void count_dispatch_bytes(const DType dtype, const int64_t elements) {
  parallel::CommStats::instance().add_bytes(parallel::CommKind::kAllToAll,
                                            static_cast<double>(elements) * static_cast<double>(dtype_size(dtype)));
}

// dprobs_TE[token_N[n], expert_N[n]] += dprobs_N[n] (fp32 [T, E] and [N] or [N, 1]; token -1: a padding row, skipped),
// in row order: the probabilities' gradients back in the router's layout.
void add_probs_gradients(Tensor& dprobs_TE, const Tensor& dprobs_N, const std::vector<int64_t>& token_N,
                         const std::vector<int64_t>& expert_N, int64_t T, int64_t E);

// probs_R as a tensor [R] (fp32).
Tensor probs_tensor(const std::vector<float>& probs_R);

// The rows of experts [e_begin, e_begin + rows_X.size()) of one source's [T, E] map in expert-major order
// (ops::expert_major_rows: each expert's routed tokens ascending, then padding rows, token -1 and prob 0, up to
// rows_X when the router padded to capacity): the tokens into token_R (resized to the rows), their probabilities
// returned as an fp32 activation tensor [R]. Throws std::invalid_argument naming an expert whose routed count
// disagrees with rows_X.
Tensor expert_major_rows(std::vector<int64_t>& token_R, const Tensor& map_TE, const Tensor& probs_TE, int64_t e_begin,
                         std::span<const int64_t> rows_X, int64_t capacity);

// Rows the alltoall dispatcher moves to this rank's local experts, per (ETP rank j, EP source s, local expert le):
// what Megatron's MoEAlltoAllTokenDispatcher.preprocess calls num_global_tokens_per_local_expert
// [tp_size, ep_size, num_local_experts]. Integers end to end: row counts are exact at any size.
struct AllToAllCounts {
  int64_t ETP = 1, EP = 1, El = 1;
  std::vector<int64_t> rows_JSL;  // [ETP, EP, El]
  int64_t rows(const int64_t j, const int64_t s, const int64_t le) const {
    return rows_JSL[static_cast<size_t>((j * EP + s) * El + le)];
  }
};

// Collective over ep and etp: each rank's rows per expert (rows_E, [E] with E = EP x El, experts of EP rank d
// contiguous) go to the experts' EP rank by an int64 all-to-all, then the [EP, El] counts are all-gathered over
// ETP (int64).
AllToAllCounts exchange_alltoall_counts(const parallel::ProcessGroup& ep, const parallel::ProcessGroup& etp,
                                        const std::vector<int64_t>& rows_E, int64_t El);

// A run of consecutive rows of the ETP-gathered buffer.
struct RowChunk {
  int64_t first_row = 0, rows = 0, local_expert = 0;
};

// The alltoall dispatcher's permutation, derived from the counts alone (as Megatron's preprocess and
// sort_chunks_by_idxs): ETP rank j's all-to-all output holds, per EP source s in order, that source's rows for each
// local expert in order; the outputs are gathered into a zero-padded [ETP, etp_max_rows] buffer, and the chunks are
// taken in [local expert][ETP rank][EP source] order.
struct AllToAllPlan {
  std::vector<size_t> ep_recv_rows;           // [EP] rows this rank receives from each EP source
  std::vector<int64_t> etp_rows;              // [ETP] rows each ETP rank received
  int64_t etp_max_rows = 0;                   // the padded stride of the gathered buffer
  std::vector<int64_t> tokens_per_expert_El;  // rows per local expert (sum over ETP ranks and EP sources)
  std::vector<RowChunk> sorted_chunks;        // [El, ETP, EP] in expert-major order
};
AllToAllPlan plan_alltoall(const AllToAllCounts& counts, int64_t etp_rank);

// MOECORE_EP_A2A_DELAY_US=N (benchmarks of the communication overlap): an exchange of token rows started at `start`
// completes no earlier than N microseconds after it, as over a slower link (the alltoall dispatcher's all-to-alls,
// the flex dispatcher's inter-host ones). Work placed between an exchange's start and its wait hides the delay as
// it would hide such a link's transfer; what is not hidden shows in the [comm] line's all-to-all time.
void finish_link_delay(std::chrono::steady_clock::time_point start);

std::unique_ptr<TokenDispatcher> make_allgather_dispatcher(int64_t num_experts,
                                                           const parallel::ParallelState& parallel);
std::unique_ptr<TokenDispatcher> make_alltoall_dispatcher(int64_t num_experts, const parallel::ParallelState& parallel);
std::unique_ptr<TokenDispatcher> make_flex_dispatcher(int64_t num_experts, const parallel::ParallelState& parallel);

}  // namespace moecore::detail
