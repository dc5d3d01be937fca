// One body for the cpu:: (parallel) and ref:: (serial) vocabulary-parallel kernels: the reference runs the naive
// per-row loops; the fast version spreads rows over threads and uses the dense cross entropy's vectorised row
// pieces (softmax_rows.h). Included by vocab_parallel.cpp and
// vocab_parallel_ref.cpp only.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>

#include "moecore/kernels/cpu/softmax_rows.h"
#include "moecore/kernels/cpu/vocab_parallel.h"

namespace moecore::kernels::vocab_parallel_impl {

inline void check_ids(const int32_t* ids_T, const int64_t n_tokens, const int64_t V, const char* what) {
  for (int64_t t = 0; t < n_tokens; ++t) {
    if (ids_T[t] < 0 || ids_T[t] >= V) {
      throw std::out_of_range(std::string(what) + " id " + std::to_string(ids_T[t]) +
                              " is outside the vocabulary [0, " + std::to_string(V) + ")");
    }
  }
}

template <bool kParallel, typename T>
void embedding_forward(T* out_TD, const int32_t* ids_T, const T* weight_VlD, const int64_t n_tokens, const int64_t V,
                       const int64_t vocab_begin, const int64_t V_local, const int64_t D) {
  check_ids(ids_T, n_tokens, V, "token");
#pragma omp parallel for schedule(static) if (kParallel && n_tokens * D > 65536)
  for (int64_t t = 0; t < n_tokens; ++t) {
    const int64_t row = ids_T[t] - vocab_begin;
    T* out = out_TD + t * D;
    if (row >= 0 && row < V_local) {
      std::memcpy(out, weight_VlD + row * D, sizeof(T) * static_cast<size_t>(D));
    } else {
      std::fill_n(out, D, T(0));
    }
  }
}

template <typename T>
void embedding_backward(T* dweight_VlD, const T* dout_TD, const int32_t* ids_T, const int64_t n_tokens,
                        const int64_t vocab_begin, const int64_t V_local, const int64_t D) {
  for (int64_t t = 0; t < n_tokens; ++t) {
    const int64_t row = ids_T[t] - vocab_begin;
    if (row < 0 || row >= V_local) continue;
    for (int64_t d = 0; d < D; ++d) dweight_VlD[row * D + d] += dout_TD[t * D + d];
  }
}

template <bool kParallel, typename T>
void local_max(T* max_T, const T* logits_TVl, const int64_t n_tokens, const int64_t V_local) {
#pragma omp parallel for schedule(static) if (kParallel)
  for (int64_t t = 0; t < n_tokens; ++t) {
    if constexpr (kParallel) {
      max_T[t] = V_local > 0 ? cpu::softmax_rows::row_max(logits_TVl + t * V_local, V_local)
                             : -std::numeric_limits<T>::infinity();
    } else {
      T m = -std::numeric_limits<T>::infinity();
      for (int64_t v = 0; v < V_local; ++v) m = std::max(m, logits_TVl[t * V_local + v]);
      max_T[t] = m;
    }
  }
}

template <bool kParallel, typename T>
void local_stats(T* stats_2T, const T* logits_TVl, const T* max_T, const int32_t* targets_T, const int64_t n_tokens,
                 const int64_t V, const int64_t vocab_begin, const int64_t V_local) {
  check_ids(targets_T, n_tokens, V, "target");
#pragma omp parallel for schedule(static) if (kParallel)
  for (int64_t t = 0; t < n_tokens; ++t) {
    const T* row = logits_TVl + t * V_local;
    double sum = 0.0;
    if constexpr (kParallel) {
      // The shift is the max over every shard: a finite shift >= this shard's logits (an all -inf row sums to 0).
      if (std::isfinite(max_T[t])) sum = cpu::softmax_rows::sum_exp(row, V_local, max_T[t]);
    } else {
      for (int64_t v = 0; v < V_local; ++v) sum += std::exp(static_cast<double>(row[v] - max_T[t]));
    }
    stats_2T[t] = static_cast<T>(sum);
    const int64_t col = targets_T[t] - vocab_begin;
    stats_2T[n_tokens + t] = (col >= 0 && col < V_local) ? row[col] : T(0);
  }
}

template <typename T>
void finish(T* losses_T, T* lse_T, const T* max_T, const T* stats_2T, const int64_t n_tokens) {
  for (int64_t t = 0; t < n_tokens; ++t) {
    const T lse = max_T[t] + std::log(stats_2T[t]);
    lse_T[t] = lse;
    losses_T[t] = lse - stats_2T[n_tokens + t];
  }
}

template <bool kParallel, typename T>
void ce_backward(T* dlogits_TVl, const T* dlosses_T, const T* logits_TVl, const T* lse_T, const int32_t* targets_T,
                 const int64_t n_tokens, const int64_t vocab_begin, const int64_t V_local) {
#pragma omp parallel for schedule(static) if (kParallel)
  for (int64_t t = 0; t < n_tokens; ++t) {
    const T* row = logits_TVl + t * V_local;
    T* drow = dlogits_TVl + t * V_local;
    const T scale = dlosses_T[t], lse = lse_T[t];
    if constexpr (kParallel) {
      cpu::softmax_rows::scaled_softmax(drow, row, V_local, lse, scale);
    } else {
      for (int64_t v = 0; v < V_local; ++v) drow[v] = scale * std::exp(row[v] - lse);
    }
    const int64_t col = targets_T[t] - vocab_begin;
    if (col >= 0 && col < V_local) drow[col] -= scale;
  }
}

}  // namespace moecore::kernels::vocab_parallel_impl

