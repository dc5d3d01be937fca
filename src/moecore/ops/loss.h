// Token embeddings and the softmax cross-entropy on tensors, whole-vocabulary or vocabulary-parallel (a rank holds
// rows / logit columns [vocab_begin, vocab_begin + V_local) of V; the parallel layers combine the pieces over the
// tensor-parallel group). Ids are int32 spans of T tokens; ids outside [0, V) throw std::out_of_range.
#pragma once

#include <cstdint>
#include <span>

#include "moecore/tensor/tensor.h"

namespace moecore::ops {

// out_TD[t] = weight_VlD[ids_T[t] - vocab_begin] for ids in this rank's rows, zeros elsewhere (overwrites).
void embedding_forward(Tensor& out_TD, std::span<const int32_t> ids_T, const Tensor& weight_VlD, int64_t V,
                       int64_t vocab_begin = 0);
// dweight_VlD[ids_T[t] - vocab_begin] += dout_TD[t] for ids in this rank's rows (tokens in order).
void embedding_backward(Tensor& dweight_VlD, const Tensor& dout_TD, std::span<const int32_t> ids_T,
                        int64_t vocab_begin = 0);

// Whole vocabulary: losses_T = lse - logit of the target; lse_T kept for backward (overwrite).
void cross_entropy_forward(Tensor& losses_T, Tensor& lse_T, const Tensor& logits_TV,
                           std::span<const int32_t> targets_T);
// OVERWRITES dlogits_TV = dlosses_T * (softmax - onehot(target)); dlogits may be logits itself (in place).
void cross_entropy_backward(Tensor& dlogits_TV, const Tensor& dlosses_T, const Tensor& logits_TV, const Tensor& lse_T,
                            std::span<const int32_t> targets_T);

// Vocabulary-parallel pieces: max over this rank's columns; [sum exp(logit - max) | target logit or 0] over them;
// then, from the group's max and summed statistics, losses and lse; backward on this rank's columns (overwrites).
void vocab_ce_local_max(Tensor& max_T, const Tensor& logits_TVl);
void vocab_ce_local_stats(Tensor& stats_2T, const Tensor& logits_TVl, const Tensor& max_T,
                          std::span<const int32_t> targets_T, int64_t V, int64_t vocab_begin);
void vocab_ce_finish(Tensor& losses_T, Tensor& lse_T, const Tensor& max_T, const Tensor& stats_2T);
void vocab_ce_backward(Tensor& dlogits_TVl, const Tensor& dlosses_T, const Tensor& logits_TVl, const Tensor& lse_T,
                       std::span<const int32_t> targets_T, int64_t vocab_begin);

}  // namespace moecore::ops
