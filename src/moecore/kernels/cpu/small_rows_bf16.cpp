#include "moecore/kernels/cpu/small_rows_bf16.h"

#include <cstring>
#include <stdexcept>
#include <vector>

#include "moecore/kernels/cpu/bf16_dot_rate.h"
#include "moecore/kernels/cpu/convert.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define MOECORE_SMALL_ROWS_BUILT 1
#include <immintrin.h>
#endif

namespace moecore::kernels::cpu {

#if defined(MOECORE_SMALL_ROWS_BUILT)
// GCC 12's AVX-512 intrinsics start from an undefined vector, which -Wmaybe-uninitialized reports once inlined.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
namespace {

#define MOECORE_AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

MOECORE_AVX512_BF16 inline __mmask32 halves_below(const int64_t n) {
  if (n <= 0) return 0;
  return n >= 32 ? static_cast<__mmask32>(0xffffffffu) : static_cast<__mmask32>((1u << n) - 1u);
}

MOECORE_AVX512_BF16 inline __mmask16 lanes_below(const int64_t n) {
  if (n <= 0) return 0;
  return n >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << n) - 1u);
}

// Prefetches rows [begin, end) of the bf16 weight into L1: the kernels walk a block of consecutive weight rows
// column stretch by column stretch, which the hardware prefetchers do not foresee.
MOECORE_AVX512_BF16 inline void prefetch_rows(const uint16_t* w_OI, const int64_t begin, const int64_t end,
                                              const int64_t I) {
  const char* first = reinterpret_cast<const char*>(w_OI + begin * I);
  const char* last = reinterpret_cast<const char*>(w_OI + end * I);
  for (const char* p = first; p < last; p += 64) _mm_prefetch(p, _MM_HINT_T0);
}

// Lane j of the result: the sum of v[j]'s 16 lanes (a fixed tree: pairs of vectors, then 64-bit halves, then the
// 128-bit blocks).
MOECORE_AVX512_BF16 inline __m512 sum_lanes16(const __m512 (&v)[16]) {
  __m512 pairs[8];  // pairs[p] per 128-bit block: lanes 0, 2 partial sums of v[2p], lanes 1, 3 of v[2p + 1]
  for (int p = 0; p < 8; ++p) {
    pairs[p] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * p], v[2 * p + 1]), _mm512_unpackhi_ps(v[2 * p], v[2 * p + 1]));
  }
  __m512 quads[4];  // quads[q] per 128-bit block b: the block-b sums of v[4q .. 4q + 3]
  for (int q = 0; q < 4; ++q) {
    const __m512d a = _mm512_castps_pd(pairs[2 * q]), b = _mm512_castps_pd(pairs[2 * q + 1]);
    quads[q] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  // Blocks 0 + 2 and 1 + 3 of quads 0 and 1 (then 2 and 3), then the two halves: block q holds v[4q .. 4q + 3].
  const __m512 ab =
      _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], 0x44), _mm512_shuffle_f32x4(quads[0], quads[1], 0xee));
  const __m512 cd =
      _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], 0x44), _mm512_shuffle_f32x4(quads[2], quads[3], 0xee));
  return _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xdd));
}

// Two rows of x against 8 weight rows at a time, so each weight load feeds two dot products: the 16 sums (8 per row)
// reduced by one sum_lanes16, whose tree gives every output the same additions whatever the row next to it, so each
// row's outputs are those of the row alone.
MOECORE_AVX512_BF16 void forward_avx512_bf16(float* out_nO, const uint16_t* x_nI, const uint16_t* w_OI, const int64_t n,
                                             const int64_t I, const int64_t O) {
  constexpr int64_t kBlock = 8;
  prefetch_rows(w_OI, 0, O < kBlock ? O : kBlock, I);
  for (int64_t o0 = 0; o0 < O; o0 += kBlock) {
    const int64_t rows = O - o0 < kBlock ? O - o0 : kBlock;
    prefetch_rows(w_OI, o0 + rows, O - o0 - rows < kBlock ? O : o0 + rows + kBlock, I);
    const auto out_mask = static_cast<__mmask8>((1u << rows) - 1u);
    for (int64_t r = 0; r < n; r += 2) {
      const bool pair = r + 1 < n;
      __m512 acc[16];  // [0, 8): row r, [8, 16): row r + 1
      for (__m512& a : acc) a = _mm512_setzero_ps();
      for (int64_t i = 0; i < I; i += 32) {
        const __mmask32 k = halves_below(I - i);
        const __m512bh x0 = (__m512bh)_mm512_maskz_loadu_epi16(k, x_nI + r * I + i);
        const __m512bh x1 = (__m512bh)_mm512_maskz_loadu_epi16(pair ? k : 0, x_nI + (pair ? r + 1 : r) * I + i);
        for (int j = 0; j < kBlock; ++j) {  // a constant count keeps acc in registers; rows past O read as zero
          const uint16_t* w_row = w_OI + (o0 + (j < rows ? j : 0)) * I + i;
          const __m512bh w = (__m512bh)_mm512_maskz_loadu_epi16(j < rows ? k : 0, w_row);
          acc[j] = _mm512_dpbf16_ps(acc[j], x0, w);
          acc[kBlock + j] = _mm512_dpbf16_ps(acc[kBlock + j], x1, w);
        }
      }
      const __m512 sums = sum_lanes16(acc);
      _mm256_mask_storeu_ps(out_nO + r * O + o0, out_mask, _mm512_castps512_ps256(sums));
      if (pair) _mm256_mask_storeu_ps(out_nO + (r + 1) * O + o0, out_mask, _mm512_extractf32x8_ps(sums, 1));
    }
  }
}

