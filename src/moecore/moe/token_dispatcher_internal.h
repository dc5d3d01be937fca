// Helpers shared by the local, allgather and alltoall token dispatchers (not part of the public interface).
#pragma once

#include <cstdint>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "moecore/moe/router.h"
#include "moecore/moe/token_dispatcher.h"
#include "moecore/parallel/parallel_state.h"
#include "moecore/parallel/process_group.h"

namespace moecore::detail {

// The router's [T, E] routing map as bytes (1: token t goes to expert e), the one place the dispatchers read it.
inline const uint8_t* routing_map_bytes(const RouterOutput& routing) { return routing.routing_map_TE.data<uint8_t>(); }
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

// probs_R as a tensor [R] (fp32).
Tensor probs_tensor(const std::vector<float>& probs_R);

// Calls fn(e) for every e in [e_begin, e_end) where row_E[e] is set, in ascending order. A byte map is read eight
// entries at a time, skipping zero words: a token selects k of E experts, so most words are empty.
template <typename MapT, typename Fn>
void for_each_selected(const MapT* row_E, const int64_t e_begin, const int64_t e_end, Fn&& fn) {
  int64_t e = e_begin;
  if constexpr (sizeof(MapT) == 1) {
    for (; e + 8 <= e_end; e += 8) {
      uint64_t word = 0;
      std::memcpy(&word, row_E + e, sizeof word);
      if (word == 0) continue;
      for (int64_t i = 0; i < 8; ++i) {
        if (row_E[e + i] != MapT{0}) fn(e + i);
      }
    }
  }
  for (; e < e_end; ++e) {
    if (row_E[e] != MapT{0}) fn(e);
  }
}

// The rows of experts [e_begin, e_end) of one source's [T, E] map in expert-major order: each expert's routed tokens
// ascending, then padding rows (token -1, prob 0) up to rows_X[e - e_begin] when the router padded to capacity.
// Two passes over the map row by row (count, place): the cost is the map's size over eight, not E strided scans.
struct ExpertMajorRows {
  std::vector<int64_t> offsets_X1;  // expert e's rows are [offsets_X1[e - e_begin], offsets_X1[e - e_begin + 1])
  std::vector<int64_t> token_R;
  std::vector<float> probs_R;
};

template <typename MapT>
ExpertMajorRows expert_major_rows(const MapT* map_TE, const float* probs_TE, const int64_t T, const int64_t E,
                                  const int64_t e_begin, const int64_t e_end, const std::vector<int64_t>& rows_X,
                                  const int64_t capacity) {
  const auto X = static_cast<size_t>(e_end - e_begin);
  std::vector<int64_t> routed_X(X, 0);
  for (int64_t t = 0; t < T; ++t) {
    for_each_selected(map_TE + t * E, e_begin, e_end,
                      [&](const int64_t e) { ++routed_X[static_cast<size_t>(e - e_begin)]; });
  }
  ExpertMajorRows out;
  out.offsets_X1.assign(X + 1, 0);
  for (size_t x = 0; x < X; ++x) {
    const int64_t rows = rows_X[x], routed = routed_X[x];
    // Pad-to-capacity: the router reports C rows per expert while the map holds at most C tokens.
    if (rows != routed && (capacity < 0 || rows != capacity || routed > rows)) {
      throw std::invalid_argument(std::string("token dispatcher: expert ") +
                                  std::to_string(e_begin + static_cast<int64_t>(x)) + " has " + std::to_string(routed) +
                                  " routed tokens but tokens_per_expert says " + std::to_string(rows) + " (capacity " +
                                  std::to_string(capacity) + ")");
    }
    out.offsets_X1[x + 1] = out.offsets_X1[x] + rows;
  }
  const auto R = static_cast<size_t>(out.offsets_X1[X]);
  out.token_R.assign(R, -1);
  out.probs_R.assign(R, 0.0f);
  std::vector<int64_t> next_X(out.offsets_X1.begin(), out.offsets_X1.end() - 1);
  for (int64_t t = 0; t < T; ++t) {
    for_each_selected(map_TE + t * E, e_begin, e_end, [&](const int64_t e) {
      const auto r = static_cast<size_t>(next_X[static_cast<size_t>(e - e_begin)]++);
      out.token_R[r] = t;
      out.probs_R[r] = probs_TE[t * E + e];
    });
  }
  return out;
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
