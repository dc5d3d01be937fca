// bf16 tile products of the fast attention (attention_products.h). The library targets baseline x86-64: the AMX
// code is in functions compiled for AMX and AVX-512 (GCC's target attribute), reached only after the run-time check.
#include "moecore/kernels/cpu/attention_products.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define MOECORE_AMX_BUILT 1
#include <sys/syscall.h>
#include <unistd.h>
// GCC 12's AVX-512 intrinsics start from _mm512_undefined_*(), which its flow analysis reports as
// maybe-uninitialized once inlined (GCC bug 105593, fixed in GCC 13).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#endif

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <vector>

#include "moecore/kernels/cpu/gemm.h"
#include "moecore/tensor/dtype.h"

namespace moecore::kernels::cpu {
namespace {

int64_t round_up(const int64_t n, const int64_t to) { return (n + to - 1) / to * to; }

// ---- emulated: sgemm on operands rounded to bf16 values -----------------------------------------------------------

// A rows x cols view (leading dimension ld) copied densely (ld = cols) with every value rounded to bf16.
void round_copy(std::vector<float>& out, const float* x, const int64_t rows, const int64_t cols, const int64_t ld) {
  out.resize(static_cast<size_t>(rows * cols));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c)
      out[static_cast<size_t>(r * cols + c)] = bf16_to_fp32(fp32_to_bf16(x[r * ld + c]));
  }
}

void gemm_emulated(const bool trans_a, const bool trans_b, const int64_t M, const int64_t N, const int64_t K,
                   const float alpha, const float* A, const int64_t lda, const float* B, const int64_t ldb,
                   const float beta, float* C, const int64_t ldc) {
  thread_local std::vector<float> a, b;
  const int64_t a_rows = trans_a ? K : M, a_cols = trans_a ? M : K;
  const int64_t b_rows = trans_b ? N : K, b_cols = trans_b ? K : N;
  round_copy(a, A, a_rows, a_cols, lda);
  round_copy(b, B, b_rows, b_cols, ldb);
  sgemm(trans_a, trans_b, M, N, K, alpha, a.data(), a_cols, b.data(), b_cols, beta, C, ldc);
}

#if defined(MOECORE_AMX_BUILT)
// ---- AMX ----------------------------------------------------------------------------------------------------------

#define MOECORE_AMX __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq")))

constexpr long kArchGetXcompPerm = 0x1022, kArchReqXcompPerm = 0x1023;  // Linux arch_prctl codes
constexpr long kXfeatureXtiledata = 18;

bool amx_usable() {
  static const bool usable = [] {
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("amx-tile") || !__builtin_cpu_supports("amx-bf16") ||
        !__builtin_cpu_supports("avx512bw")) {
      return false;
    }
    if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) != 0) return false;
    unsigned long features = 0;
    if (syscall(SYS_arch_prctl, kArchGetXcompPerm, &features) != 0) return false;
    return (features & (1ul << kXfeatureXtiledata)) != 0;
  }();
  return usable;
}

// fp32 -> bf16 bits in the low half of each 32-bit lane, exactly as fp32_to_bf16 (tensor/dtype.h): round to nearest
// even, NaN kept quiet. (vcvtneps2bf16 would flush denormals.)
MOECORE_AMX inline __m512i bf16_lanes(const __m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i high = _mm512_srli_epi32(bits, 16);
  const __m512i bias = _mm512_add_epi32(_mm512_and_si512(high, _mm512_set1_epi32(1)), _mm512_set1_epi32(0x7fff));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, bias), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  return _mm512_mask_mov_epi32(rounded, nan, _mm512_or_si512(high, _mm512_set1_epi32(0x40)));
}

MOECORE_AMX inline __mmask16 lanes_below(const int64_t n) {
  if (n <= 0) return 0;
  return n >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << n) - 1u);
}

// dst[r][c] (bf16, ld_dst) = src[r][c] for r < rows, c < cols; 0 up to rows_p, cols_p (cols_p a multiple of 16).
MOECORE_AMX void convert_rows(uint16_t* dst, const int64_t ld_dst, const float* src, const int64_t ld_src,
                              const int64_t rows, const int64_t cols, const int64_t rows_p, const int64_t cols_p) {
  for (int64_t r = 0; r < rows_p; ++r) {
    uint16_t* out = dst + r * ld_dst;
    for (int64_t c = 0; c < cols_p; c += 16) {
      const __mmask16 m = r < rows ? lanes_below(cols - c) : 0;
      const __m512i lanes = bf16_lanes(_mm512_maskz_loadu_ps(m, src + r * ld_src + c));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + c), _mm512_cvtepi32_epi16(lanes));
    }
  }
}

