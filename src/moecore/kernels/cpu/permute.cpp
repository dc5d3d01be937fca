// Token permutation kernels (OpenMP over rows or destinations; plain copies and in-order sums, so every result is
// the same bit for bit whatever the thread count).
#include "moecore/kernels/cpu/permute.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "moecore/kernels/cpu/convert.h"
#include "moecore/kernels/cpu/rows_by_destination.h"

namespace moecore::kernels::cpu {
namespace {
constexpr int64_t kParallelMin = 16384;
}  // namespace

// out += row (times probs_R[r] when given).
template <typename T>
inline void add_row(T* out, const T* in_RW, const T* probs_R, const int64_t r, const int64_t W) {
  const T* row = in_RW + r * W;
  if (probs_R == nullptr) {
#pragma omp simd
    for (int64_t w = 0; w < W; ++w) out[w] += row[w];
  } else {
    const T p = probs_R[r];
#pragma omp simd
    for (int64_t w = 0; w < W; ++w) out[w] += p * row[w];
  }
}

template <typename T>
void moe_unpermute(T* out_NW, const T* in_RW, const int64_t* index_R, const T* probs_R, const int64_t R,
                   const int64_t N, const int64_t W) {
  if (R * W <= kParallelMin) {
    // Little work (one thread): the rows in ascending r, each destination's sum in the order the parallel loop
    // below keeps, without its pass over all N destinations (the router's [T E, 1] probability gradients).
    for (int64_t r = 0; r < R; ++r) {
      if (index_R[r] >= 0) add_row(out_NW + index_R[r] * W, in_RW, probs_R, r, W);
    }
    return;
  }
  const detail::RowsByDestination by_destination = detail::rows_by_destination(index_R, R, N);
  const std::vector<int64_t>& begin_N1 = by_destination.begin_N1;
  const std::vector<int64_t>& rows = by_destination.rows;
#pragma omp parallel for schedule(static) if (N * W > kParallelMin)
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t i = begin_N1[n]; i < begin_N1[n + 1]; ++i) {
      add_row(out_NW + n * W, in_RW, probs_R, rows[static_cast<size_t>(i)], W);
    }
  }
}

template <typename T>
void moe_unpermute_backward(T* din_RW, T* dprobs_R, const T* dout_NW, const T* in_RW, const int64_t* index_R,
                            const T* probs_R, const int64_t R, const int64_t W) {
#pragma omp parallel for schedule(static) if (R * W > kParallelMin)
  for (int64_t r = 0; r < R; ++r) {
    const int64_t n = index_R[r];
    if (din_RW != nullptr) {
      T* din = din_RW + r * W;
      if (n < 0) {
        std::fill_n(din, W, T(0));
      } else if (probs_R == nullptr) {
        std::memcpy(din, dout_NW + n * W, sizeof(T) * static_cast<size_t>(W));
      } else {
        const T p = probs_R[r];
        const T* dout = dout_NW + n * W;
#pragma omp simd
        for (int64_t w = 0; w < W; ++w) din[w] = p * dout[w];
      }
    }
    if (dprobs_R != nullptr) {
      double dot = 0.0;
      if (n >= 0) {
        const T* dout = dout_NW + n * W;
        const T* in = in_RW + r * W;
        for (int64_t w = 0; w < W; ++w) dot += static_cast<double>(dout[w]) * static_cast<double>(in[w]);
      }
      dprobs_R[r] = static_cast<T>(dot);
    }
  }
}

template <typename T>
void sort_chunks(T* out_RW, const T* in_NW, const int64_t* first_C, const int64_t* rows_C, const int64_t C,
                 const int64_t W) {
  std::vector<int64_t> out_first_C1(static_cast<size_t>(C + 1), 0);
  for (int64_t c = 0; c < C; ++c) out_first_C1[c + 1] = out_first_C1[c] + rows_C[c];
#pragma omp parallel for schedule(dynamic, 1) if (out_first_C1[C] * W > kParallelMin)
  for (int64_t c = 0; c < C; ++c) {
    if (rows_C[c] * W == 0) continue;  // an empty chunk (its buffers may be null)
    std::memcpy(out_RW + out_first_C1[c] * W, in_NW + first_C[c] * W, sizeof(T) * static_cast<size_t>(rows_C[c] * W));
  }
}

template <typename T>
void unsort_chunks(T* out_NW, const T* in_RW, const int64_t* first_C, const int64_t* rows_C, const int64_t C,
                   const int64_t N, const int64_t W) {
  // Rows no chunk covers are zero: mark the covered ones, clear the rest, then copy the chunks.
  std::vector<uint8_t> covered_N(static_cast<size_t>(N), 0);
  std::vector<int64_t> in_first_C1(static_cast<size_t>(C + 1), 0);
  for (int64_t c = 0; c < C; ++c) {
    in_first_C1[c + 1] = in_first_C1[c] + rows_C[c];
    std::fill_n(covered_N.begin() + first_C[c], rows_C[c], uint8_t{1});
  }
#pragma omp parallel for schedule(static) if (N * W > kParallelMin)
  for (int64_t n = 0; n < N; ++n) {
    if (covered_N[static_cast<size_t>(n)] == 0) std::fill_n(out_NW + n * W, W, T(0));
  }
#pragma omp parallel for schedule(dynamic, 1) if (in_first_C1[C] * W > kParallelMin)
  for (int64_t c = 0; c < C; ++c) {
    if (rows_C[c] * W == 0) continue;  // an empty chunk (its buffers may be null)
    std::memcpy(out_NW + first_C[c] * W, in_RW + in_first_C1[c] * W, sizeof(T) * static_cast<size_t>(rows_C[c] * W));
  }
}

