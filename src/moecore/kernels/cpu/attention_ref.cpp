// Naive causal GQA attention: plain loops in double over the full S x Sk probability matrix of each head, the mask
// evaluated pair by pair from the rows' indices and documents (attention.h). Backward follows the formulas
// literally: P = exp(s - lse) from q, k and the given lse, rowsum(dP * P) = dout . out from the given out (so that
// with the final out and lse of a merged attention it gives one key block's share); dP and dS are formed in full.
// With AttentionDims::bf16_products every operand of a product is rounded to bf16 first: q, k, v, dout, the
// probabilities (forward: exp(s - row max), normalised after the product; backward: P times the dropout multiplier)
// and the scaled score gradients dS.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "moecore/kernels/cpu/attention.h"
#include "moecore/kernels/cpu/attention_checks.h"
#include "moecore/tensor/dtype.h"
#include "moecore/tensor/rng.h"

namespace moecore::kernels::ref {
namespace {

constexpr double kMinusInf = -std::numeric_limits<double>::infinity();

// x as a product operand: rounded to bf16 under bf16 products.
inline double operand(const double x, const bool bf16) {
  return bf16 ? static_cast<double>(bf16_to_fp32(fp32_to_bf16(static_cast<float>(x)))) : x;
}

// Which key each query row sees, and the dropout multipliers.
struct Mask {
  Mask(const AttentionDims& dims, const DropoutSpec& dropout)
      : dims_(dims),
        Sk(detail::key_rows(dims)),
        L(detail::dropout_seq_len(dims)),
        heads(dims.dropout_total_heads > 0 ? dims.dropout_total_heads : dims.N),
        dropout_(dropout),
        rng_(dropout.seed, dropout.key) {}
  int64_t q_pos(int64_t i) const { return dims_.q_index != nullptr ? dims_.q_index[i] : i; }
  int64_t k_pos(int64_t j) const { return dims_.k_index != nullptr ? dims_.k_index[j] : j; }
  bool sees(int64_t b, int64_t i, int64_t j) const {
    if (k_pos(j) > q_pos(i)) return false;
    return dims_.q_document_SB == nullptr ||
           dims_.q_document_SB[i * dims_.B + b] == dims_.k_document_SB[j * dims_.B + b];
  }
  // 0 (dropped) or 1 / (1 - p).
  double multiplier(int64_t b, int64_t h, int64_t i, int64_t j) const {
    const auto counter =
        static_cast<uint64_t>(((b * heads + dims_.dropout_head_offset + h) * L + q_pos(i)) * L + k_pos(j));
    const bool dropped = dropout_.p > 0.0f && rng_.uniform(counter) < dropout_.p;
    return dropped ? 0.0 : 1.0 / (1.0 - static_cast<double>(dropout_.p));
  }

