// Fast RMSNorm / LayerNorm: rows in parallel (OpenMP); weight/bias gradients are summed into per-thread
// partial buffers and reduced afterwards, so there is no race and the result does not depend on scheduling
// for a fixed thread count.
#include "moecore/kernels/cpu/norm.h"

#include <omp.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "moecore/kernels/cpu/convert.h"
#include "moecore/kernels/cpu/vector_isa.h"

namespace moecore::kernels::cpu {
namespace {

constexpr int64_t kParallelMinElements = 16384;

int threads_for(const int64_t n_rows, const int64_t D) {
  return n_rows * D >= kParallelMinElements ? omp_get_max_threads() : 1;
}

// Per-thread accumulators for up to two [D] gradients; reduce() adds them into the real outputs.
template <typename T>
class PartialSums {
 public:
  PartialSums(int n_threads, int64_t D, int n_buffers)
      : D_(D),
        n_threads_(n_threads),
        n_buffers_(n_buffers),
        sums_(static_cast<size_t>(n_threads) * static_cast<size_t>(n_buffers * D), T(0)) {}
  T* buffer(int thread, int which) { return sums_.data() + (static_cast<int64_t>(thread) * n_buffers_ + which) * D_; }
  void reduce(T* out_D, int which) {
    if (out_D == nullptr) return;
    for (int thread = 0; thread < n_threads_; ++thread) {
      const T* part = buffer(thread, which);
#pragma omp simd
      for (int64_t d = 0; d < D_; ++d) out_D[d] += part[d];
    }
  }

 private:
  int64_t D_;
  int n_threads_;
  int n_buffers_;
  std::vector<T> sums_;
};

// One row of each kernel (the hot loops, compiled per vector ISA). The forward rows return whether their statistics
// are finite.
template <typename T>
MOECORE_VECTOR_CLONES bool rmsnorm_row(T* y, T& rstd_out, const T* x, const T* weight_D, const int64_t D, const T eps) {
  T sum_sq = T(0);
#pragma omp simd reduction(+ : sum_sq)
  for (int64_t d = 0; d < D; ++d) sum_sq += x[d] * x[d];
  const T mean_sq = sum_sq / static_cast<T>(D);
  const T rstd = T(1) / std::sqrt(mean_sq + eps);
#pragma omp simd
  for (int64_t d = 0; d < D; ++d) y[d] = x[d] * rstd * weight_D[d];
  rstd_out = rstd;
  return std::isfinite(mean_sq);
}

// dx (may be null) += the input gradient of the row; dweight_part += its weight gradient.
template <typename T>
MOECORE_VECTOR_CLONES void rmsnorm_row_backward(T* dx, T* dweight_part, const T* dy, const T* x, const T* weight_D,
                                                const T rstd, const int64_t D) {
  if (dx != nullptr) {
    T sum_gx = T(0);  // sum_d (dy * w)_d x_d
#pragma omp simd reduction(+ : sum_gx)
    for (int64_t d = 0; d < D; ++d) sum_gx += dy[d] * weight_D[d] * x[d];
    const T coeff = sum_gx * rstd * rstd * rstd / static_cast<T>(D);
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) dx[d] += rstd * dy[d] * weight_D[d] - coeff * x[d];
  }
#pragma omp simd
  for (int64_t d = 0; d < D; ++d) dweight_part[d] += dy[d] * x[d] * rstd;
}

template <typename T>
MOECORE_VECTOR_CLONES bool layernorm_row(T* y, T& mean_out, T& rstd_out, const T* x, const T* weight_D, const T* bias_D,
                                         const int64_t D, const T eps) {
  T sum = T(0);
#pragma omp simd reduction(+ : sum)
  for (int64_t d = 0; d < D; ++d) sum += x[d];
  const T mean = sum / static_cast<T>(D);
  T sum_sq = T(0);
#pragma omp simd reduction(+ : sum_sq)
  for (int64_t d = 0; d < D; ++d) sum_sq += (x[d] - mean) * (x[d] - mean);
  const T var = sum_sq / static_cast<T>(D);
  const T rstd = T(1) / std::sqrt(var + eps);
  if (bias_D != nullptr) {
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) y[d] = (x[d] - mean) * rstd * weight_D[d] + bias_D[d];
  } else {
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) y[d] = (x[d] - mean) * rstd * weight_D[d];
  }
  mean_out = mean;
  rstd_out = rstd;
  return std::isfinite(var);  // an overflowed mean makes the variance Inf or NaN too
}

