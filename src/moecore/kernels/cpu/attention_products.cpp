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
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "moecore/kernels/cpu/bf16_dot_rate.h"
#include "moecore/kernels/cpu/gemm.h"
#include "moecore/tensor/dtype.h"

namespace moecore::kernels::cpu {
namespace {

int64_t round_up(const int64_t n, const int64_t to) { return (n + to - 1) / to * to; }

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

// dst[r][c] (bf16, ld_dst) = src[r][c] for r < rows, col0 <= c < cols; 0 elsewhere up to rows_p, cols_p (cols_p a
// multiple of 16).
MOECORE_AMX void convert_rows(uint16_t* dst, const int64_t ld_dst, const float* src, const int64_t ld_src,
                              const int64_t rows, const int64_t cols, const int64_t rows_p, const int64_t cols_p,
                              const int64_t col0 = 0) {
  for (int64_t r = 0; r < rows_p; ++r) {
    uint16_t* out = dst + r * ld_dst;
    for (int64_t c = 0; c < cols_p; c += 16) {
      const __mmask16 m = r < rows ? static_cast<__mmask16>(lanes_below(cols - c) & ~lanes_below(col0 - c)) : 0;
      const __m512i lanes = bf16_lanes(_mm512_maskz_loadu_ps(m, src + r * ld_src + c));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + c), _mm512_cvtepi32_epi16(lanes));
    }
  }
}

