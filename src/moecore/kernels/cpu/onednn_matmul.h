// oneDNN's matmul primitive, compiled once per shape and kept: the fp32 GEMMs of the shapes where it beats
// dnnl_sgemm (gemm.cpp) and the native bf16 / fp16 GEMMs (gemm_lowp.cpp) run on it.
#pragma once

#include <cstdint>
#include <string>

namespace moecore::kernels::cpu {

enum class MatmulInput : uint8_t { kF32, kBF16, kF16 };

// Everything a primitive is compiled for; row-major C[M,N] = alpha op(A) op(B) (+ bias_N) + beta C with op(A) [M,K]
// and op(B) [K,N]. C is fp32, or of the inputs' 16-bit format when low_dst. The thread count is part of the key:
// oneDNN splits the work when it creates the primitive (one thread inside an OpenMP parallel region).
struct MatmulShape {
  MatmulInput input = MatmulInput::kF32;
  bool low_dst = false, trans_a = false, trans_b = false, bias = false;
  int64_t M = 0, N = 0, K = 0, lda = 0, ldb = 0, ldc = 0;
  float alpha = 1.0f, beta = 0.0f;
  int threads = 1;
};

// Whether this build can compile matmul primitives (moecore uses oneDNN 2.x's matmul API).
bool onednn_matmul_built();

// oneDNN's implementation for `shape` ("brg:avx512_core_amx"), or "" when it has none or the build has no matmul.
std::string onednn_matmul_impl(const MatmulShape& shape);

// Runs `shape` on A, B, C (and the fp32 bias_N when shape.bias) with the cached primitive, compiling it on first
// use (0.3-1.3 ms; the cache is bounded). Throws std::runtime_error naming `caller` when oneDNN has no
// implementation for the shape.
void onednn_matmul(const char* caller, const MatmulShape& shape, const void* A, const void* B, void* C,
                   const float* bias_N);

// The thread count a matmul called here runs on: 1 inside a parallel region, else OpenMP's maximum.
int onednn_matmul_threads();

}  // namespace moecore::kernels::cpu
