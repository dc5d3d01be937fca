// The compute of Megatron's VocabParallelEmbedding and vocab_parallel_cross_entropy: a rank holds vocabulary rows /
// logit columns [vocab_begin, vocab_begin + V_local) of V; the caller combines the partial results over the
// tensor-parallel group (sum of embeddings, max then sum of the statistics). Ids outside [0, V) throw
// std::out_of_range naming the id.
#pragma once

#include <cstdint>

namespace moecore::kernels {

#define MOECORE_VOCAB_PARALLEL_DECL                                                                                  \
  /* out_TD[t] = weight_VlD[ids_T[t] - vocab_begin] for ids in this rank's range, zeros elsewhere (overwrites). */   \
  template <typename T>                                                                                              \
  void vocab_embedding_forward(T* out_TD, const int32_t* ids_T, const T* weight_VlD, int64_t n_tokens, int64_t V,    \
                               int64_t vocab_begin, int64_t V_local, int64_t D);                                     \
  /* dweight_VlD[ids_T[t] - vocab_begin] += dout_TD[t] for ids in range (tokens in order: deterministic). */         \
  template <typename T>                                                                                              \
  void vocab_embedding_backward(T* dweight_VlD, const T* dout_TD, const int32_t* ids_T, int64_t n_tokens,            \
                                int64_t vocab_begin, int64_t V_local, int64_t D);                                    \
  /* max_T[t] = max over this rank's logit columns (overwrites). */                                                  \
  template <typename T>                                                                                              \
  void vocab_ce_local_max(T* max_T, const T* logits_TVl, int64_t n_tokens, int64_t V_local);                         \
  /* stats_2T = [sum_v exp(logit - max_T) over this rank's columns | the target's logit if it is a column here, else \
     0] (overwrites; the caller sums it over the group). */                                                          \
  template <typename T>                                                                                              \
  void vocab_ce_local_stats(T* stats_2T, const T* logits_TVl, const T* max_T, const int32_t* targets_T,              \
                            int64_t n_tokens, int64_t V, int64_t vocab_begin, int64_t V_local);                      \
  /* From the group's max and summed stats: lse_T = max + log(sum), losses_T = lse - target logit (overwrite). */    \
  template <typename T>                                                                                              \
  void vocab_ce_finish(T* losses_T, T* lse_T, const T* max_T, const T* stats_2T, int64_t n_tokens);                  \
  /* OVERWRITES dlogits_TVl = dlosses_T[t] * (exp(logit - lse_T[t]) - onehot(target)) on this rank's columns; may    \
     alias logits_TVl. */                                                                                            \
  template <typename T>                                                                                              \
  void vocab_ce_backward(T* dlogits_TVl, const T* dlosses_T, const T* logits_TVl, const T* lse_T,                    \
                         const int32_t* targets_T, int64_t n_tokens, int64_t vocab_begin, int64_t V_local);

namespace cpu {
MOECORE_VOCAB_PARALLEL_DECL
}
namespace ref {
MOECORE_VOCAB_PARALLEL_DECL
}
#undef MOECORE_VOCAB_PARALLEL_DECL

}  // namespace moecore::kernels