// VNNI pairs: dst[k][n] (32-bit words, ld_dst) = bf16(src[2k][n]) | bf16(src[2k + 1][n]) << 16 for the rows
// row0 <= r < rows, cols < cols of src; 0 elsewhere up to pairs_p pair rows and cols_p (a multiple of 16) columns.
MOECORE_AMX void interleave_rows(uint32_t* dst, const int64_t ld_dst, const float* src, const int64_t ld_src,
                                 const int64_t rows, const int64_t cols, const int64_t pairs_p, const int64_t cols_p,
                                 const int64_t row0 = 0) {
  for (int64_t k = 0; k < pairs_p; ++k) {
    uint32_t* out = dst + k * ld_dst;
    const int64_t r0 = 2 * k, r1 = 2 * k + 1;
    const bool in0 = r0 >= row0 && r0 < rows, in1 = r1 >= row0 && r1 < rows;
    for (int64_t c = 0; c < cols_p; c += 16) {
      const __mmask16 m = lanes_below(cols - c);
      const __m512i lo = bf16_lanes(_mm512_maskz_loadu_ps(in0 ? m : 0, src + r0 * ld_src + c));
      const __m512i hi = bf16_lanes(_mm512_maskz_loadu_ps(in1 ? m : 0, src + r1 * ld_src + c));
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

// The [16 MT, 16 NT] block of C (fp32, ldc floats) = A B, or C + A B with load_c; A [16 MT, 32 steps] bf16 (lda
// elements), B VNNI [16 steps, 16 NT] words (ldb words).
template <int MT, int NT>
MOECORE_AMX void amx_block(float* c, const int64_t ldc, const bool load_c, const uint16_t* a, const int64_t lda,
                           const uint32_t* b, const int64_t ldb, const int64_t steps) {
  if (load_c) {
    _tile_loadd(0, c, ldc * 4);
    if constexpr (NT == 2) _tile_loadd(1, c + 16, ldc * 4);
    if constexpr (MT == 2) _tile_loadd(2, c + 16 * ldc, ldc * 4);
    if constexpr (MT == 2 && NT == 2) _tile_loadd(3, c + 16 * ldc + 16, ldc * 4);
  } else {
    _tile_zero(0);
    if constexpr (NT == 2) _tile_zero(1);
    if constexpr (MT == 2) _tile_zero(2);
    if constexpr (MT == 2 && NT == 2) _tile_zero(3);
  }
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

template <int MT, int NT>
MOECORE_AMX void amx_block_into(float* C, const int64_t ldc, const int64_t M, const int64_t N, const float alpha,
                                const float beta, const uint16_t* a, const int64_t lda, const uint32_t* b,
                                const int64_t ldb, const int64_t steps) {
  if (alpha == 1.0f && M >= 16 * MT && N >= 16 * NT) {  // whole tiles inside C: accumulate in place
    return amx_block<MT, NT>(C, ldc, beta != 0.0f, a, lda, b, ldb, steps);
  }
  alignas(64) float acc[32 * 32];
  amx_block<MT, NT>(acc, 32, false, a, lda, b, ldb, steps);
  const __m512 scale = _mm512_set1_ps(alpha);
  for (int64_t m = 0; m < std::min<int64_t>(M, 16 * MT); ++m) {
    for (int64_t n = 0; n < std::min<int64_t>(N, 16 * NT); n += 16) {
      const __mmask16 k = lanes_below(N - n);
      __m512 v = _mm512_mul_ps(scale, _mm512_load_ps(acc + m * 32 + n));
      if (beta != 0.0f) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(k, C + m * ldc + n));
      _mm512_mask_storeu_ps(C + m * ldc + n, k, v);
    }
  }
}

MOECORE_AMX void gemm_amx_packed(const int64_t M, const int64_t N, const int64_t K, const float alpha,
                                 const uint16_t* a, const int64_t lda, const uint32_t* b, const int64_t ldb,
                                 const float beta, float* C, const int64_t ldc) {
  load_tile_config();
  const int64_t steps = round_up(K, 32) / 32, Mp = round_up(M, 16), Np = round_up(N, 16);
  for (int64_t m = 0; m < Mp; m += 32) {
    const bool two_m = m + 32 <= Mp;
    for (int64_t n = 0; n < Np; n += 32) {
      const bool two_n = n + 32 <= Np;
      float* c = C + m * ldc + n;
      const uint16_t* a_m = a + m * lda;
      const uint32_t* b_n = b + n;
      if (two_m && two_n) {
        amx_block_into<2, 2>(c, ldc, M - m, N - n, alpha, beta, a_m, lda, b_n, ldb, steps);
      } else if (two_m) {
        amx_block_into<2, 1>(c, ldc, M - m, N - n, alpha, beta, a_m, lda, b_n, ldb, steps);
      } else if (two_n) {
        amx_block_into<1, 2>(c, ldc, M - m, N - n, alpha, beta, a_m, lda, b_n, ldb, steps);
      } else {
        amx_block_into<1, 1>(c, ldc, M - m, N - n, alpha, beta, a_m, lda, b_n, ldb, steps);
      }
    }
  }
  _tile_release();
}

#define MOECORE_AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

bool avx512_bf16_usable() {
  static const bool usable = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw");
  }();
  return usable;
}

// The same product with vdpbf16ps on the same layouts: 8 rows x 32 columns of C in 16 accumulators; each 32-bit word
// of A (a pair of k) broadcast against a row of B's VNNI words.
MOECORE_AVX512_BF16 void gemm_dpbf16_packed(const int64_t M, const int64_t N, const int64_t K, const float alpha,
                                            const uint16_t* a, const int64_t lda, const uint32_t* b, const int64_t ldb,
                                            const float beta, float* C, const int64_t ldc) {
  constexpr int kRows = 8;
  const int64_t pairs = (K + 1) / 2;  // A is zero past K
  const __m512 scale = _mm512_set1_ps(alpha);
  for (int64_t m = 0; m < M; m += kRows) {  // A has 16 zero rows past its last: reading 8 rows is safe
    for (int64_t n = 0; n < N; n += 32) {
      // B's columns past N are read masked: a product starting at a column offset of its panel (b_n0) may end
      // fewer than 32 columns before the panel does.
      const __mmask16 k0 = lanes_below(N - n), k1 = lanes_below(N - n - 16);
      __m512 acc[kRows][2];
      for (auto& row : acc) row[0] = row[1] = _mm512_setzero_ps();
      for (int64_t kk = 0; kk < pairs; ++kk) {
        const __m512bh b0 = (__m512bh)_mm512_maskz_loadu_epi32(k0, b + kk * ldb + n);
        const __m512bh b1 = (__m512bh)_mm512_maskz_loadu_epi32(k1, b + kk * ldb + n + 16);
        for (int r = 0; r < kRows; ++r) {
          uint32_t word;
          std::memcpy(&word, a + (m + r) * lda + 2 * kk, sizeof(word));
          const __m512bh x = (__m512bh)_mm512_set1_epi32(static_cast<int>(word));
          acc[r][0] = _mm512_dpbf16_ps(acc[r][0], x, b0);
          acc[r][1] = _mm512_dpbf16_ps(acc[r][1], x, b1);
        }
      }
      for (int r = 0; r < kRows && m + r < M; ++r) {
        for (int h = 0; h < 2; ++h) {
          const int64_t col = n + 16 * h;
          const __mmask16 k = lanes_below(N - col);
          float* c = C + (m + r) * ldc + col;
          __m512 v = _mm512_mul_ps(scale, acc[r][h]);
          if (beta != 0.0f) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(k, c));
          _mm512_mask_storeu_ps(c, k, v);
        }
      }
    }
  }
}

// The AMX layouts of Bf16Panel: A = op(src) [M, K] into bits [rows_p, Kp]; B = op(src) [K, N] into words [Kp/2, Np].
MOECORE_AMX void pack_a_amx(std::vector<uint16_t>& bits, std::vector<uint32_t>& staging, const bool trans,
                            const int64_t M, const int64_t K, const float* src, const int64_t ld,
                            const int64_t zero_k_before, const int64_t rows_p, const int64_t Kp) {
  bits.resize(static_cast<size_t>(rows_p * Kp));
  if (!trans) return convert_rows(bits.data(), Kp, src, ld, M, K, rows_p, Kp, zero_k_before);
  // A = src^T, src [K, M]: VNNI pairs of src's rows are the words of A's columns; transposed through registers.
  const int64_t pairs = Kp / 2, Mp = rows_p - 16;
  staging.resize(static_cast<size_t>(pairs * Mp));
  interleave_rows(staging.data(), Mp, src, ld, K, M, pairs, Mp, zero_k_before);
  transpose_words(reinterpret_cast<uint32_t*>(bits.data()), pairs, staging.data(), Mp, pairs, Mp);
  std::fill(bits.begin() + Mp * Kp, bits.end(), uint16_t{0});
}

MOECORE_AMX void pack_b_amx(std::vector<uint32_t>& words, std::vector<uint32_t>& staging, const bool trans,
                            const int64_t K, const int64_t N, const float* src, const int64_t ld, const int64_t Kp,
                            const int64_t Np) {
  const int64_t pairs = Kp / 2;
  words.resize(static_cast<size_t>(pairs * Np));
  if (!trans) return interleave_rows(words.data(), Np, src, ld, K, N, pairs, Np);
  // B = src^T, src [N, K]: src's rows in bf16 are the words of B's columns.
  staging.resize(static_cast<size_t>(Np * pairs));
  convert_rows(reinterpret_cast<uint16_t*>(staging.data()), Kp, src, ld, N, K, Np, Kp);
  transpose_words(words.data(), Np, staging.data(), pairs, Np, pairs);
}
#else
bool amx_usable() { return false; }
bool avx512_bf16_usable() { return false; }
#endif

float rounded(const float x) { return bf16_to_fp32(fp32_to_bf16(x)); }

// ---- path choice --------------------------------------------------------------------------------------------------

constexpr int kNoOverride = -1;
std::atomic<int> g_path_override{kNoOverride};
std::atomic<int> g_unit_override{kNoOverride};

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
  switch (unit) {
    case Bf16ProductUnit::kAmx: return "AMX-BF16 tiles";
    case Bf16ProductUnit::kAvx512Bf16: return "AVX512-BF16 vdpbf16ps";
    case Bf16ProductUnit::kEmulated: break;
  }
  return "sgemm on bf16-rounded operands";
}

