// GEMM in every transpose combination (fp32: oneDNN, fp64: CBLAS) and the linear layer built on it.
#pragma once

#include <cstdint>
#include <string>

namespace moecore::kernels {

#define MOECORE_GEMM_DECL                                                                                              \
  /* C[M,N] = alpha * op(A) @ op(B) + beta * C; row-major; op(A) is [M,K], op(B) is [K,N]. */                          \
  template <typename T>                                                                                                \
  void gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, T alpha, const T* A, int64_t lda, const T* B, \
            int64_t ldb, T beta, T* C, int64_t ldc);                                                                   \
  /* out_TO = inp_TI @ weight_OI^T (+ bias_O if non-null). */                                                          \
  template <typename T>                                                                                                \
  void linear_forward(T* out_TO, const T* inp_TI, const T* weight_OI, const T* bias_O, int64_t n_tokens,               \
                      int64_t in_features, int64_t out_features);                                                      \
  /* dinp_TI += dout_TO @ weight_OI; dweight_OI += dout_TO^T @ inp_TI; dbias_O += sum_t dout_TO.                       \
     Any output pointer may be null to skip it. */                                                                     \
  template <typename T>                                                                                                \
  void linear_backward(T* dinp_TI, T* dweight_OI, T* dbias_O, const T* dout_TO, const T* inp_TI, const T* weight_OI,   \
                       int64_t n_tokens, int64_t in_features, int64_t out_features);

namespace cpu {
MOECORE_GEMM_DECL
// fp32 C = alpha op(A) op(B) + beta C, row-major, no argument checks, for kernels that call it on strided views in
// their own loops: oneDNN's dnnl_sgemm, or its matmul primitive on the shapes where that is faster
// (sgemm_uses_matmul).
void sgemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
           const float* B, int64_t ldb, float beta, float* C, int64_t ldc);
// Whether sgemm runs this shape on oneDNN's fp32 matmul primitive rather than dnnl_sgemm: a fixed table of shapes
// measured faster on AVX-512 (gemm.cpp), so the choice, and with it every bit of the result, depends on the shape
// alone.
bool sgemm_uses_matmul(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K);
// "oneDNN 2.6.3 sgemm, AVX-512 kernels": the fp32 GEMM library and the kernel family it picked for this CPU.
std::string gemm_library();
}  // namespace cpu
namespace ref {
MOECORE_GEMM_DECL
inline std::string gemm_library() { return "naive reference loops"; }
}  // namespace ref
#undef MOECORE_GEMM_DECL

}  // namespace moecore::kernels
