// Fast fp32 <-> bf16 / fp16 array conversions. The library targets baseline x86-64, so each vector path is a set
// of functions compiled for its instruction set (GCC's target attribute) and called only after
// __builtin_cpu_supports has confirmed it; the scalar functions of tensor/dtype.h handle the tails and the lanes
// where an instruction's special-value rule differs from theirs.
#include "moecore/kernels/cpu/convert.h"

// GCC 12's AVX-512 intrinsics start from _mm512_undefined_*(), which its flow analysis reports as
// maybe-uninitialized once inlined (GCC bug 105593, fixed in GCC 13).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <stdexcept>
#include <string>

#include "moecore/tensor/dtype.h"

namespace moecore::kernels::cpu {
namespace {

// ---- scalar -------------------------------------------------------------------------------------------------------

void encode_bf16_scalar(uint16_t* out, const float* in, const int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = moecore::fp32_to_bf16(in[i]);
}
void decode_bf16_scalar(float* out, const uint16_t* in, const int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = moecore::bf16_to_fp32(in[i]);
}
void encode_fp16_scalar(uint16_t* out, const float* in, const int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = moecore::fp32_to_fp16(in[i]);
}
void decode_fp16_scalar(float* out, const uint16_t* in, const int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = moecore::fp16_to_fp32(in[i]);
}

// ---- AVX2 + F16C --------------------------------------------------------------------------------------------------

#define MOECORE_AVX2 __attribute__((target("avx2,f16c")))

// fp32 bits -> bf16 bits in the low half of each 32-bit lane, as fp32_to_bf16: add 0x7fff plus the lowest kept bit,
// keep the upper half; NaN keeps its upper half with the quiet bit set.
MOECORE_AVX2 inline __m256i bf16_round_avx2(const __m256i bits) {
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded =
      _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
  const __m256i abs_bits = _mm256_and_si256(bits, _mm256_set1_epi32(0x7fffffff));
  const __m256i is_nan = _mm256_cmpgt_epi32(abs_bits, _mm256_set1_epi32(0x7f800000));
  const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(0x40));
  return _mm256_blendv_epi8(rounded, quiet, is_nan);
}

MOECORE_AVX2 void encode_bf16_avx2(uint16_t* out, const float* in, const int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256i lo = bf16_round_avx2(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + i)));
    const __m256i hi = bf16_round_avx2(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + i + 8)));
    // packus works within 128-bit lanes: [lo0 hi0 lo1 hi1] -> reorder the 64-bit quarters to [lo0 lo1 hi0 hi1].
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(lo, hi), 0xd8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), packed);
  }
  encode_bf16_scalar(out + i, in + i, n - i);
}

MOECORE_AVX2 void decode_bf16_avx2(float* out, const uint16_t* in, const int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), _mm256_slli_epi32(wide, 16));
  }
  decode_bf16_scalar(out + i, in + i, n - i);
}

MOECORE_AVX2 void encode_fp16_avx2(uint16_t* out, const float* in, const int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_loadu_ps(in + i);
    __m128i half = _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 is_nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
    if (_mm256_movemask_ps(is_nan) != 0) {  // vcvtps2ph keeps NaN payloads; dtype.h gives sign | 0x7e00
      alignas(16) uint16_t lanes[8];
      _mm_store_si128(reinterpret_cast<__m128i*>(lanes), half);
      for (int j = 0; j < 8; ++j) {
        if (std::isnan(in[i + j])) lanes[j] = moecore::fp32_to_fp16(in[i + j]);
      }
      half = _mm_load_si128(reinterpret_cast<const __m128i*>(lanes));
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), half);
  }
  encode_fp16_scalar(out + i, in + i, n - i);
}

MOECORE_AVX2 void decode_fp16_avx2(float* out, const uint16_t* in, const int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i));
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(half));
    // vcvtph2ps quiets signalling NaNs; dtype.h keeps the payload as it is.
    const __m128i exponent = _mm_and_si128(half, _mm_set1_epi16(0x7c00));
    if (_mm_movemask_epi8(_mm_cmpeq_epi16(exponent, _mm_set1_epi16(0x7c00))) != 0) {
      decode_fp16_scalar(out + i, in + i, 8);
    }
  }
  decode_fp16_scalar(out + i, in + i, n - i);
}

#undef MOECORE_AVX2

// ---- AVX-512 ------------------------------------------------------------------------------------------------------