template <typename T>
MOECORE_VECTOR_CLONES void layernorm_row_backward(T* dx, T* dweight_part, T* dbias_part, const T* dy, const T* x,
                                                  const T* weight_D, const T mean, const T rstd, const int64_t D) {
  if (dx != nullptr) {
    T sum_g = T(0);      // sum_d (dy * w)_d
    T sum_gxhat = T(0);  // sum_d (dy * w)_d xhat_d
#pragma omp simd reduction(+ : sum_g, sum_gxhat)
    for (int64_t d = 0; d < D; ++d) {
      const T g = dy[d] * weight_D[d];
      sum_g += g;
      sum_gxhat += g * (x[d] - mean) * rstd;
    }
    const T mean_g = sum_g / static_cast<T>(D);
    const T mean_gxhat = sum_gxhat / static_cast<T>(D);
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) {
      const T xhat = (x[d] - mean) * rstd;
      dx[d] += rstd * (dy[d] * weight_D[d] - mean_g - xhat * mean_gxhat);
    }
  }
#pragma omp simd
  for (int64_t d = 0; d < D; ++d) {
    dweight_part[d] += dy[d] * (x[d] - mean) * rstd;
    dbias_part[d] += dy[d];
  }
}

}  // namespace

template <typename T>
int64_t rmsnorm_forward(T* out_RD, T* rstd_R, const T* inp_RD, const T* weight_D, const int64_t n_rows, const int64_t D,
                        const double eps) {
  const T eps_t = static_cast<T>(eps);
  int64_t nonfinite_rows = 0;
#pragma omp parallel for schedule(static) num_threads(threads_for(n_rows, D)) reduction(+ : nonfinite_rows)
  for (int64_t r = 0; r < n_rows; ++r) {
    if (!rmsnorm_row(out_RD + r * D, rstd_R[r], inp_RD + r * D, weight_D, D, eps_t)) ++nonfinite_rows;
  }
  return nonfinite_rows;
}

template <typename T>
void rmsnorm_backward(T* dinp_RD, T* dweight_D, const T* dout_RD, const T* inp_RD, const T* weight_D, const T* rstd_R,
                      const int64_t n_rows, const int64_t D) {
  const int n_threads = threads_for(n_rows, D);
  PartialSums<T> partial(n_threads, D, 1);
#pragma omp parallel num_threads(n_threads)
  {
    T* dweight_part = partial.buffer(omp_get_thread_num(), 0);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < n_rows; ++r) {
      rmsnorm_row_backward(dinp_RD != nullptr ? dinp_RD + r * D : nullptr, dweight_part, dout_RD + r * D,
                           inp_RD + r * D, weight_D, rstd_R[r], D);
    }
  }
  partial.reduce(dweight_D, 0);
}

template <typename T>
int64_t layernorm_forward(T* out_RD, T* mean_R, T* rstd_R, const T* inp_RD, const T* weight_D, const T* bias_D,
                          const int64_t n_rows, const int64_t D, const double eps) {
  const T eps_t = static_cast<T>(eps);
  int64_t nonfinite_rows = 0;
#pragma omp parallel for schedule(static) num_threads(threads_for(n_rows, D)) reduction(+ : nonfinite_rows)
  for (int64_t r = 0; r < n_rows; ++r) {
    if (!layernorm_row(out_RD + r * D, mean_R[r], rstd_R[r], inp_RD + r * D, weight_D, bias_D, D, eps_t)) {
      ++nonfinite_rows;
    }
  }
  return nonfinite_rows;
}

template <typename T>
void layernorm_backward(T* dinp_RD, T* dweight_D, T* dbias_D, const T* dout_RD, const T* inp_RD, const T* weight_D,
                        const T* mean_R, const T* rstd_R, const int64_t n_rows, const int64_t D) {
  const int n_threads = threads_for(n_rows, D);
  PartialSums<T> partial(n_threads, D, 2);
#pragma omp parallel num_threads(n_threads)
  {
    T* dweight_part = partial.buffer(omp_get_thread_num(), 0);
    T* dbias_part = partial.buffer(omp_get_thread_num(), 1);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < n_rows; ++r) {
      layernorm_row_backward(dinp_RD != nullptr ? dinp_RD + r * D : nullptr, dweight_part, dbias_part, dout_RD + r * D,
                             inp_RD + r * D, weight_D, mean_R[r], rstd_R[r], D);
    }
  }
  partial.reduce(dweight_D, 0);
  partial.reduce(dbias_D, 1);
}