// The dx columns of the 32-column stretch i .. i + 31 that lane l of the unpacked pair vectors holds: unpacklo /
// unpackhi of two weight rows interleave words 0-3 / 4-7 of each 128-bit block, so lane l of the low vector is column
// 8 (l / 4) + l % 4 and lane l of the high one column 8 (l / 4) + 4 + l % 4.
MOECORE_AVX512_BF16 inline __m512i unpacked_columns(const int half) {
  alignas(64) int32_t idx[16];
  for (int l = 0; l < 16; ++l) idx[l] = 8 * (l / 4) + 4 * half + l % 4;
  return _mm512_load_si512(idx);
}

// The inverse: for columns c0 .. c0 + 15 of the stretch, the lane of (low, high) = (0-15, 16-31) that holds each.
MOECORE_AVX512_BF16 inline __m512i packed_columns(const int c0) {
  alignas(64) int32_t idx[16];
  for (int j = 0; j < 16; ++j) {
    const int c = c0 + j;
    idx[j] = (c % 8 < 4 ? 0 : 16) + 4 * (c / 8) + c % 4;
  }
  return _mm512_load_si512(idx);
}

// kRows rows of dx by 32 columns in registers (constant counts, so they stay there), over blocks of kBlockRows
// weight rows taken two at a time: the two rows' bf16 values interleaved into pairs (unpacklo / unpackhi, so the
// accumulators hold the columns in that order, restored at the store), each pair multiplied by dy's pair
// (dy[r, o], dy[r, o + 1]) with vdpbf16ps, which adds the o + 1 product first, then the o product. Each block's rows
// are prefetched during the block before and then read from L1.
template <int kRows>
MOECORE_AVX512_BF16 void data_rows_avx512_bf16(float* dx_nI, const uint16_t* dy_bits, const int64_t width,
                                               const uint16_t* w_OI, const int64_t I, const int64_t O) {
  constexpr int64_t kBlockRows = 16, kCols = 32;
  const __m512i to_low = unpacked_columns(0), to_high = unpacked_columns(1);
  const __m512i from_first = packed_columns(0), from_second = packed_columns(16);
  prefetch_rows(w_OI, 0, O < kBlockRows ? O : kBlockRows, I);
  for (int64_t o0 = 0; o0 < O; o0 += kBlockRows) {
    const int64_t o1 = O - o0 < kBlockRows ? O : o0 + kBlockRows;
    prefetch_rows(w_OI, o1, O - o1 < kBlockRows ? O : o1 + kBlockRows, I);
    for (int64_t i = 0; i < I; i += kCols) {
      const __mmask32 k = halves_below(I - i);
      const __mmask16 k_first = lanes_below(I - i), k_second = lanes_below(I - i - 16);
      __m512 acc[kRows][2];
      for (int r = 0; r < kRows; ++r) {
        const __m512 first = _mm512_maskz_loadu_ps(k_first, dx_nI + r * I + i);
        const __m512 second = _mm512_maskz_loadu_ps(k_second, dx_nI + r * I + i + 16);
        acc[r][0] = _mm512_permutex2var_ps(first, to_low, second);
        acc[r][1] = _mm512_permutex2var_ps(first, to_high, second);
      }
      for (int64_t o = o0; o < o1; o += 2) {
        const __m512i row0 = _mm512_maskz_loadu_epi16(k, w_OI + o * I + i);
        const __m512i row1 = _mm512_maskz_loadu_epi16(o + 1 < o1 ? k : 0, w_OI + (o + 1 < o1 ? o + 1 : o) * I + i);
        const __m512bh low = (__m512bh)_mm512_unpacklo_epi16(row0, row1);
        const __m512bh high = (__m512bh)_mm512_unpackhi_epi16(row0, row1);
        for (int r = 0; r < kRows; ++r) {
          int32_t pair = 0;  // dy[r, o] in the low half, dy[r, o + 1] in the high one
          std::memcpy(&pair, dy_bits + r * width + o, sizeof(pair));
          const __m512bh d = (__m512bh)_mm512_set1_epi32(pair);
          acc[r][0] = _mm512_dpbf16_ps(acc[r][0], d, low);
          acc[r][1] = _mm512_dpbf16_ps(acc[r][1], d, high);
        }
      }
      for (int r = 0; r < kRows; ++r) {
        _mm512_mask_storeu_ps(dx_nI + r * I + i, k_first, _mm512_permutex2var_ps(acc[r][0], from_first, acc[r][1]));
        _mm512_mask_storeu_ps(dx_nI + r * I + i + 16, k_second,
                              _mm512_permutex2var_ps(acc[r][0], from_second, acc[r][1]));
      }
    }
  }
}

