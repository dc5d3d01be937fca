// Naive causal GQA attention: plain loops in double over the full S x S probability matrix of each head.
// Backward recomputes the softmax from q and k on its own (it does not trust lse or out) and uses
// rowsum(dP * P) directly, so it is an independent check of the fast version's shortcuts.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "moecore/kernels/cpu/attention.h"
#include "moecore/tensor/rng.h"

namespace moecore::kernels::ref {
namespace {

void check_args(const AttentionDims& dims, const DropoutSpec& dropout, const char* fn) {
  if (dims.S < 0 || dims.B < 0 || dims.N <= 0 || dims.G <= 0 || dims.head_dim <= 0 || dims.N % dims.G != 0) {
    throw std::invalid_argument(std::string(fn) + ": bad dims (need N, G, head_dim > 0 and N divisible by G)");
  }
  if (!(dropout.p >= 0.0f && dropout.p < 1.0f)) {
    throw std::invalid_argument(std::string(fn) + ": dropout p=" + std::to_string(dropout.p) + " is outside [0, 1)");
  }
}

// The probabilities of head (b, h): P[i][j] (zero for j > i), and the dropout multipliers mask[i][j]
// (0 or 1/(1-p)). Returns the row log-sum-exp.
template <typename T>
std::vector<double> head_probs(std::vector<double>& P, std::vector<double>& mask, const T* q, const T* k,
                               const AttentionDims& dims, const DropoutSpec& dropout, int64_t b, int64_t h) {
  const int64_t S = dims.S, B = dims.B, N = dims.N, G = dims.G, d = dims.head_dim, g = h / (N / G);
  const CounterRng rng(dropout.seed, dropout.key);
  std::vector<double> lse(S);
  P.assign(S * S, 0.0);
  mask.assign(S * S, 0.0);
  for (int64_t i = 0; i < S; ++i) {
    double row_max = -INFINITY;
    for (int64_t j = 0; j <= i; ++j) {
      double dot = 0.0;
      for (int64_t c = 0; c < d; ++c) {
        dot += static_cast<double>(q[((i * B + b) * N + h) * d + c]) *
               static_cast<double>(k[((j * B + b) * G + g) * d + c]);
      }
      P[i * S + j] = dot * dims.scale;
      row_max = std::max(row_max, P[i * S + j]);
    }
    double sum = 0.0;
    for (int64_t j = 0; j <= i; ++j) sum += std::exp(P[i * S + j] - row_max);
    lse[i] = row_max + std::log(sum);
    for (int64_t j = 0; j <= i; ++j) {
      P[i * S + j] = std::exp(P[i * S + j] - lse[i]);
      const int64_t heads = dims.dropout_total_heads > 0 ? dims.dropout_total_heads : N;
      const uint64_t counter = static_cast<uint64_t>(((b * heads + dims.dropout_head_offset + h) * S + i) * S + j);
      const bool dropped = dropout.p > 0.0f && rng.uniform(counter) < dropout.p;
      mask[i * S + j] = dropped ? 0.0 : 1.0 / (1.0 - static_cast<double>(dropout.p));
    }
  }
  return lse;
}

}  // namespace

template <typename T>
void attention_forward(T* out_SBNd, T* lse_BNS, const T* q_SBNd, const T* k_SBGd, const T* v_SBGd,
                       const AttentionDims& dims, const DropoutSpec& dropout) {
  check_args(dims, dropout, "ref::attention_forward");
  const int64_t S = dims.S, B = dims.B, N = dims.N, G = dims.G, d = dims.head_dim;
  std::vector<double> P, mask;
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < N; ++h) {
      const int64_t g = h / (N / G);
      const std::vector<double> lse = head_probs(P, mask, q_SBNd, k_SBGd, dims, dropout, b, h);
      for (int64_t i = 0; i < S; ++i) {
        lse_BNS[(b * N + h) * S + i] = static_cast<T>(lse[i]);
        for (int64_t c = 0; c < d; ++c) {
          double acc = 0.0;
          for (int64_t j = 0; j <= i; ++j) {
            acc += P[i * S + j] * mask[i * S + j] * static_cast<double>(v_SBGd[((j * B + b) * G + g) * d + c]);
          }
          out_SBNd[((i * B + b) * N + h) * d + c] = static_cast<T>(acc);
        }
      }
    }
  }
}