#define MOECORE_AVX512 __attribute__((target("avx512f")))

MOECORE_AVX512 inline __m256i bf16_round_avx512(const __m512i bits) {
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded =
      _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  const __m512i abs_bits = _mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff));
  const __mmask16 is_nan = _mm512_cmpgt_epu32_mask(abs_bits, _mm512_set1_epi32(0x7f800000));
  const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x40));
  return _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(is_nan, rounded, quiet));
}

MOECORE_AVX512 void encode_bf16_avx512(uint16_t* out, const float* in, const int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256i packed = bf16_round_avx512(_mm512_loadu_si512(in + i));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), packed);
  }
  encode_bf16_scalar(out + i, in + i, n - i);
}

MOECORE_AVX512 void decode_bf16_avx512(float* out, const uint16_t* in, const int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + i)));
    _mm512_storeu_si512(out + i, _mm512_slli_epi32(wide, 16));
  }
  decode_bf16_scalar(out + i, in + i, n - i);
}

MOECORE_AVX512 void encode_fp16_avx512(uint16_t* out, const float* in, const int64_t n) {
  int64_t i = 0;
  const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff);
  for (; i + 16 <= n; i += 16) {
    const __m512 x = _mm512_loadu_ps(in + i);
    __m256i half = _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512i bits = _mm512_castps_si512(x);
    const __mmask16 is_nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(bits, abs_mask), _mm512_set1_epi32(0x7f800000));
    if (is_nan != 0) {  // vcvtps2ph keeps NaN payloads; dtype.h gives sign | 0x7e00
      const __m512i sign = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x8000));
      const __m256i nan = _mm512_cvtepi32_epi16(_mm512_or_si512(sign, _mm512_set1_epi32(0x7e00)));
      const __m512i wide = _mm512_mask_blend_epi32(is_nan, _mm512_cvtepu16_epi32(half), _mm512_cvtepu16_epi32(nan));
      half = _mm512_cvtepi32_epi16(wide);
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), half);
  }
  encode_fp16_scalar(out + i, in + i, n - i);
}

MOECORE_AVX512 void decode_fp16_avx512(float* out, const uint16_t* in, const int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + i));
    const __m512i wide = _mm512_cvtepu16_epi32(half);
    __m512 x = _mm512_cvtph_ps(half);
    // vcvtph2ps quiets signalling NaNs; dtype.h keeps the payload: sign << 16 | 0x7f800000 | mantissa << 13.
    const __mmask16 is_nan =
        _mm512_cmpgt_epu32_mask(_mm512_and_si512(wide, _mm512_set1_epi32(0x7fff)), _mm512_set1_epi32(0x7c00));
    if (is_nan != 0) {
      const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(wide, _mm512_set1_epi32(0x8000)), 16);
      const __m512i mantissa = _mm512_slli_epi32(_mm512_and_si512(wide, _mm512_set1_epi32(0x3ff)), 13);
      const __m512i nan = _mm512_or_si512(_mm512_or_si512(sign, mantissa), _mm512_set1_epi32(0x7f800000));
      x = _mm512_mask_blend_ps(is_nan, x, _mm512_castsi512_ps(nan));
    }
    _mm512_storeu_ps(out + i, x);
  }
  decode_fp16_scalar(out + i, in + i, n - i);
}

#undef MOECORE_AVX512

// ---- AVX-512 BF16 -------------------------------------------------------------------------------------------------

__attribute__((target("avx512f,avx512bf16"))) void encode_bf16_avx512bf16(uint16_t* out, const float* in,
                                                                          const int64_t n) {
  int64_t i = 0;
  const __m512i exponent_mask = _mm512_set1_epi32(0x7f800000), mantissa_mask = _mm512_set1_epi32(0x7fffff);
  for (; i + 32 <= n; i += 32) {
    const __m512 lo = _mm512_loadu_ps(in + i), hi = _mm512_loadu_ps(in + i + 16);
    // vcvtne2ps2bf16 rounds to nearest even and quiets NaNs as dtype.h does, but treats denormal inputs as zero.
    const __mmask16 denormal_lo = _mm512_testn_epi32_mask(_mm512_castps_si512(lo), exponent_mask) &
                                  _mm512_test_epi32_mask(_mm512_castps_si512(lo), mantissa_mask);
    const __mmask16 denormal_hi = _mm512_testn_epi32_mask(_mm512_castps_si512(hi), exponent_mask) &
                                  _mm512_test_epi32_mask(_mm512_castps_si512(hi), mantissa_mask);
    if ((denormal_lo | denormal_hi) == 0) {
      _mm512_storeu_si512(out + i, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo)));
    } else {
      encode_bf16_avx512(out + i, in + i, 32);
    }
  }
  encode_bf16_avx512(out + i, in + i, n - i);
}