// dy rounded to bf16 (as dtype.h) in pairs (dy[r, o], dy[r, o + 1]), a zero after an odd O; blocks of 8 rows (32
// columns at a time): more rows per block would need more broadcast loads per product than the load ports give.
MOECORE_AVX512_BF16 void data_avx512_bf16(float* dx_nI, const float* dy_nO, const uint16_t* w_OI, const int64_t n,
                                          const int64_t I, const int64_t O) {
  using Block = void (*)(float*, const uint16_t*, int64_t, const uint16_t*, int64_t, int64_t);
  static constexpr Block kBlocks[] = {nullptr,
                                      data_rows_avx512_bf16<1>,
                                      data_rows_avx512_bf16<2>,
                                      data_rows_avx512_bf16<3>,
                                      data_rows_avx512_bf16<4>,
                                      data_rows_avx512_bf16<5>,
                                      data_rows_avx512_bf16<6>,
                                      data_rows_avx512_bf16<7>,
                                      data_rows_avx512_bf16<8>};
  const int64_t width = O + O % 2;
  thread_local std::vector<uint16_t> dy_bits;
  if (dy_bits.size() < static_cast<size_t>(n * width)) dy_bits.resize(static_cast<size_t>(n * width));
  const ConvertIsa isa = best_convert_isa();
  for (int64_t r = 0; r < n; ++r) {
    encode_bf16(dy_bits.data() + r * width, dy_nO + r * O, O, isa);
    if (width != O) dy_bits[static_cast<size_t>(r * width + O)] = 0;
  }
  for (int64_t r0 = 0; r0 < n; r0 += 8) {
    const int64_t rows = n - r0 < 8 ? n - r0 : 8;
    kBlocks[rows](dx_nI + r0 * I, dy_bits.data() + r0 * width, width, w_OI, I, O);
  }
}

// kRows rows of dx by 32 columns in registers (constant counts, so they stay there), over blocks of kBlockRows
// weight rows: each block's rows are prefetched during the block before and then read from L1, each weight row's
// values widened (bf16 bits << 16) once per row block.
template <int kRows>
MOECORE_AVX512_BF16 void widened_rows_avx512(float* dx_nI, const float* dy_nO, const uint16_t* w_OI, const int64_t I,
                                             const int64_t O) {
  constexpr int kVecs = 2;
  constexpr int64_t kBlockRows = 16, kCols = 16 * kVecs;
  prefetch_rows(w_OI, 0, O < kBlockRows ? O : kBlockRows, I);
  for (int64_t o0 = 0; o0 < O; o0 += kBlockRows) {
    const int64_t o1 = O - o0 < kBlockRows ? O : o0 + kBlockRows;
    prefetch_rows(w_OI, o1, O - o1 < kBlockRows ? O : o1 + kBlockRows, I);
    for (int64_t i = 0; i < I; i += kCols) {
      __mmask16 k[kVecs];
      for (int v = 0; v < kVecs; ++v) k[v] = lanes_below(I - i - 16 * v);
      __m512 acc[kRows][kVecs];
      for (int r = 0; r < kRows; ++r) {
        for (int v = 0; v < kVecs; ++v) acc[r][v] = _mm512_maskz_loadu_ps(k[v], dx_nI + r * I + i + 16 * v);
      }
      for (int64_t o = o0; o < o1; ++o) {
        __m512 w[kVecs];
        for (int v = 0; v < kVecs; ++v) {
          const __m256i bits = _mm256_maskz_loadu_epi16(k[v], w_OI + o * I + i + 16 * v);
          w[v] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
        }
        for (int r = 0; r < kRows; ++r) {
          const __m512 d = _mm512_set1_ps(dy_nO[r * O + o]);
          for (int v = 0; v < kVecs; ++v) acc[r][v] = _mm512_fmadd_ps(d, w[v], acc[r][v]);
        }
      }
      for (int r = 0; r < kRows; ++r) {
        for (int v = 0; v < kVecs; ++v) _mm512_mask_storeu_ps(dx_nI + r * I + i + 16 * v, k[v], acc[r][v]);
      }
    }
  }
}