template <typename T>
void attention_backward(T* dq_SBNd, T* dk_SBGd, T* dv_SBGd, const T* dout_SBNd, const T* q_SBNd, const T* k_SBGd,
                        const T* v_SBGd, [[maybe_unused]] const T* out_SBNd, [[maybe_unused]] const T* lse_BNS,
                        const AttentionDims& dims, const DropoutSpec& dropout) {
  check_args(dims, dropout, "ref::attention_backward");
  const int64_t S = dims.S, B = dims.B, N = dims.N, G = dims.G, d = dims.head_dim;
  std::vector<double> P, mask, dP(S * S), dS(S * S);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < N; ++h) {
      const int64_t g = h / (N / G);
      head_probs(P, mask, q_SBNd, k_SBGd, dims, dropout, b, h);
      auto q_at = [&](int64_t i, int64_t c) { return static_cast<double>(q_SBNd[((i * B + b) * N + h) * d + c]); };
      auto dout_at = [&](int64_t i, int64_t c) {
        return static_cast<double>(dout_SBNd[((i * B + b) * N + h) * d + c]);
      };
      auto kv_index = [&](int64_t j, int64_t c) { return ((j * B + b) * G + g) * d + c; };
      // dPd = dout v^T; dP = dPd * mask; dV += (P * mask)^T dout.
      for (int64_t i = 0; i < S; ++i) {
        for (int64_t j = 0; j <= i; ++j) {
          double dot = 0.0;
          for (int64_t c = 0; c < d; ++c) dot += dout_at(i, c) * static_cast<double>(v_SBGd[kv_index(j, c)]);
          dP[i * S + j] = dot * mask[i * S + j];
        }
      }
      for (int64_t j = 0; j < S; ++j) {
        for (int64_t c = 0; c < d; ++c) {
          double acc = 0.0;
          for (int64_t i = j; i < S; ++i) acc += P[i * S + j] * mask[i * S + j] * dout_at(i, c);
          dv_SBGd[kv_index(j, c)] += static_cast<T>(acc);
        }
      }
      // dS = P * (dP - rowsum(dP * P)).
      for (int64_t i = 0; i < S; ++i) {
        double row_dot = 0.0;
        for (int64_t j = 0; j <= i; ++j) row_dot += dP[i * S + j] * P[i * S + j];
        for (int64_t j = 0; j <= i; ++j) dS[i * S + j] = P[i * S + j] * (dP[i * S + j] - row_dot);
      }
      // dq += scale dS k; dk += scale dS^T q.
      for (int64_t i = 0; i < S; ++i) {
        for (int64_t c = 0; c < d; ++c) {
          double acc = 0.0;
          for (int64_t j = 0; j <= i; ++j) acc += dS[i * S + j] * static_cast<double>(k_SBGd[kv_index(j, c)]);
          dq_SBNd[((i * B + b) * N + h) * d + c] += static_cast<T>(acc * dims.scale);
        }
      }
      for (int64_t j = 0; j < S; ++j) {
        for (int64_t c = 0; c < d; ++c) {
          double acc = 0.0;
          for (int64_t i = j; i < S; ++i) acc += dS[i * S + j] * q_at(i, c);
          dk_SBGd[kv_index(j, c)] += static_cast<T>(acc * dims.scale);
        }
      }
    }
  }
}

#define MOECORE_ATTENTION_INSTANTIATE(T)                                                                              \
  template void attention_forward<T>(T*, T*, const T*, const T*, const T*, const AttentionDims&, const DropoutSpec&); \
  template void attention_backward<T>(T*, T*, T*, const T*, const T*, const T*, const T*, const T*, const T*,         \
                                      const AttentionDims&, const DropoutSpec&);
MOECORE_ATTENTION_INSTANTIATE(float)
MOECORE_ATTENTION_INSTANTIATE(double)
#undef MOECORE_ATTENTION_INSTANTIATE

}  // namespace moecore::kernels::ref