// VNNI pairs: dst[k][n] (32-bit words, ld_dst) = bf16(src[2k][n]) | bf16(src[2k + 1][n]) << 16 for the rows < rows,
// cols < cols of src; 0 up to pairs_p pair rows and cols_p (a multiple of 16) columns.
MOECORE_AMX void interleave_rows(uint32_t* dst, const int64_t ld_dst, const float* src, const int64_t ld_src,
                                 const int64_t rows, const int64_t cols, const int64_t pairs_p, const int64_t cols_p) {
  for (int64_t k = 0; k < pairs_p; ++k) {
    uint32_t* out = dst + k * ld_dst;
    const int64_t r0 = 2 * k, r1 = 2 * k + 1;
    for (int64_t c = 0; c < cols_p; c += 16) {
      const __mmask16 m = lanes_below(cols - c);
      const __m512i lo = bf16_lanes(_mm512_maskz_loadu_ps(r0 < rows ? m : 0, src + r0 * ld_src + c));
      const __m512i hi = bf16_lanes(_mm512_maskz_loadu_ps(r1 < rows ? m : 0, src + r1 * ld_src + c));
      _mm512_storeu_si512(out + c, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
    }
  }
}

// dst[c][r] = src[r][c] (32-bit words), rows and cols multiples of 16: 16 x 16 blocks through registers.
MOECORE_AMX void transpose_words(uint32_t* dst, const int64_t ld_dst, const uint32_t* src, const int64_t ld_src,
                                 const int64_t rows, const int64_t cols) {
  for (int64_t r0 = 0; r0 < rows; r0 += 16) {
    for (int64_t c0 = 0; c0 < cols; c0 += 16) {
      __m512i x[16], y[16];
      for (int i = 0; i < 16; ++i) x[i] = _mm512_loadu_si512(src + (r0 + i) * ld_src + c0);
      for (int i = 0; i < 16; i += 2) {  // 2 x 2 blocks of words
        y[i] = _mm512_unpacklo_epi32(x[i], x[i + 1]);
        y[i + 1] = _mm512_unpackhi_epi32(x[i], x[i + 1]);
      }
      for (int i = 0; i < 16; i += 4) {  // 4 x 4
        for (int j = 0; j < 2; ++j) {
          x[i + j] = _mm512_unpacklo_epi64(y[i + j], y[i + j + 2]);
          x[i + j + 2] = _mm512_unpackhi_epi64(y[i + j], y[i + j + 2]);
        }
      }
      for (int i = 0; i < 16; i += 8) {  // 128-bit lanes: 8 x 8
        for (int j = 0; j < 4; ++j) {
          y[i + j] = _mm512_shuffle_i32x4(x[i + j], x[i + j + 4], 0x88);
          y[i + j + 4] = _mm512_shuffle_i32x4(x[i + j], x[i + j + 4], 0xdd);
        }
      }
      for (int j = 0; j < 8; ++j) {  // 16 x 16
        x[j] = _mm512_shuffle_i32x4(y[j], y[j + 8], 0x88);
        x[j + 8] = _mm512_shuffle_i32x4(y[j], y[j + 8], 0xdd);
      }
      // x[i] now holds column c0 + perm(i) of the block, rows r0..r0+15 in order.
      static constexpr int kColumn[16] = {0, 2, 1, 3, 4, 6, 5, 7, 8, 10, 9, 11, 12, 14, 13, 15};
      for (int i = 0; i < 16; ++i) _mm512_storeu_si512(dst + (c0 + kColumn[i]) * ld_dst + r0, x[i]);
    }
  }
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-3: the 2 x 2 fp32 accumulators of a 32 x 32 block of C; 4-5: A (16 rows x 32 bf16); 6-7: B (16 VNNI
// pair rows x 16 columns). Set at every call: other AMX code (oneDNN) may run on the same thread in between.
MOECORE_AMX void load_tile_config() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = 16;
    config.colsb[t] = 64;
  }
  _tile_loadconfig(&config);
}

// The [16 MT, 16 NT] block of C = A B, A [16 MT, 32 steps] bf16 (lda elements), B VNNI [16 steps, 16 NT] words
// (ldb words), into c (fp32, ldc floats).
template <int MT, int NT>
MOECORE_AMX void amx_block(float* c, const int64_t ldc, const uint16_t* a, const int64_t lda, const uint32_t* b,
                           const int64_t ldb, const int64_t steps) {
  _tile_zero(0);
  if constexpr (NT == 2) _tile_zero(1);
  if constexpr (MT == 2) _tile_zero(2);
  if constexpr (MT == 2 && NT == 2) _tile_zero(3);
  for (int64_t s = 0; s < steps; ++s) {
    _tile_loadd(4, a + s * 32, lda * 2);
    _tile_loadd(6, b + s * 16 * ldb, ldb * 4);
    if constexpr (MT == 2) _tile_loadd(5, a + 16 * lda + s * 32, lda * 2);
    if constexpr (NT == 2) _tile_loadd(7, b + s * 16 * ldb + 16, ldb * 4);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (NT == 2) _tile_dpbf16ps(1, 4, 7);
    if constexpr (MT == 2) _tile_dpbf16ps(2, 5, 6);
    if constexpr (MT == 2 && NT == 2) _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, c, ldc * 4);
  if constexpr (NT == 2) _tile_stored(1, c + 16, ldc * 4);
  if constexpr (MT == 2) _tile_stored(2, c + 16 * ldc, ldc * 4);
  if constexpr (MT == 2 && NT == 2) _tile_stored(3, c + 16 * ldc + 16, ldc * 4);
}

// C[M, N] = alpha acc + beta C for the valid part of the padded accumulator acc (ld_acc).
MOECORE_AMX void finish(float* C, const int64_t ldc, const float* acc, const int64_t ld_acc, const int64_t M,
                        const int64_t N, const float alpha, const float beta) {
  const __m512 a = _mm512_set1_ps(alpha);
  for (int64_t m = 0; m < M; ++m) {
    float* c_row = C + m * ldc;
    const float* acc_row = acc + m * ld_acc;
    for (int64_t n = 0; n < N; n += 16) {
      const __mmask16 k = lanes_below(N - n);
      __m512 v = _mm512_mul_ps(a, _mm512_maskz_loadu_ps(k, acc_row + n));
      if (beta != 0.0f) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(k, c_row + n));
      _mm512_mask_storeu_ps(c_row + n, k, v);
    }
  }
}

