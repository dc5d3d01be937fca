// The tile products of the fast attention (attention.cpp) on bf16 operands with fp32 accumulation, as FlashAttention-2
// (Dao, 2023) and TransformerEngine's fused attention compute them under bf16: each operand is rounded to bf16
// (nearest even), the products are exact in fp32 and summed in fp32.
//
// gemm_bf16 has sgemm's contract (gemm.h) on bf16 operands. It runs on AMX tiles where the CPU has AMX-BF16 and the
// kernel grants this process the tile state (Linux's arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)), with
// both operands repacked per call into the tiles' layouts (A row-major, B in VNNI pairs: rows 2k and 2k + 1
// interleaved); with AVX512-BF16's vdpbf16ps on the same layouts where that outpaces the fp32 FMAs
// (avx512_bf16_outpaces_fp32, a table of measured CPUs: AMD Zen 5 yes, Intel without AMX no); elsewhere it rounds the
// operands to bf16 values in fp32 and calls sgemm (the same numbers up to the order of the fp32 sums).
#pragma once

#include <bit>
#include <cstdint>
#include <string_view>
#include <vector>

namespace moecore::kernels::cpu {

// Where gemm_bf16 runs: AMX tiles, AVX512-BF16 dot products (vdpbf16ps, on the same packed layouts), or sgemm on
// operands rounded to bf16 values.
enum class Bf16ProductUnit : uint8_t { kAmx, kAvx512Bf16, kEmulated };
// "AMX-BF16 tiles" / "AVX512-BF16 vdpbf16ps" / "sgemm on bf16-rounded operands"
std::string_view bf16_product_unit_name(Bf16ProductUnit unit);
// Whether this CPU (and for AMX the kernel's grant, requested once) can run `unit`.
bool bf16_product_unit_usable(Bf16ProductUnit unit);

// The unit the attention's bf16 products take: the innermost live ScopedBf16ProductUnit, else kAmx where usable, else
// kAvx512Bf16 where usable and avx512_bf16_outpaces_fp32() (measured 1.2-1.6x the fp32 products on Zen 5; on Intel
// it was no faster than the sgemm, bench/RESULTS.md), else kEmulated, which only serves forced bf16 products.
Bf16ProductUnit best_bf16_product_unit();

// Forces the unit process-wide until destroyed (tests, benchmarks); nests. std::invalid_argument for a unit this CPU
// cannot run. Create and destroy it on one thread, outside parallel regions.
class ScopedBf16ProductUnit {
 public:
  explicit ScopedBf16ProductUnit(Bf16ProductUnit unit);
  ~ScopedBf16ProductUnit();
  ScopedBf16ProductUnit(const ScopedBf16ProductUnit&) = delete;
  ScopedBf16ProductUnit& operator=(const ScopedBf16ProductUnit&) = delete;