bool bf16_product_unit_usable(const Bf16ProductUnit unit) {
  switch (unit) {
    case Bf16ProductUnit::kAmx: return amx_usable();
    case Bf16ProductUnit::kAvx512Bf16: return avx512_bf16_usable();
    case Bf16ProductUnit::kEmulated: break;
  }
  return true;
}

Bf16ProductUnit best_bf16_product_unit() {
  const int forced = g_unit_override.load();
  if (forced != kNoOverride) return static_cast<Bf16ProductUnit>(forced);
  if (amx_usable()) return Bf16ProductUnit::kAmx;
  return avx512_bf16_usable() && avx512_bf16_outpaces_fp32() ? Bf16ProductUnit::kAvx512Bf16
                                                             : Bf16ProductUnit::kEmulated;
}

ScopedBf16ProductUnit::ScopedBf16ProductUnit(const Bf16ProductUnit unit) : previous_(kNoOverride) {
  if (!bf16_product_unit_usable(unit)) {
    throw std::invalid_argument("ScopedBf16ProductUnit: " + std::string(bf16_product_unit_name(unit)) +
                                " cannot run on this CPU");
  }
  previous_ = g_unit_override.exchange(static_cast<int>(unit));
}
ScopedBf16ProductUnit::~ScopedBf16ProductUnit() { g_unit_override.store(previous_); }

namespace {
void require_usable(const Bf16ProductUnit unit) {
  if (!bf16_product_unit_usable(unit)) {
    throw std::runtime_error("Bf16Panel: " + std::string(bf16_product_unit_name(unit)) +
                             " cannot run on this CPU / kernel / build");
  }
}
}  // namespace