struct AmxBuffers {
  std::vector<uint16_t> a;  // A: [Mp, Kp] bf16
  std::vector<uint32_t> b;  // B: [Kp / 2, Np] VNNI words
  std::vector<uint32_t> t;  // a transposed operand before its word transpose
  std::vector<float> c;     // [Mp, Np]
};

MOECORE_AMX void gemm_amx(const bool trans_a, const bool trans_b, const int64_t M, const int64_t N, const int64_t K,
                          const float alpha, const float* A, const int64_t lda, const float* B, const int64_t ldb,
                          const float beta, float* C, const int64_t ldc) {
  thread_local AmxBuffers buf;
  const int64_t Mp = round_up(M, 16), Np = round_up(N, 16), Kp = round_up(K, 32), pairs = Kp / 2;
  buf.a.resize(static_cast<size_t>(Mp * Kp));
  buf.b.resize(static_cast<size_t>(pairs * Np));
  buf.c.resize(static_cast<size_t>(Mp * Np));
  if (trans_a) {  // A = src^T, src [K, M]: VNNI pairs of src's rows, then the words transposed
    buf.t.resize(static_cast<size_t>(pairs * Mp));
    interleave_rows(buf.t.data(), Mp, A, lda, K, M, pairs, Mp);
    transpose_words(reinterpret_cast<uint32_t*>(buf.a.data()), pairs, buf.t.data(), Mp, pairs, Mp);
  } else {
    convert_rows(buf.a.data(), Kp, A, lda, M, K, Mp, Kp);
  }
  if (trans_b) {  // B = src^T, src [N, K]: src's rows in bf16 are the words of B's columns
    buf.t.resize(static_cast<size_t>(Np * pairs));
    convert_rows(reinterpret_cast<uint16_t*>(buf.t.data()), Kp, B, ldb, N, K, Np, Kp);
    transpose_words(buf.b.data(), Np, buf.t.data(), pairs, Np, pairs);
  } else {
    interleave_rows(buf.b.data(), Np, B, ldb, K, N, pairs, Np);
  }
  load_tile_config();
  const int64_t steps = Kp / 32;
  for (int64_t m = 0; m < Mp; m += 32) {
    const bool two_m = m + 32 <= Mp;
    for (int64_t n = 0; n < Np; n += 32) {
      const bool two_n = n + 32 <= Np;
      float* c = buf.c.data() + m * Np + n;
      const uint16_t* a = buf.a.data() + m * Kp;
      const uint32_t* b = buf.b.data() + n;
      if (two_m && two_n) {
        amx_block<2, 2>(c, Np, a, Kp, b, Np, steps);
      } else if (two_m) {
        amx_block<2, 1>(c, Np, a, Kp, b, Np, steps);
      } else if (two_n) {
        amx_block<1, 2>(c, Np, a, Kp, b, Np, steps);
      } else {
        amx_block<1, 1>(c, Np, a, Kp, b, Np, steps);
      }
    }
  }
  _tile_release();
  finish(C, ldc, buf.c.data(), Np, M, N, alpha, beta);
}
#else
bool amx_usable() { return false; }
#endif