#define MOECORE_INSTANTIATE(T)                                                                                     \
  template void moe_unpermute<T>(T*, const T*, const int64_t*, const T*, int64_t, int64_t, int64_t);               \
  template void moe_unpermute_backward<T>(T*, T*, const T*, const T*, const int64_t*, const T*, int64_t, int64_t); \
  template void sort_chunks<T>(T*, const T*, const int64_t*, const int64_t*, int64_t, int64_t);                    \
  template void unsort_chunks<T>(T*, const T*, const int64_t*, const int64_t*, int64_t, int64_t, int64_t);
MOECORE_INSTANTIATE(float)
MOECORE_INSTANTIATE(double)
#undef MOECORE_INSTANTIATE

namespace {

// A thread's fp32 copies of 16-bit rows.
class RowCodec {
 public:
  RowCodec(const LowpType type, const int64_t W) : type_(type), isa_(best_convert_isa()), W_(W) {}
  void widen(float* out, const uint16_t* in) const {
    type_ == LowpType::kBF16 ? decode_bf16(out, in, W_, isa_) : decode_fp16(out, in, W_, isa_);
  }
  void narrow(uint16_t* out, const float* in) const {
    type_ == LowpType::kBF16 ? encode_bf16(out, in, W_, isa_) : encode_fp16(out, in, W_, isa_);
  }

 private:
  LowpType type_;
  ConvertIsa isa_;
  int64_t W_;
};

}  // namespace

void moe_unpermute16(const LowpType type, uint16_t* out_NW, const uint16_t* in_RW, const int64_t* index_R,
                     const float* probs_R, const int64_t R, const int64_t N, const int64_t W) {
  const detail::RowsByDestination by_destination = detail::rows_by_destination(index_R, R, N);
  const std::vector<int64_t>& begin_N1 = by_destination.begin_N1;
  const std::vector<int64_t>& rows = by_destination.rows;
  const RowCodec codec(type, W);
#pragma omp parallel if (N * W > kParallelMin)
  {
    std::vector<float> out(static_cast<size_t>(W)), row(static_cast<size_t>(W));
#pragma omp for schedule(static)
    for (int64_t n = 0; n < N; ++n) {
      if (begin_N1[n] == begin_N1[n + 1]) continue;  // nothing added: the row keeps its bits
      codec.widen(out.data(), out_NW + n * W);
      for (int64_t i = begin_N1[n]; i < begin_N1[n + 1]; ++i) {
        const int64_t r = rows[static_cast<size_t>(i)];
        codec.widen(row.data(), in_RW + r * W);
        const float p = probs_R == nullptr ? 1.0f : probs_R[r];
        if (probs_R == nullptr) {
#pragma omp simd
          for (int64_t w = 0; w < W; ++w) out[w] += row[w];
        } else {
#pragma omp simd
          for (int64_t w = 0; w < W; ++w) out[w] += p * row[w];
        }
      }
      codec.narrow(out_NW + n * W, out.data());
    }
  }
}

void moe_unpermute_backward16(const LowpType type, uint16_t* din_RW, float* dprobs_R, const uint16_t* dout_NW,
                              const uint16_t* in_RW, const int64_t* index_R, const float* probs_R, const int64_t R,
                              const int64_t W) {
  const RowCodec codec(type, W);
#pragma omp parallel if (R * W > kParallelMin)
  {
    std::vector<float> dout(static_cast<size_t>(W)), in(static_cast<size_t>(W)), din(static_cast<size_t>(W));
#pragma omp for schedule(static)
    for (int64_t r = 0; r < R; ++r) {
      const int64_t n = index_R[r];
      if (n >= 0) codec.widen(dout.data(), dout_NW + n * W);
      if (din_RW != nullptr) {
        if (n < 0) {
          std::fill_n(din_RW + r * W, W, uint16_t{0});
        } else if (probs_R == nullptr) {
          std::memcpy(din_RW + r * W, dout_NW + n * W, sizeof(uint16_t) * static_cast<size_t>(W));
        } else {
          const float p = probs_R[r];
#pragma omp simd
          for (int64_t w = 0; w < W; ++w) din[w] = p * dout[w];
          codec.narrow(din_RW + r * W, din.data());
        }
      }
      if (dprobs_R != nullptr) {
        double dot = 0.0;
        if (n >= 0) {
          codec.widen(in.data(), in_RW + r * W);
          for (int64_t w = 0; w < W; ++w) dot += static_cast<double>(dout[w]) * static_cast<double>(in[w]);
        }
        dprobs_R[r] = static_cast<float>(dot);
      }
    }
  }
}

template void sort_chunks<uint16_t>(uint16_t*, const uint16_t*, const int64_t*, const int64_t*, int64_t, int64_t);
template void unsort_chunks<uint16_t>(uint16_t*, const uint16_t*, const int64_t*, const int64_t*, int64_t, int64_t,
                                      int64_t);

}  // namespace moecore::kernels::cpu
