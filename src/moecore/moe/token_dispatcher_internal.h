// Helpers shared by the local, allgather and alltoall token dispatchers (not part of the public interface).
#pragma once

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "moecore/moe/router.h"
#include "moecore/moe/token_dispatcher.h"
#include "moecore/parallel/parallel_state.h"
#include "moecore/parallel/process_group.h"

namespace moecore::detail {

// Throws std::invalid_argument unless routing holds an fp32 [T, E] probs tensor and a [T, E] map.
void check_routing(const RouterOutput& routing, int64_t T, int64_t E);

// out_NH[index_R[r]] += rows_RH[r] for every r with index_R[r] >= 0. Each destination sums its rows in ascending
// row order (parallel over destinations), so the result does not depend on the thread count.
void scatter_add_rows(float* out_NH, int64_t N, const float* rows_RH, const std::vector<int64_t>& index_R, int64_t H);

// dst_RH[r] = src_NH[index_R[r]] (zeros where index_R[r] < 0).
void gather_rows(float* dst_RH, const float* src_NH, const std::vector<int64_t>& index_R, int64_t H);

// Appends the rows of expert e of one source's [T, E] map: its routed tokens in ascending order, then padding rows
// (token -1, prob 0) up to `rows` when the router padded to capacity. Returns the routed count.
template <typename MapT>
int64_t append_expert_rows(const MapT* map_TE, const float* probs_TE, const int64_t T, const int64_t E, const int64_t e,
                           const int64_t rows, const int64_t capacity, std::vector<int64_t>& token_R,
                           std::vector<float>& probs_R) {
  const size_t begin = token_R.size();
  for (int64_t t = 0; t < T; ++t) {
    if (map_TE[t * E + e] == MapT{0}) continue;
    token_R.push_back(t);
    probs_R.push_back(probs_TE[t * E + e]);
  }
  const int64_t routed = static_cast<int64_t>(token_R.size() - begin);
  if (rows != routed) {
    // Pad-to-capacity: the router reports C rows per expert while the map holds at most C tokens.
    if (capacity < 0 || rows != capacity || routed > rows) {
      throw std::invalid_argument(std::string("token dispatcher: expert ") + std::to_string(e) + " has " +
                                  std::to_string(routed) + " routed tokens but tokens_per_expert says " +
                                  std::to_string(rows) + " (capacity " + std::to_string(capacity) + ")");
    }
    token_R.insert(token_R.end(), static_cast<size_t>(rows - routed), -1);
    probs_R.insert(probs_R.end(), static_cast<size_t>(rows - routed), 0.0f);
  }
  return routed;
}

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

std::unique_ptr<TokenDispatcher> make_allgather_dispatcher(int64_t num_experts,
                                                           const parallel::ParallelState& parallel);
std::unique_ptr<TokenDispatcher> make_alltoall_dispatcher(int64_t num_experts, const parallel::ParallelState& parallel);

}  // namespace moecore::detail