// Blocks of 8 rows (32 columns at a time): more rows per block would need more broadcast loads per multiply-add than
// the load ports give.
MOECORE_AVX512_BF16 void widened_avx512(float* dx_nI, const float* dy_nO, const uint16_t* w_OI, const int64_t n,
                                        const int64_t I, const int64_t O) {
  using Block = void (*)(float*, const float*, const uint16_t*, int64_t, int64_t);
  static constexpr Block kBlocks[] = {nullptr,
                                      widened_rows_avx512<1>,
                                      widened_rows_avx512<2>,
                                      widened_rows_avx512<3>,
                                      widened_rows_avx512<4>,
                                      widened_rows_avx512<5>,
                                      widened_rows_avx512<6>,
                                      widened_rows_avx512<7>,
                                      widened_rows_avx512<8>};
  for (int64_t r0 = 0; r0 < n; r0 += 8) {
    const int64_t rows = n - r0 < 8 ? n - r0 : 8;
    kBlocks[rows](dx_nI + r0 * I, dy_nO + r0 * O, w_OI, I, O);
  }
}

}  // namespace
#pragma GCC diagnostic pop

bool small_rows_bf16_usable() {
  static const bool usable = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  }();
  return usable;
}

void small_rows_forward_bf16(float* out_nO, const uint16_t* x_nI, const uint16_t* w_OI, const int64_t n,
                             const int64_t I, const int64_t O) {
  if (!small_rows_bf16_usable()) throw std::logic_error("small_rows_forward_bf16: this CPU has no AVX512-BF16");
  forward_avx512_bf16(out_nO, x_nI, w_OI, n, I, O);
}

void small_rows_data_bf16(float* dx_nI, const float* dy_nO, const uint16_t* w_OI, const int64_t n, const int64_t I,
                          const int64_t O) {
  if (!small_rows_bf16_usable()) throw std::logic_error("small_rows_data_bf16: this CPU has no AVX512-BF16");
  data_avx512_bf16(dx_nI, dy_nO, w_OI, n, I, O);
}

void small_rows_data_widened(float* dx_nI, const float* dy_nO, const uint16_t* w_OI, const int64_t n, const int64_t I,
                             const int64_t O) {
  if (!small_rows_bf16_usable()) throw std::logic_error("small_rows_data_widened: this CPU has no AVX512-BF16");
  widened_avx512(dx_nI, dy_nO, w_OI, n, I, O);
}

bool small_rows_data_pairs() {
  static const bool pairs = small_rows_bf16_usable() && avx512_bf16_outpaces_fp32();
  return pairs;
}
#else
bool small_rows_bf16_usable() { return false; }
void small_rows_forward_bf16(float*, const uint16_t*, const uint16_t*, int64_t, int64_t, int64_t) {
  throw std::logic_error("small_rows_forward_bf16: not built for this target");
}
void small_rows_data_bf16(float*, const float*, const uint16_t*, int64_t, int64_t, int64_t) {
  throw std::logic_error("small_rows_data_bf16: not built for this target");
}
void small_rows_data_widened(float*, const float*, const uint16_t*, int64_t, int64_t, int64_t) {
  throw std::logic_error("small_rows_data_widened: not built for this target");
}
bool small_rows_data_pairs() { return false; }
#endif

}  // namespace moecore::kernels::cpu
