// The output layer and the softmax cross-entropy fused over chunks of tokens: the logits input_TI weight_VI^T are
// made chunk_rows tokens at a time and dropped after use, so the [T, V] logits (a language model's largest
// activation) are never stored whole, in forward or backward. With a vocabulary split over tensor-parallel ranks
// (VocabShard) each chunk's max and statistics are combined over the group as Megatron's
// vocab_parallel_cross_entropy does for the whole logits.
#pragma once

#include <cstdint>
#include <functional>
#include <span>

#include "moecore/tensor/tensor.h"

namespace moecore::ops {

// This rank's vocabulary columns [vocab_begin, vocab_begin + V_local) of V, and the group's reductions (in place,
// over the ranks) of the per-token max [n] and statistics [2 n] of a chunk. Without reductions the weight holds the
// whole vocabulary.
struct VocabShard {
  int64_t V = 0, vocab_begin = 0;
  std::function<void(Tensor& max_n)> reduce_max;
  std::function<void(Tensor& stats_2n)> reduce_sum;
};

// losses_T = logsumexp(logits) - logit of the target, logits = input_TI weight_VI^T (overwrites). With dlosses_T the
// same pass also accumulates the gradients of sum_t dlosses_T[t] losses_T[t] into *dinput_TI and *dweight_VI (either
// may be null): each chunk's softmax gradient is formed where its logits are, so backward needs no logits at all.
// chunk_rows > 0 bounds the transient logits to [chunk_rows, V_local].
void linear_cross_entropy(Tensor& losses_T, const Tensor& input_TI, const Tensor& weight_VI,
                          std::span<const int32_t> targets_T, int64_t chunk_rows, const Tensor* dlosses_T = nullptr,
                          Tensor* dinput_TI = nullptr, Tensor* dweight_VI = nullptr, const VocabShard* shard = nullptr);

// Rows per chunk that keep a chunk's logits within budget_bytes at logit_bytes each: a multiple of the GEMM kernels'
// row blocking where that fits (64 rows for 16-bit logits, 16 for fp32 and fp64 ones), at least 1, at most T.
int64_t linear_cross_entropy_chunk_rows(int64_t T, int64_t V_local, int64_t budget_bytes, int64_t logit_bytes = 4);

// Bytes a logit of the chunk takes in linear_cross_entropy with this weight under the current activation dtype: 2
// where it runs on the native 16-bit GEMMs without a vocabulary split (16-bit logits), else the weight's element size.
int64_t linear_cross_entropy_logit_bytes(const Tensor& weight_VI, bool vocab_split);

}  // namespace moecore::ops