void Bf16Panel::pack_a(const Bf16ProductUnit unit, const bool trans, const int64_t M, const int64_t K, const float* src,
                       const int64_t ld, const int64_t zero_k_before) {
  unit_ = unit;
  is_a_ = true;
  rows_ = M;
  cols_ = K;
#if defined(MOECORE_AMX_BUILT)
  if (unit != Bf16ProductUnit::kEmulated) {
    require_usable(unit);
    ld_ = round_up(K, 32);
    return pack_a_amx(bits_, staging_, trans, M, K, src, ld, zero_k_before, round_up(M, 16) + 16, ld_);
  }
#else
  if (unit != Bf16ProductUnit::kEmulated) require_usable(unit);
#endif
  ld_ = K;
  values_.resize(static_cast<size_t>(M * K));
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t k = 0; k < K; ++k) {
      values_[static_cast<size_t>(m * K + k)] =
          k < zero_k_before ? 0.0f : rounded(trans ? src[k * ld + m] : src[m * ld + k]);
    }
  }
}

uint16_t* Bf16Panel::a_for_writing(const Bf16ProductUnit unit, const int64_t M, const int64_t K) {
  if (unit == Bf16ProductUnit::kEmulated) throw std::invalid_argument("Bf16Panel::a_for_writing: no bf16 layout");
  require_usable(unit);
  unit_ = unit;
  is_a_ = true;
  rows_ = M;
  cols_ = K;
  ld_ = round_up(K, 32);
  const int64_t rows_p = round_up(M, 16) + 16;
  bits_.resize(static_cast<size_t>(rows_p * ld_));
  if (K < ld_) {
    for (int64_t m = 0; m < M; ++m) std::fill_n(bits_.data() + m * ld_ + K, ld_ - K, uint16_t{0});
  }
  std::fill(bits_.begin() + M * ld_, bits_.end(), uint16_t{0});
  return bits_.data();
}

void Bf16Panel::pack_b(const Bf16ProductUnit unit, const bool trans, const int64_t K, const int64_t N, const float* src,
                       const int64_t ld) {
  unit_ = unit;
  is_a_ = false;
  rows_ = K;
  cols_ = N;
#if defined(MOECORE_AMX_BUILT)
  if (unit != Bf16ProductUnit::kEmulated) {
    require_usable(unit);
    ld_ = round_up(N, 16) + 16;
    return pack_b_amx(words_, staging_, trans, K, N, src, ld, round_up(K, 32), ld_);
  }
#else
  if (unit != Bf16ProductUnit::kEmulated) require_usable(unit);
#endif
  ld_ = N;
  values_.resize(static_cast<size_t>(K * N));
  for (int64_t k = 0; k < K; ++k) {
    for (int64_t n = 0; n < N; ++n)
      values_[static_cast<size_t>(k * N + n)] = rounded(trans ? src[n * ld + k] : src[k * ld + n]);
  }
}

void Bf16Panel::shape_b(const Bf16ProductUnit unit, const int64_t K, const int64_t N) {
  if (unit != Bf16ProductUnit::kEmulated) require_usable(unit);
  unit_ = unit;
  is_a_ = false;
  rows_ = K;
  cols_ = N;
  if (unit == Bf16ProductUnit::kEmulated) {
    ld_ = N;
    values_.resize(static_cast<size_t>(K * N));
    return;
  }
  ld_ = round_up(N, 16) + 16;
  words_.resize(static_cast<size_t>(round_up(K, 32) / 2 * ld_));
}

void Bf16Panel::pack_b_slice(const bool trans, const float* src, const int64_t ld, const int64_t r0, const int64_t r1) {
  const int64_t K = rows_, N = cols_, src_rows = trans ? N : K;
  if (r0 < 0 || r0 % 32 != 0 || r1 < r0 || r1 > src_rows) {
    throw std::invalid_argument("Bf16Panel::pack_b_slice: rows [" + std::to_string(r0) + ", " + std::to_string(r1) +
                                ") of " + std::to_string(src_rows) + " (r0 a multiple of 32)");
  }
  if (unit_ == Bf16ProductUnit::kEmulated) {
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t c = 0; c < (trans ? K : N); ++c) {
        const float x = rounded(src[r * ld + c]);
        values_[static_cast<size_t>(trans ? c * N + r : r * N + c)] = x;
      }
    }
    return;
  }
