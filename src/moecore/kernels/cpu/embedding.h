// Embedding lookup. Token ids outside [0, V) throw std::out_of_range naming the id.
#pragma once

#include <cstdint>

namespace moecore::kernels {

#define MOECORE_EMBEDDING_DECL                                                                                         \
  /* out_TD[t] = weight_VD[ids_T[t]] */                                                                                \
  template <typename T>                                                                                                \
  void embedding_forward(T* out_TD, const int32_t* ids_T, const T* weight_VD, int64_t n_tokens, int64_t V, int64_t D); \
  /* dweight_VD[ids_T[t]] += dout_TD[t] */                                                                             \
  template <typename T>                                                                                                \
  void embedding_backward(T* dweight_VD, const T* dout_TD, const int32_t* ids_T, int64_t n_tokens, int64_t V,          \
                          int64_t D);

namespace cpu {
MOECORE_EMBEDDING_DECL
}
namespace ref {
MOECORE_EMBEDDING_DECL
}
#undef MOECORE_EMBEDDING_DECL

}  // namespace moecore::kernels