 private:
  int previous_;
};

// Row-major C[M, N] = alpha op(A) op(B) + beta C with op(A) [M, K] and op(B) [K, N] rounded to bf16 and the products
// summed in fp32. beta is 0 (C not read) or 1. Single-threaded; callable from inside OpenMP regions.
void gemm_bf16(Bf16ProductUnit unit, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
               const float* A, int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc);

// An operand of gemm_bf16_packed, rounded to bf16 and laid out for its unit once, for several products: an A operand
// [M, K] (AMX: row-major bf16, zero-padded to 16 more rows than M rounds up to, and K to a multiple of 32) or a B
// operand [K, N] (AMX: VNNI pairs, rows 2k and 2k + 1 interleaved; K padded to 32, N to 16 more columns than it
// rounds up to). On the emulated unit,
// the rounded values in fp32. Packing again reuses the buffers.
class Bf16Panel {
 public:
  // A = op(src) [M, K] (trans: src is [K, M], leading dimension ld); the K indices below zero_k_before read as 0.
  void pack_a(Bf16ProductUnit unit, bool trans, int64_t M, int64_t K, const float* src, int64_t ld,
              int64_t zero_k_before = 0);
  // B = op(src) [K, N] (trans: src is [N, K]).
  void pack_b(Bf16ProductUnit unit, bool trans, int64_t K, int64_t N, const float* src, int64_t ld);
  // pack_b in slices (packed by several threads): shape_b sizes the panel for B [K, N] of `unit`; pack_b_slice packs
  // what rows [r0, r1) of src give (trans, src [N, K]: B's columns r0..r1; else src [K, N]: B's rows r0..r1), r0 a
  // multiple of 32, src pointing at row 0. Slices that cover all of src's rows fill the panel, the slice reaching
  // the last row its padding too.
  void shape_b(Bf16ProductUnit unit, int64_t K, int64_t N);
  void pack_b_slice(bool trans, const float* src, int64_t ld, int64_t r0, int64_t r1);
  // An A operand [M, K] of a unit with bf16 layouts (not kEmulated) that the caller writes: row m's K bf16 values
  // (bf16_bits) at the returned pointer plus m * a_row_stride(); the padding is zeroed here. For producers that round
  // their own output (the softmax).
  uint16_t* a_for_writing(Bf16ProductUnit unit, int64_t M, int64_t K);
  int64_t a_row_stride() const { return ld_; }

 private:
  friend void gemm_bf16_packed(int64_t M, int64_t N, int64_t K, float alpha, const Bf16Panel& a, int64_t a_row0,
                               const Bf16Panel& b, int64_t b_k0, int64_t b_n0, float beta, float* C, int64_t ldc);
  Bf16ProductUnit unit_ = Bf16ProductUnit::kEmulated;
  bool is_a_ = true;
  int64_t rows_ = 0, cols_ = 0;  // A: M, K; B: K, N
  int64_t ld_ = 0;               // elements of a stored row: AMX A bf16, AMX B 32-bit words, emulated floats
  std::vector<uint16_t> bits_;   // AMX / AVX512-BF16 A
  std::vector<uint32_t> words_;  // AMX / AVX512-BF16 B
  std::vector<uint32_t> staging_;
  std::vector<float> values_;  // emulated
};

// x rounded to bf16 (nearest even; NaN stays NaN), as fp32_to_bf16 of tensor/dtype.h, inline for vector loops.
inline uint16_t bf16_bits(const float x) {
  const uint32_t u = std::bit_cast<uint32_t>(x);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? (u >> 16) | 0x40u : rounded);
}

// C[M, N] = alpha A[a_row0 : a_row0 + M, 0 : K] B[b_k0 : b_k0 + K, b_n0 : b_n0 + N] + beta C (row-major, beta 0 or
// 1), panels of one unit; b_k0 a multiple of 32. std::invalid_argument when the ranges leave the panels.
void gemm_bf16_packed(int64_t M, int64_t N, int64_t K, float alpha, const Bf16Panel& a, int64_t a_row0,
                      const Bf16Panel& b, int64_t b_k0, int64_t b_n0, float beta, float* C, int64_t ldc);

// Whether ops ask for bf16 attention products under bf16 activations (AttentionDims::bf16_products).
enum class AttentionProductPath : uint8_t { kBF16, kF32 };
std::string_view attention_product_path_name(AttentionProductPath path);  // "bf16" / "fp32"
// "bf16" / "fp32"; any other value throws std::invalid_argument naming it (the MOECORE_ATTENTION_PRODUCTS rule).
AttentionProductPath parse_attention_product_path(std::string_view value);
// The innermost live ScopedAttentionProductPath, else the environment variable MOECORE_ATTENTION_PRODUCTS ("bf16" or
// "fp32"; read once; any other non-empty value throws std::invalid_argument), else kBF16 iff
// best_bf16_product_unit() is not kEmulated: without a unit that outpaces the fp32 products they stay fp32.
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
