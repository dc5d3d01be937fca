// Argument checks and derived sizes shared by the fast and the reference attention kernels (attention.h).
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

#include "moecore/kernels/cpu/attention.h"

namespace moecore::kernels::detail {

inline int64_t key_rows(const AttentionDims& dims) { return dims.Sk > 0 ? dims.Sk : dims.S; }
inline int64_t value_dim(const AttentionDims& dims) { return dims.v_head_dim > 0 ? dims.v_head_dim : dims.head_dim; }
inline int64_t dropout_seq_len(const AttentionDims& dims) {
  return dims.dropout_seq_len > 0 ? dims.dropout_seq_len : dims.S;
}

// Indices [n] (null: none given) are >= 0, and below `limit` when limit > 0.
inline void check_indices(const int64_t* index, const int64_t n, const int64_t limit, const char* what,
                          const std::string& fn) {
  if (index == nullptr) return;
  for (int64_t r = 0; r < n; ++r) {
    if (index[r] < 0 || (limit > 0 && index[r] >= limit)) {
      throw std::invalid_argument(
          fn + ": " + what + "[" + std::to_string(r) + "] = " + std::to_string(index[r]) +
          (limit > 0 ? " is outside [0, dropout_seq_len=" + std::to_string(limit) + ")" : " is negative"));
    }
  }
}

inline void check_attention_args(const AttentionDims& dims, const DropoutSpec& dropout, const std::string& fn) {
  if (dims.S < 0 || dims.B < 0 || dims.N <= 0 || dims.G <= 0 || dims.head_dim <= 0 || dims.N % dims.G != 0 ||
      dims.Sk < 0 || dims.dropout_seq_len < 0 || dims.v_head_dim < 0) {
    throw std::invalid_argument(
        fn + ": bad dims S=" + std::to_string(dims.S) + " Sk=" + std::to_string(dims.Sk) +
        " B=" + std::to_string(dims.B) + " N=" + std::to_string(dims.N) + " G=" + std::to_string(dims.G) +
        " head_dim=" + std::to_string(dims.head_dim) + " v_head_dim=" + std::to_string(dims.v_head_dim) +
        " dropout_seq_len=" + std::to_string(dims.dropout_seq_len) +
        " (need N, G, head_dim > 0, N divisible by G, Sk, v_head_dim and dropout_seq_len >= 0)");
  }
  if (!(dropout.p >= 0.0f && dropout.p < 1.0f)) {
    throw std::invalid_argument(fn + ": dropout p=" + std::to_string(dropout.p) + " is outside [0, 1)");
  }
  if ((dims.q_document_SB == nullptr) != (dims.k_document_SB == nullptr)) {
    throw std::invalid_argument(fn + ": documents given for " + (dims.q_document_SB != nullptr ? "queries" : "keys") +
                                " only (give q_document_SB and k_document_SB, or neither)");
  }
  // With dropout an index at or past L would share its counters with another probability.
  const int64_t limit = dropout.p > 0.0f ? dropout_seq_len(dims) : 0;
  if (limit > 0 && dims.q_index == nullptr && dims.S > limit) {
    throw std::invalid_argument(fn + ": S=" + std::to_string(dims.S) +
                                " query rows exceed dropout_seq_len=" + std::to_string(limit));
  }
  if (limit > 0 && dims.k_index == nullptr && key_rows(dims) > limit) {
    throw std::invalid_argument(fn + ": Sk=" + std::to_string(key_rows(dims)) +
                                " key rows exceed dropout_seq_len=" + std::to_string(limit));
  }
  check_indices(dims.q_index, dims.S, limit, "q_index", fn);
  check_indices(dims.k_index, key_rows(dims), limit, "k_index", fn);
}

inline void check_merge_args(const AttentionDims& dims, const std::string& fn) {
  if (dims.S < 0 || dims.B < 0 || dims.N <= 0 || dims.head_dim <= 0 || dims.v_head_dim < 0) {
    throw std::invalid_argument(fn + ": bad dims S=" + std::to_string(dims.S) + " B=" + std::to_string(dims.B) +
                                " N=" + std::to_string(dims.N) + " head_dim=" + std::to_string(dims.head_dim) +
                                " v_head_dim=" + std::to_string(dims.v_head_dim) +
                                " (need N, head_dim > 0, v_head_dim >= 0)");
  }
}

}  // namespace moecore::kernels::detail