// Defines the six kernels of vocab_parallel.h in the current namespace.
#define MOECORE_VOCAB_PARALLEL_DEFINE(kParallel)                                                                    \
  template <typename T>                                                                                             \
  void vocab_embedding_forward(T* out_TD, const int32_t* ids_T, const T* weight_VlD, int64_t n_tokens, int64_t V,   \
                               int64_t vocab_begin, int64_t V_local, int64_t D) {                                   \
    vocab_parallel_impl::embedding_forward<kParallel>(out_TD, ids_T, weight_VlD, n_tokens, V, vocab_begin, V_local, \
                                                      D);                                                           \
  }                                                                                                                 \
  template <typename T>                                                                                             \
  void vocab_embedding_backward(T* dweight_VlD, const T* dout_TD, const int32_t* ids_T, int64_t n_tokens,           \
                                int64_t vocab_begin, int64_t V_local, int64_t D) {                                  \
    vocab_parallel_impl::embedding_backward(dweight_VlD, dout_TD, ids_T, n_tokens, vocab_begin, V_local, D);        \
  }                                                                                                                 \
  template <typename T>                                                                                             \
  void vocab_ce_local_max(T* max_T, const T* logits_TVl, int64_t n_tokens, int64_t V_local) {                       \
    vocab_parallel_impl::local_max<kParallel>(max_T, logits_TVl, n_tokens, V_local);                                \
  }                                                                                                                 \
  template <typename T>                                                                                             \
  void vocab_ce_local_stats(T* stats_2T, const T* logits_TVl, const T* max_T, const int32_t* targets_T,             \
                            int64_t n_tokens, int64_t V, int64_t vocab_begin, int64_t V_local) {                    \
    vocab_parallel_impl::local_stats<kParallel>(stats_2T, logits_TVl, max_T, targets_T, n_tokens, V, vocab_begin,   \
                                                V_local);                                                           \
  }                                                                                                                 \
  template <typename T>                                                                                             \
  void vocab_ce_finish(T* losses_T, T* lse_T, const T* max_T, const T* stats_2T, int64_t n_tokens) {                \
    vocab_parallel_impl::finish(losses_T, lse_T, max_T, stats_2T, n_tokens);                                        \
  }                                                                                                                 \
  template <typename T>                                                                                             \
  void vocab_ce_backward(T* dlogits_TVl, const T* dlosses_T, const T* logits_TVl, const T* lse_T,                   \
                         const int32_t* targets_T, int64_t n_tokens, int64_t vocab_begin, int64_t V_local) {        \
    vocab_parallel_impl::ce_backward<kParallel>(dlogits_TVl, dlosses_T, logits_TVl, lse_T, targets_T, n_tokens,     \
                                                vocab_begin, V_local);                                              \
  }

#define MOECORE_VOCAB_PARALLEL_INSTANTIATE(T)                                                                          \
  template void vocab_embedding_forward<T>(T*, const int32_t*, const T*, int64_t, int64_t, int64_t, int64_t, int64_t); \
  template void vocab_embedding_backward<T>(T*, const T*, const int32_t*, int64_t, int64_t, int64_t, int64_t);         \
  template void vocab_ce_local_max<T>(T*, const T*, int64_t, int64_t);                                                 \
  template void vocab_ce_local_stats<T>(T*, const T*, const T*, const int32_t*, int64_t, int64_t, int64_t, int64_t);   \
  template void vocab_ce_finish<T>(T*, T*, const T*, const T*, int64_t);                                               \
  template void vocab_ce_backward<T>(T*, const T*, const T*, const T*, const int32_t*, int64_t, int64_t, int64_t);