// ---- dispatch -----------------------------------------------------------------------------------------------------

constexpr int64_t kParallelChunk = 1 << 15;  // elements per OpenMP work item; smaller arrays run on one thread

void require(const ConvertIsa isa) {
  if (!convert_isa_supported(isa)) {
    throw std::invalid_argument("convert: this CPU lacks the " + std::string(convert_isa_name(isa)) + " path");
  }
}

// Runs fn(out + b, in + b, length) over chunks of [0, n), in parallel when there are several.
template <typename Out, typename In, typename Fn>
void chunked(Out* out, const In* in, const int64_t n, Fn fn) {
  const int64_t chunks = (n + kParallelChunk - 1) / kParallelChunk;
#pragma omp parallel for schedule(static) if (chunks > 1)
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t begin = c * kParallelChunk;
    fn(out + begin, in + begin, std::min(kParallelChunk, n - begin));
  }
}

// fp32 nearest to `value` truncated towards zero, with the lowest bit set when inexact ("round to odd"): rounding
// that once more to a format at least two bits shorter gives the same result as rounding `value` directly.
float round_to_odd_fp32(const double value) {
  float rounded = static_cast<float>(value);
  if (std::isnan(value) || static_cast<double>(rounded) == value) return rounded;
  if (std::abs(static_cast<double>(rounded)) > std::abs(value)) rounded = std::nextafter(rounded, 0.0f);
  return std::bit_cast<float>(std::bit_cast<uint32_t>(rounded) | 1u);
}

}  // namespace

bool convert_isa_supported(const ConvertIsa isa) {
  // Asked once per row of a GEMM tile, so the CPU is queried once.
  static const std::array<bool, 4> supported = [] {
    __builtin_cpu_init();
    const bool avx512 = __builtin_cpu_supports("avx512f");
    return std::array<bool, 4>{true, __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c"), avx512,
                               avx512 && __builtin_cpu_supports("avx512bf16")};
  }();
  const auto index = static_cast<size_t>(isa);
  return index < supported.size() && supported[index];
}

ConvertIsa best_convert_isa() {
  static const ConvertIsa best = [] {
    for (const ConvertIsa isa : {ConvertIsa::kAvx512Bf16, ConvertIsa::kAvx512, ConvertIsa::kAvx2}) {
      if (convert_isa_supported(isa)) return isa;
    }
    return ConvertIsa::kScalar;
  }();
  return best;
}

std::string_view convert_isa_name(const ConvertIsa isa) {
  switch (isa) {
    case ConvertIsa::kScalar: return "scalar";
    case ConvertIsa::kAvx2: return "AVX2 + F16C";
    case ConvertIsa::kAvx512: return "AVX-512";
    case ConvertIsa::kAvx512Bf16: return "AVX-512 BF16";
  }
  return "unknown";
}

void encode_bf16(uint16_t* out, const float* in, const int64_t n, const ConvertIsa isa) {
  require(isa);
  switch (isa) {
    case ConvertIsa::kScalar: encode_bf16_scalar(out, in, n); return;
    case ConvertIsa::kAvx2: encode_bf16_avx2(out, in, n); return;
    case ConvertIsa::kAvx512: encode_bf16_avx512(out, in, n); return;
    case ConvertIsa::kAvx512Bf16: encode_bf16_avx512bf16(out, in, n); return;
  }
}

void decode_bf16(float* out, const uint16_t* in, const int64_t n, const ConvertIsa isa) {
  require(isa);
  switch (isa) {
    case ConvertIsa::kScalar: decode_bf16_scalar(out, in, n); return;
    case ConvertIsa::kAvx2: decode_bf16_avx2(out, in, n); return;
    case ConvertIsa::kAvx512:
    case ConvertIsa::kAvx512Bf16: decode_bf16_avx512(out, in, n); return;
  }
}

