// Vocabulary-parallel embedding and cross-entropy (Megatron's VocabParallelEmbedding and
// vocab_parallel_cross_entropy): TP rank r holds vocabulary rows [vocab_begin, vocab_begin + V_local) of the
// embedding / output layer, and the full logits [T, V] are never gathered.
#pragma once

#include <cstdint>

#include "moecore/parallel/process_group.h"

namespace moecore::tp {

// out_TH = rows of weight_VlH for the tokens whose id falls in this rank's range, zeros elsewhere (the caller sums
// over TP). Ids outside [0, V) anywhere are an error (std::out_of_range).
void vocab_embedding_forward(float* out_TH, const int32_t* ids_T, const float* weight_VlH, int64_t T, int64_t V,
                             int64_t vocab_begin, int64_t V_local, int64_t H);
// dweight_VlH += dout rows of the tokens in this rank's range (tokens in order: deterministic).
void vocab_embedding_backward(float* dweight_VlH, const float* dout_TH, const int32_t* ids_T, int64_t T,
                              int64_t vocab_begin, int64_t V_local, int64_t H);

// losses_T[t] = logsumexp over the whole vocabulary - logit of the target; lse_T keeps the global log-sum-exp for
// backward. logits_TVl: this rank's vocabulary columns. Collective over `group` (two all-reduces).
void vocab_cross_entropy_forward(float* losses_T, float* lse_T, const float* logits_TVl, const int32_t* targets_T,
                                 int64_t T, int64_t V, int64_t vocab_begin, int64_t V_local,
                                 const parallel::ProcessGroup& group);
// dlogits_TVl = dlosses_T * (softmax - onehot(target)) on this rank's columns; may alias logits_TVl.
void vocab_cross_entropy_backward(float* dlogits_TVl, const float* dlosses_T, const float* logits_TVl,
                                  const float* lse_T, const int32_t* targets_T, int64_t T, int64_t vocab_begin,
                                  int64_t V_local);

}  // namespace moecore::tp