// ---- path choice --------------------------------------------------------------------------------------------------

constexpr int kNoOverride = -1;
std::atomic<int> g_path_override{kNoOverride};

int env_path() {
  // Read once; a bad value is reported by every call, so it cannot be missed.
  static const std::string value = [] {
    const char* v = std::getenv("MOECORE_ATTENTION_PRODUCTS");
    return std::string(v == nullptr ? "" : v);
  }();
  return value.empty() ? kNoOverride : static_cast<int>(parse_attention_product_path(value));
}

}  // namespace

std::string_view bf16_product_unit_name(const Bf16ProductUnit unit) {
  return unit == Bf16ProductUnit::kAmx ? "AMX-BF16 tiles" : "sgemm on bf16-rounded operands";
}

Bf16ProductUnit best_bf16_product_unit() { return amx_usable() ? Bf16ProductUnit::kAmx : Bf16ProductUnit::kEmulated; }

void gemm_bf16(const Bf16ProductUnit unit, const bool trans_a, const bool trans_b, const int64_t M, const int64_t N,
               const int64_t K, const float alpha, const float* A, const int64_t lda, const float* B, const int64_t ldb,
               const float beta, float* C, const int64_t ldc) {
  if (beta != 0.0f && beta != 1.0f) throw std::invalid_argument("gemm_bf16: beta must be 0 or 1");
  if (M <= 0 || N <= 0) return;
#if defined(MOECORE_AMX_BUILT)
  if (unit == Bf16ProductUnit::kAmx) {
    if (!amx_usable()) throw std::runtime_error("gemm_bf16: AMX-BF16 tiles are not usable on this CPU / kernel");
    if (K <= 0) {
      // No products: C = beta C.
      for (int64_t m = 0; m < M && beta == 0.0f; ++m) std::fill_n(C + m * ldc, N, 0.0f);
      return;
    }
    return gemm_amx(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
  }
#else
  if (unit == Bf16ProductUnit::kAmx) throw std::runtime_error("gemm_bf16: this build has no AMX code");
#endif
  gemm_emulated(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

std::string_view attention_product_path_name(const AttentionProductPath path) {
  return path == AttentionProductPath::kBF16 ? "bf16" : "fp32";
}

AttentionProductPath parse_attention_product_path(const std::string_view value) {
  if (value == "bf16") return AttentionProductPath::kBF16;
  if (value == "fp32") return AttentionProductPath::kF32;
  throw std::invalid_argument("MOECORE_ATTENTION_PRODUCTS=" + std::string(value) + ": expected bf16 or fp32");
}

AttentionProductPath attention_product_path() {
  const int forced = g_path_override.load();
  if (forced != kNoOverride) return static_cast<AttentionProductPath>(forced);
  const int from_env = env_path();
  if (from_env != kNoOverride) return static_cast<AttentionProductPath>(from_env);
  return best_bf16_product_unit() == Bf16ProductUnit::kAmx ? AttentionProductPath::kBF16 : AttentionProductPath::kF32;
}

ScopedAttentionProductPath::ScopedAttentionProductPath(const AttentionProductPath path)
    : previous_(g_path_override.exchange(static_cast<int>(path))) {}
ScopedAttentionProductPath::~ScopedAttentionProductPath() { g_path_override.store(previous_); }

}  // namespace moecore::kernels::cpu