  const AttentionDims& dims_;
  int64_t Sk, L, heads;
  DropoutSpec dropout_;
  CounterRng rng_;
};

// The scaled scores of head (b, h): s[i][j] for visible pairs, -inf elsewhere.
template <typename T>
void head_scores(std::vector<double>& s, const T* q, const T* k, const AttentionDims& dims, const Mask& mask, int64_t b,
                 int64_t h) {
  const int64_t S = dims.S, Sk = mask.Sk, B = dims.B, N = dims.N, G = dims.G, d = dims.head_dim, g = h / (N / G);
  s.assign(S * Sk, kMinusInf);
  for (int64_t i = 0; i < S; ++i) {
    for (int64_t j = 0; j < Sk; ++j) {
      if (!mask.sees(b, i, j)) continue;
      double dot = 0.0;
      for (int64_t c = 0; c < d; ++c) {
        dot += operand(static_cast<double>(q[((i * B + b) * N + h) * d + c]), dims.bf16_products) *
               operand(static_cast<double>(k[((j * B + b) * G + g) * d + c]), dims.bf16_products);
      }
      s[i * Sk + j] = dot * dims.scale;
    }
  }
}

}  // namespace

template <typename T>
void attention_forward(T* out_SBNd, T* lse_BNS, const T* q_SBNd, const T* k_SBGd, const T* v_SBGd,
                       const AttentionDims& dims, const DropoutSpec& dropout) {
  detail::check_attention_args(dims, dropout, "ref::attention_forward");
  const Mask mask(dims, dropout);
  const int64_t S = dims.S, Sk = mask.Sk, B = dims.B, N = dims.N, G = dims.G, dv = detail::value_dim(dims);
  std::vector<double> s, M(Sk);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < N; ++h) {
      const int64_t g = h / (N / G);
      head_scores(s, q_SBNd, k_SBGd, dims, mask, b, h);
      for (int64_t i = 0; i < S; ++i) {
        double* row = s.data() + i * Sk;
        const double row_max = *std::max_element(row, row + Sk);
        double lse = kMinusInf, sum = 0.0;
        if (row_max != kMinusInf) {
          for (int64_t j = 0; j < Sk; ++j) sum += std::exp(row[j] - row_max);
          lse = row_max + std::log(sum);
        }
        lse_BNS[(b * N + h) * S + i] = static_cast<T>(lse);
        // The row's probabilities (0 where masked) and dropout multipliers.
        for (int64_t j = 0; j < Sk; ++j) {
          const bool visible = row[j] != kMinusInf;
          if (dims.bf16_products) {
            row[j] = visible ? operand(std::exp(row[j] - row_max), true) / sum : 0.0;
          } else {
            row[j] = visible ? std::exp(row[j] - lse) : 0.0;
          }
          M[j] = visible ? mask.multiplier(b, h, i, j) : 0.0;
        }
        for (int64_t c = 0; c < dv; ++c) {
          double acc = 0.0;
          for (int64_t j = 0; j < Sk; ++j) {
            acc += row[j] * M[j] *
                   operand(static_cast<double>(v_SBGd[((j * B + b) * G + g) * dv + c]), dims.bf16_products);
          }
          out_SBNd[((i * B + b) * N + h) * dv + c] = static_cast<T>(acc);
        }
      }
    }
  }
}

template <typename T>
void attention_backward(T* dq_SBNd, T* dk_SBGd, T* dv_SBGd, const T* dout_SBNd, const T* q_SBNd, const T* k_SBGd,
                        const T* v_SBGd, const T* out_SBNd, const T* lse_BNS, const AttentionDims& dims,
                        const DropoutSpec& dropout) {
  detail::check_attention_args(dims, dropout, "ref::attention_backward");
  const Mask mask(dims, dropout);
  const int64_t S = dims.S, Sk = mask.Sk, B = dims.B, N = dims.N, G = dims.G, d = dims.head_dim,
                dv = detail::value_dim(dims);
  std::vector<double> s, P(S * Sk), M(S * Sk), dS(S * Sk);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < N; ++h) {
      const int64_t g = h / (N / G);
      head_scores(s, q_SBNd, k_SBGd, dims, mask, b, h);
      const bool bf16 = dims.bf16_products;
      auto q_at = [&](int64_t i, int64_t c) {
        return operand(static_cast<double>(q_SBNd[((i * B + b) * N + h) * d + c]), bf16);
      };
      auto dout_at = [&](int64_t i, int64_t c) {
        return operand(static_cast<double>(dout_SBNd[((i * B + b) * N + h) * dv + c]), bf16);
      };
      auto k_at = [&](int64_t j, int64_t c) {
        return operand(static_cast<double>(k_SBGd[((j * B + b) * G + g) * d + c]), bf16);
      };
      auto v_at = [&](int64_t j, int64_t c) {
        return operand(static_cast<double>(v_SBGd[((j * B + b) * G + g) * dv + c]), bf16);
      };
      auto k_index = [&](int64_t j, int64_t c) { return ((j * B + b) * G + g) * d + c; };
      auto v_index = [&](int64_t j, int64_t c) { return ((j * B + b) * G + g) * dv + c; };
      // P = exp(s - lse) (0 where masked), M = the dropout multipliers.
      for (int64_t i = 0; i < S; ++i) {
        const double lse = static_cast<double>(lse_BNS[(b * N + h) * S + i]);
        for (int64_t j = 0; j < Sk; ++j) {
          const bool visible = s[i * Sk + j] != kMinusInf && lse != kMinusInf;
          P[i * Sk + j] = visible ? std::exp(s[i * Sk + j] - lse) : 0.0;
          M[i * Sk + j] = visible ? mask.multiplier(b, h, i, j) : 0.0;
        }
      }
      // dV += (P * M)^T dout.
      for (int64_t j = 0; j < Sk; ++j) {
        for (int64_t c = 0; c < dv; ++c) {
          double acc = 0.0;
          for (int64_t i = 0; i < S; ++i) acc += operand(P[i * Sk + j] * M[i * Sk + j], bf16) * dout_at(i, c);
          dv_SBGd[v_index(j, c)] += static_cast<T>(acc);
        }
      }
      // dP = (dout v^T) * M; dS = P * (dP - dout . out).
      for (int64_t i = 0; i < S; ++i) {
        double delta = 0.0;
        for (int64_t c = 0; c < dv; ++c) {
          delta += dout_at(i, c) * static_cast<double>(out_SBNd[((i * B + b) * N + h) * dv + c]);
        }
        for (int64_t j = 0; j < Sk; ++j) {
          dS[i * Sk + j] = 0.0;
          if (P[i * Sk + j] == 0.0) continue;
          double dot = 0.0;
          for (int64_t c = 0; c < dv; ++c) dot += dout_at(i, c) * v_at(j, c);
          dS[i * Sk + j] = P[i * Sk + j] * (dot * M[i * Sk + j] - delta);
          if (bf16) dS[i * Sk + j] = operand(dS[i * Sk + j] * dims.scale, true);
        }
      }
      // dq += scale dS k; dk += scale dS^T q (under bf16 products the scale is already in the rounded dS).
      const double dS_scale = bf16 ? 1.0 : dims.scale;
      for (int64_t i = 0; i < S; ++i) {
        for (int64_t c = 0; c < d; ++c) {
          double acc = 0.0;
          for (int64_t j = 0; j < Sk; ++j) acc += dS[i * Sk + j] * k_at(j, c);
          dq_SBNd[((i * B + b) * N + h) * d + c] += static_cast<T>(acc * dS_scale);
        }
      }
      for (int64_t j = 0; j < Sk; ++j) {
        for (int64_t c = 0; c < d; ++c) {
          double acc = 0.0;
          for (int64_t i = 0; i < S; ++i) acc += dS[i * Sk + j] * q_at(i, c);
          dk_SBGd[k_index(j, c)] += static_cast<T>(acc * dS_scale);
        }
      }
    }
  }
}