void encode_fp16(uint16_t* out, const float* in, const int64_t n, const ConvertIsa isa) {
  require(isa);
  switch (isa) {
    case ConvertIsa::kScalar: encode_fp16_scalar(out, in, n); return;
    case ConvertIsa::kAvx2: encode_fp16_avx2(out, in, n); return;
    case ConvertIsa::kAvx512:
    case ConvertIsa::kAvx512Bf16: encode_fp16_avx512(out, in, n); return;
  }
}

void decode_fp16(float* out, const uint16_t* in, const int64_t n, const ConvertIsa isa) {
  require(isa);
  switch (isa) {
    case ConvertIsa::kScalar: decode_fp16_scalar(out, in, n); return;
    case ConvertIsa::kAvx2: decode_fp16_avx2(out, in, n); return;
    case ConvertIsa::kAvx512:
    case ConvertIsa::kAvx512Bf16: decode_fp16_avx512(out, in, n); return;
  }
}

uint16_t round_to_bf16(const double value) { return moecore::fp32_to_bf16(round_to_odd_fp32(value)); }
uint16_t round_to_fp16(const double value) { return moecore::fp32_to_fp16(round_to_odd_fp32(value)); }

void encode_bf16(uint16_t* out, const float* in, const int64_t n) {
  const ConvertIsa isa = best_convert_isa();
  chunked(out, in, n, [isa](uint16_t* o, const float* i, const int64_t len) { encode_bf16(o, i, len, isa); });
}
void decode_bf16(float* out, const uint16_t* in, const int64_t n) {
  const ConvertIsa isa = best_convert_isa();
  chunked(out, in, n, [isa](float* o, const uint16_t* i, const int64_t len) { decode_bf16(o, i, len, isa); });
}
void encode_fp16(uint16_t* out, const float* in, const int64_t n) {
  const ConvertIsa isa = best_convert_isa();
  chunked(out, in, n, [isa](uint16_t* o, const float* i, const int64_t len) { encode_fp16(o, i, len, isa); });
}
void decode_fp16(float* out, const uint16_t* in, const int64_t n) {
  const ConvertIsa isa = best_convert_isa();
  chunked(out, in, n, [isa](float* o, const uint16_t* i, const int64_t len) { decode_fp16(o, i, len, isa); });
}

// fp64: rare (tests, references), so element by element, in parallel.
void encode_bf16(uint16_t* out, const double* in, const int64_t n) {
  chunked(out, in, n, [](uint16_t* o, const double* i, const int64_t len) {
    for (int64_t k = 0; k < len; ++k) o[k] = round_to_bf16(i[k]);
  });
}
void encode_fp16(uint16_t* out, const double* in, const int64_t n) {
  chunked(out, in, n, [](uint16_t* o, const double* i, const int64_t len) {
    for (int64_t k = 0; k < len; ++k) o[k] = round_to_fp16(i[k]);
  });
}
void decode_bf16(double* out, const uint16_t* in, const int64_t n) {
  chunked(out, in, n, [](double* o, const uint16_t* i, const int64_t len) {
    for (int64_t k = 0; k < len; ++k) o[k] = moecore::bf16_to_fp32(i[k]);
  });
}
void decode_fp16(double* out, const uint16_t* in, const int64_t n) {
  chunked(out, in, n, [](double* o, const uint16_t* i, const int64_t len) {
    for (int64_t k = 0; k < len; ++k) o[k] = moecore::fp16_to_fp32(i[k]);
  });
}

namespace {

// Rounds in chunks through the vector paths (bit for bit the scalar functions of dtype.h): narrow a chunk to
// 16-bit bits, widen it back.
template <void (*Encode)(uint16_t*, const float*, int64_t, ConvertIsa),
          void (*Decode)(float*, const uint16_t*, int64_t, ConvertIsa)>
void round_through(float* data, const int64_t n) {
  constexpr int64_t kChunk = 2048;
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  const ConvertIsa isa = best_convert_isa();
#pragma omp parallel for schedule(static) if (n > (1 << 16))
  for (int64_t c = 0; c < chunks; ++c) {
    uint16_t bits[kChunk];
    const int64_t begin = c * kChunk, len = std::min(kChunk, n - begin);
    Encode(bits, data + begin, len, isa);
    Decode(data + begin, bits, len, isa);
  }
}

}  // namespace

void round_bf16(float* data, const int64_t n) { round_through<encode_bf16, decode_bf16>(data, n); }
void round_fp16(float* data, const int64_t n) { round_through<encode_fp16, decode_fp16>(data, n); }

}  // namespace moecore::kernels::cpu