namespace {

// A thread's fp32 rows of the 16-bit backward kernels. Row r sits at the offset from a 64-byte boundary it has in a
// 64-byte aligned fp32 [n_rows, D] tensor, so the vectorised row loops group their sums as on the fp32 path.
class WidenedRows {
 public:
  WidenedRows(const LowpType type, const int64_t D)
      : type_(type),
        isa_(best_convert_isa()),
        slot_((D + 2 * kAlign - 1) / kAlign * kAlign),
        buffer_(static_cast<size_t>(3 * slot_ + kAlign)),
        D_(D) {}
  // Widens row r of dout and inp, and of dinp when it is accumulated into; returns dx (null without dinp).
  float* load(const int64_t r, const uint16_t* dinp_RD, const uint16_t* dout_RD, const uint16_t* inp_RD) {
    const int64_t skew = (r * D_) % kAlign;
    auto* base = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(buffer_.data()) + 63) & ~uintptr_t{63});
    dy_ = base + skew;
    x_ = base + slot_ + skew;
    dx_ = base + 2 * slot_ + skew;
    widen(dy_, dout_RD + r * D_);
    widen(x_, inp_RD + r * D_);
    if (dinp_RD == nullptr) return nullptr;
    widen(dx_, dinp_RD + r * D_);
    return dx_;
  }
  void store(const int64_t r, uint16_t* dinp_RD) const {
    if (dinp_RD == nullptr) return;
    type_ == LowpType::kBF16 ? encode_bf16(dinp_RD + r * D_, dx_, D_, isa_)
                             : encode_fp16(dinp_RD + r * D_, dx_, D_, isa_);
  }
  const float* dy() const { return dy_; }
  const float* x() const { return x_; }

 private:
  static constexpr int64_t kAlign = 16;  // floats in 64 bytes
  void widen(float* out, const uint16_t* in) const {
    type_ == LowpType::kBF16 ? decode_bf16(out, in, D_, isa_) : decode_fp16(out, in, D_, isa_);
  }
  LowpType type_;
  ConvertIsa isa_;
  int64_t slot_;  // floats per row slot: a multiple of kAlign with room for the row at any skew
  std::vector<float> buffer_;
  float *dy_ = nullptr, *x_ = nullptr, *dx_ = nullptr;
  int64_t D_;
};

}  // namespace

void rmsnorm_backward16(const LowpType type, uint16_t* dinp_RD, float* dweight_D, const uint16_t* dout_RD,
                        const uint16_t* inp_RD, const float* weight_D, const float* rstd_R, const int64_t n_rows,
                        const int64_t D) {
  const int n_threads = threads_for(n_rows, D);
  PartialSums<float> partial(n_threads, D, 1);
#pragma omp parallel num_threads(n_threads)
  {
    float* dweight_part = partial.buffer(omp_get_thread_num(), 0);
    WidenedRows rows(type, D);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < n_rows; ++r) {
      float* dx = rows.load(r, dinp_RD, dout_RD, inp_RD);
      rmsnorm_row_backward(dx, dweight_part, rows.dy(), rows.x(), weight_D, rstd_R[r], D);
      rows.store(r, dinp_RD);
    }
  }
  partial.reduce(dweight_D, 0);
}

void layernorm_backward16(const LowpType type, uint16_t* dinp_RD, float* dweight_D, float* dbias_D,
                          const uint16_t* dout_RD, const uint16_t* inp_RD, const float* weight_D, const float* mean_R,
                          const float* rstd_R, const int64_t n_rows, const int64_t D) {
  const int n_threads = threads_for(n_rows, D);
  PartialSums<float> partial(n_threads, D, 2);
#pragma omp parallel num_threads(n_threads)
  {
    float* dweight_part = partial.buffer(omp_get_thread_num(), 0);
    float* dbias_part = partial.buffer(omp_get_thread_num(), 1);
    WidenedRows rows(type, D);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < n_rows; ++r) {
      float* dx = rows.load(r, dinp_RD, dout_RD, inp_RD);
      layernorm_row_backward(dx, dweight_part, dbias_part, rows.dy(), rows.x(), weight_D, mean_R[r], rstd_R[r], D);
      rows.store(r, dinp_RD);
    }
  }
  partial.reduce(dweight_D, 0);
  partial.reduce(dbias_D, 1);
}

#define MOECORE_INSTANTIATE(T)                                                                               \
  template int64_t rmsnorm_forward<T>(T*, T*, const T*, const T*, int64_t, int64_t, double);                 \
  template void rmsnorm_backward<T>(T*, T*, const T*, const T*, const T*, const T*, int64_t, int64_t);       \
  template int64_t layernorm_forward<T>(T*, T*, T*, const T*, const T*, const T*, int64_t, int64_t, double); \
  template void layernorm_backward<T>(T*, T*, T*, const T*, const T*, const T*, const T*, const T*, int64_t, int64_t);
MOECORE_INSTANTIATE(float)
MOECORE_INSTANTIATE(double)
#undef MOECORE_INSTANTIATE

}  // namespace moecore::kernels::cpu
