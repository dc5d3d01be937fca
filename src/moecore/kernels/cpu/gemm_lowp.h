// Low-precision GEMM and the linear layer on it: A and B hold bf16 (or both fp16) bits, products are summed in fp32,
// and C is fp32 or the inputs' format (rounded to nearest even once, at the end), as Megatron's --bf16 / --fp16
// mixed precision computes its linear layers. Row-major, the transpose combinations of gemm.h.
// The fast version has two paths, chosen at run time (lowp_gemm_path): "native", oneDNN's bf16 / fp16 matmul
// (kernels with the CPU's bf16 / fp16 dot-product instructions), and "convert", the inputs widened to fp32 tile by
// tile and multiplied by the fp32 sgemm of gemm.h. The reference widens to double and rounds once.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace moecore::kernels {

// The format of the uint16_t inputs (and of a uint16_t output).
enum class LowpType : uint8_t { kBF16, kF16 };
std::string_view lowp_type_name(LowpType type);  // "bf16" / "fp16"

#define MOECORE_GEMM_LOWP_DECL                                                                                         \
  /* C[M,N] = alpha * op(A) @ op(B) + beta * C; op(A) is [M,K], op(B) is [K,N]; C is float, or uint16_t of `type`.     \
     beta == 0: C is not read. */                                                                                      \
  template <typename CT>                                                                                               \
  void gemm_lowp(LowpType type, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,              \
                 const uint16_t* A, int64_t lda, const uint16_t* B, int64_t ldb, float beta, CT* C, int64_t ldc);      \
  /* out_TO = inp_TI @ weight_OI^T (+ bias_O if non-null; added in fp32 before the output's rounding). Out, Bias:      \
     float or uint16_t of `type`. */                                                                                   \
  template <typename Out, typename Bias>                                                                               \
  void linear_forward_lowp(LowpType type, Out* out_TO, const uint16_t* inp_TI, const uint16_t* weight_OI,              \
                           const Bias* bias_O, int64_t n_tokens, int64_t in_features, int64_t out_features);           \
  /* dinp_TI += dout_TO @ weight_OI; dweight_OI += dout_TO^T @ inp_TI; dbias_O += sum_t dout_TO; each sum in fp32 and  \
     rounded once into its output's type (float, or uint16_t of `type`). Any output pointer may be null to skip it. */ \
  template <typename DInp, typename DWeight, typename DBias>                                                           \
  void linear_backward_lowp(LowpType type, DInp* dinp_TI, DWeight* dweight_OI, DBias* dbias_O,                         \
                            const uint16_t* dout_TO, const uint16_t* inp_TI, const uint16_t* weight_OI,                \
                            int64_t n_tokens, int64_t in_features, int64_t out_features);

namespace cpu {
MOECORE_GEMM_LOWP_DECL

enum class LowpGemmPath : uint8_t { kNative, kConvert };
std::string_view lowp_gemm_path_name(LowpGemmPath path);  // "native" / "convert"

// Whether the CPU has dot-product instructions for `type` that accumulate in fp32: AVX512_BF16 or AMX-BF16 for bf16,
// AMX-FP16 or AVX512_FP16 for fp16 (the latter multiplies in fp16, so kernels widen the products to fp32).
bool cpu_has_lowp_dot(LowpType type);
// Whether those include a matrix unit this process may use: AMX tiles with bf16 (fp16) support, as oneDNN detects
// them (its effective ISA includes AMX only where the kernel grants the tile state).
bool cpu_has_lowp_amx(LowpType type);
// Whether the native path can run `type` here: oneDNN builds a matmul for it that is not its reference loop. When
// not, *why_not (if given) says why, e.g. "oneDNN 2.6.3 has no CPU fp16 matmul".
bool lowp_native_available(LowpType type, std::string* why_not = nullptr);

// "native" / "convert"; any other value throws std::invalid_argument naming it (the MOECORE_LOWP_GEMM rule).
LowpGemmPath parse_lowp_gemm_path(std::string_view value);

// The path gemm_lowp and the linear functions take for `type`: the innermost live ScopedLowpGemmPath, else the
// environment variable MOECORE_LOWP_GEMM ("native" or "convert"; read once; any other non-empty value throws
// std::invalid_argument), else native iff lowp_native_available(type) and the CPU has AMX tiles for `type`, or, for
// bf16, an AVX512-BF16 dot product that outpaces the fp32 FMAs (avx512_bf16_outpaces_fp32, a table of measured CPUs:
// on Intel without AMX oneDNN 2.6.3's AVX512_BF16 matmul ran at 55-70% of the convert path on moecore's shapes, on
// AMD Zen 5 at 1.6-2.1x; bench/RESULTS.md, bench_gemm_lowp). A forced native path that is not available makes the
// GEMMs throw std::runtime_error saying why.
LowpGemmPath lowp_gemm_path(LowpType type);

// Forces a path process-wide until destroyed (tests, benchmarks); nests and restores the previous choice. Create and
// destroy it on one thread, outside parallel regions.
class ScopedLowpGemmPath {
 public:
  explicit ScopedLowpGemmPath(LowpGemmPath path);
  ~ScopedLowpGemmPath();
  ScopedLowpGemmPath(const ScopedLowpGemmPath&) = delete;
  ScopedLowpGemmPath& operator=(const ScopedLowpGemmPath&) = delete;

 private:
  int previous_;
};

// The path in words: "oneDNN 2.6.3 bf16 matmul, brg:avx512_core_bf16 kernels" or "bf16 -> fp32 conversion
// (AVX-512 BF16) + oneDNN 2.6.3 sgemm, AVX-512 BF16 kernels"; the first form for lowp_gemm_path(type).
std::string gemm_lowp_library(LowpType type);
std::string gemm_lowp_library(LowpType type, LowpGemmPath path);
// Whether a 16-bit layer's fp32-held operands go to the native 16-bit GEMM (lowp_gemm_path(type) is kNative).
bool lowp_gemm_native(LowpType type);
}  // namespace cpu

namespace ref {
MOECORE_GEMM_LOWP_DECL
// The reference always takes the fp32 "convert" path.
inline bool lowp_gemm_native(LowpType) { return false; }
inline std::string gemm_lowp_library(LowpType) { return "fp32 conversion + naive reference loops"; }
}  // namespace ref
#undef MOECORE_GEMM_LOWP_DECL

}  // namespace moecore::kernels