#if defined(MOECORE_AMX_BUILT)
  const int64_t Kp = round_up(K, 32), pairs = Kp / 2;
  if (trans) {  // B's columns [r0, end): src's rows in bf16, transposed into them
    const int64_t end = r1 < N ? r1 : ld_;
    thread_local std::vector<uint32_t> staging;
    staging.resize(static_cast<size_t>((end - r0) * pairs));
    convert_rows(reinterpret_cast<uint16_t*>(staging.data()), Kp, src + r0 * ld, ld, r1 - r0, K, end - r0, Kp);
    transpose_words(words_.data() + r0, ld_, staging.data(), pairs, end - r0, pairs);
  } else {  // B's pair rows [r0 / 2, end / 2)
    const int64_t end = r1 < K ? r1 : Kp;
    interleave_rows(words_.data() + r0 / 2 * ld_, ld_, src + r0 * ld, ld, r1 - r0, N, (end - r0) / 2, ld_);
  }
#endif
}

void gemm_bf16_packed(const int64_t M, const int64_t N, const int64_t K, const float alpha, const Bf16Panel& a,
                      const int64_t a_row0, const Bf16Panel& b, const int64_t b_k0, const int64_t b_n0,
                      const float beta, float* C, const int64_t ldc) {
  if (!a.is_a_ || b.is_a_ || a.unit_ != b.unit_ || M < 0 || N < 0 || K < 0 || a_row0 < 0 || a_row0 + M > a.rows_ ||
      K > a.cols_ || b_k0 < 0 || b_k0 % 32 != 0 || b_k0 + K > b.rows_ || b_n0 < 0 || b_n0 + N > b.cols_ ||
      (beta != 0.0f && beta != 1.0f)) {
    throw std::invalid_argument("gemm_bf16_packed: M=" + std::to_string(M) + " N=" + std::to_string(N) +
                                " K=" + std::to_string(K) + " a_row0=" + std::to_string(a_row0) +
                                " b_k0=" + std::to_string(b_k0) + " do not fit A [" + std::to_string(a.rows_) + ", " +
                                std::to_string(a.cols_) + "] and B [" + std::to_string(b.rows_) + ", " +
                                std::to_string(b.cols_) + "] (or beta is not 0 or 1, or the panels mismatch)");
  }
  if (M == 0 || N == 0) return;
#if defined(MOECORE_AMX_BUILT)
  if (a.unit_ == Bf16ProductUnit::kAvx512Bf16) {
    return gemm_dpbf16_packed(M, N, K, alpha, a.bits_.data() + a_row0 * a.ld_, a.ld_,
                              b.words_.data() + b_k0 / 2 * b.ld_ + b_n0, b.ld_, beta, C, ldc);
  }
  if (a.unit_ == Bf16ProductUnit::kAmx) {
    return gemm_amx_packed(M, N, K, alpha, a.bits_.data() + a_row0 * a.ld_, a.ld_,
                           b.words_.data() + b_k0 / 2 * b.ld_ + b_n0, b.ld_, beta, C, ldc);
  }
#endif
  if (K == 0) {
    for (int64_t m = 0; m < M; ++m) {
      for (int64_t n = 0; n < N; ++n) C[m * ldc + n] = beta == 0.0f ? 0.0f : C[m * ldc + n];
    }
    return;
  }
  sgemm(false, false, M, N, K, alpha, a.values_.data() + a_row0 * a.ld_, a.ld_, b.values_.data() + b_k0 * b.ld_ + b_n0,
        b.ld_, beta, C, ldc);
}

void gemm_bf16(const Bf16ProductUnit unit, const bool trans_a, const bool trans_b, const int64_t M, const int64_t N,
               const int64_t K, const float alpha, const float* A, const int64_t lda, const float* B, const int64_t ldb,
               const float beta, float* C, const int64_t ldc) {
  thread_local Bf16Panel a, b;
  a.pack_a(unit, trans_a, M, K, A, lda);
  b.pack_b(unit, trans_b, K, N, B, ldb);
  gemm_bf16_packed(M, N, K, alpha, a, 0, b, 0, 0, beta, C, ldc);
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
  return best_bf16_product_unit() == Bf16ProductUnit::kEmulated ? AttentionProductPath::kF32
                                                                : AttentionProductPath::kBF16;
}

ScopedAttentionProductPath::ScopedAttentionProductPath(const AttentionProductPath path)
    : previous_(g_path_override.exchange(static_cast<int>(path))) {}
ScopedAttentionProductPath::~ScopedAttentionProductPath() { g_path_override.store(previous_); }

}  // namespace moecore::kernels::cpu
