// The tile products of the fast attention (attention.cpp) on bf16 operands with fp32 accumulation, as FlashAttention-2
// (Dao, 2023) and TransformerEngine's fused attention compute them under bf16: each operand is rounded to bf16
// (nearest even), the products are exact in fp32 and summed in fp32.
//
// gemm_bf16 has sgemm's contract (gemm.h) on bf16 operands. It runs on AMX tiles where the CPU has AMX-BF16 and the
// kernel grants this process the tile state (Linux's arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)), with
// both operands repacked per call into the tiles' layouts (A row-major, B in VNNI pairs: rows 2k and 2k + 1
// interleaved); elsewhere it rounds the operands to bf16 values in fp32 and calls sgemm (the same numbers up to the
// order of the fp32 sums). AVX512-BF16's vdpbf16ps is not used: it peaks at the rate of the fp32 FMAs it replaces
// (gemm_lowp.h), so it would not beat sgemm on these shapes.
#pragma once

#include <cstdint>
#include <string_view>

namespace moecore::kernels::cpu {

// Where gemm_bf16 runs: AMX tiles, or sgemm on operands rounded to bf16 values.
enum class Bf16ProductUnit : uint8_t { kAmx, kEmulated };
std::string_view bf16_product_unit_name(Bf16ProductUnit unit);  // "AMX-BF16 tiles" / "sgemm on bf16-rounded operands"

// kAmx where usable (CPU flags and the kernel's grant, requested once), else kEmulated.
Bf16ProductUnit best_bf16_product_unit();

// Row-major C[M, N] = alpha op(A) op(B) + beta C with op(A) [M, K] and op(B) [K, N] rounded to bf16 and the products
// summed in fp32. beta is 0 (C not read) or 1. Single-threaded; callable from inside OpenMP regions.
void gemm_bf16(Bf16ProductUnit unit, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
               const float* A, int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc);

// Whether ops ask for bf16 attention products under bf16 activations (AttentionDims::bf16_products).
enum class AttentionProductPath : uint8_t { kBF16, kF32 };
std::string_view attention_product_path_name(AttentionProductPath path);  // "bf16" / "fp32"
// "bf16" / "fp32"; any other value throws std::invalid_argument naming it (the MOECORE_ATTENTION_PRODUCTS rule).
AttentionProductPath parse_attention_product_path(std::string_view value);
// The innermost live ScopedAttentionProductPath, else the environment variable MOECORE_ATTENTION_PRODUCTS ("bf16" or
// "fp32"; read once; any other non-empty value throws std::invalid_argument), else kBF16 iff
// best_bf16_product_unit() is kAmx: without a matrix unit the fp32 products stay as they were.
AttentionProductPath attention_product_path();

// Forces a path process-wide until destroyed (tests, benchmarks); nests. Create and destroy it on one thread,
// outside parallel regions.
class ScopedAttentionProductPath {
 public:
  explicit ScopedAttentionProductPath(AttentionProductPath path);
  ~ScopedAttentionProductPath();
  ScopedAttentionProductPath(const ScopedAttentionProductPath&) = delete;
  ScopedAttentionProductPath& operator=(const ScopedAttentionProductPath&) = delete;

 private:
  int previous_;
};

}  // namespace moecore::kernels::cpu