template <typename T>
void attention_merge(T* out_SBNd, T* lse_BNS, const T* part_out_SBNd, const T* part_lse_BNS,
                     const AttentionDims& dims) {
  detail::check_merge_args(dims, "ref::attention_merge");
  const int64_t S = dims.S, B = dims.B, N = dims.N, dv = detail::value_dim(dims);
  for (int64_t i = 0; i < S; ++i) {
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t h = 0; h < N; ++h) {
        const int64_t at = (b * N + h) * S + i;
        const double a = static_cast<double>(lse_BNS[at]), p = static_cast<double>(part_lse_BNS[at]);
        const double m = std::max(a, p);
        if (m == kMinusInf) continue;  // neither side saw a key
        const double lse = m + std::log(std::exp(a - m) + std::exp(p - m));
        const double wa = std::exp(a - lse), wp = std::exp(p - lse);
        T* out = out_SBNd + ((i * B + b) * N + h) * dv;
        const T* part = part_out_SBNd + ((i * B + b) * N + h) * dv;
        for (int64_t c = 0; c < dv; ++c) {
          // A side that saw no key has weight 0 and contributes nothing, whatever its row holds.
          const double from_a = wa > 0.0 ? wa * static_cast<double>(out[c]) : 0.0;
          const double from_p = wp > 0.0 ? wp * static_cast<double>(part[c]) : 0.0;
          out[c] = static_cast<T>(from_a + from_p);
        }
        lse_BNS[at] = static_cast<T>(lse);
      }
    }
  }
}

#define MOECORE_ATTENTION_INSTANTIATE(T)                                                                              \
  template void attention_forward<T>(T*, T*, const T*, const T*, const T*, const AttentionDims&, const DropoutSpec&); \
  template void attention_backward<T>(T*, T*, T*, const T*, const T*, const T*, const T*, const T*, const T*,         \
                                      const AttentionDims&, const DropoutSpec&);                                      \
  template void attention_merge<T>(T*, T*, const T*, const T*, const AttentionDims&);
MOECORE_ATTENTION_INSTANTIATE(float)
MOECORE_ATTENTION_INSTANTIATE(double)
#undef MOECORE_ATTENTION_INSTANTIATE

}  // namespace moecore::kernels::ref
