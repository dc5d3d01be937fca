// Array conversions (kernels/cpu/convert.h) against the scalar functions of tensor/dtype.h, bit for bit: every vector
// path this CPU has, on every bf16 / fp16 pattern (decoding), on fp32 boundary cases and random bits (encoding), and
// at lengths that leave every possible tail. fp64 rounding against the reference's nearest-neighbour search.
#include <gtest/gtest.h>
#include <omp.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "moecore/kernels/cpu/convert.h"
#include "moecore/tensor/dtype.h"

namespace moecore::kernels {
namespace {

using cpu::ConvertIsa;

std::vector<ConvertIsa> supported_isas() {
  std::vector<ConvertIsa> out;
  for (const ConvertIsa isa : {ConvertIsa::kScalar, ConvertIsa::kAvx2, ConvertIsa::kAvx512, ConvertIsa::kAvx512Bf16}) {
    if (cpu::convert_isa_supported(isa)) out.push_back(isa);
  }
  return out;
}

// fp32 bit patterns that stress encoding: zeros, denormals (smallest, largest, fp16 / bf16 rounding boundaries),
// normals around every rounding tie, the overflow thresholds, infinities, quiet and signalling NaNs with payloads,
// each with both signs; then random bits.
std::vector<float> encoding_inputs() {
  std::vector<uint32_t> bits = {
      0x00000000, 0x00000001, 0x00000002, 0x00007fff, 0x00008000, 0x00008001, 0x00018000, 0x0001ffff, 0x007fffff,
      0x00400000, 0x00800000, 0x00800001, 0x3f800000, 0x3f808000, 0x3f818000, 0x3f807fff, 0x3f808001, 0x3f801000,
      0x3f803000, 0x3f800fff, 0x3f801001, 0x7f7fffff, 0x7f7f7fff, 0x7f7f8000, 0x7f7f8001, 0x477fe000, 0x477fefff,
      0x477ff000, 0x477ff001, 0x47800000, 0x33000000, 0x33000001, 0x32ffffff, 0x33800000, 0x33c00000, 0x387fe000,
      0x387ff000, 0x38800000, 0x38000000, 0x7f800000, 0x7f800001, 0x7f800040, 0x7fc00000, 0x7fffffff, 0x7fbfffff,
      0x7f80ffff, 0x7f810000, 0x7fa00000, 0x3f7fffff, 0x33800001, 0x38801000, 0x38803000, 0x387fffff};
  const size_t listed = bits.size();
  for (size_t i = 0; i < listed; ++i) bits.push_back(bits[i] | 0x80000000u);
  // Every fp32 whose low 16 bits are a tie, just below or just above, over a spread of exponents.
  for (uint32_t e = 0; e < 256; e += 5) {
    for (const uint32_t low : {0x7fffu, 0x8000u, 0x8001u, 0x0fffu, 0x1000u, 0x1001u, 0x3000u}) {
      bits.push_back((e << 23) | 0x00340000u | low);
      bits.push_back((e << 23) | 0x00010000u | low);
    }
  }
  std::mt19937 gen(7);
  for (int i = 0; i < 200000; ++i) bits.push_back(gen());
  std::vector<float> out;
  for (const uint32_t b : bits) out.push_back(std::bit_cast<float>(b));
  return out;
}

std::vector<uint16_t> all_patterns() {
  std::vector<uint16_t> out(65536);
  for (uint32_t i = 0; i < 65536; ++i) out[i] = static_cast<uint16_t>(i);
  return out;
}

uint32_t bits_of(const float x) { return std::bit_cast<uint32_t>(x); }

// Every length 0..70 from every start 0..3 (vector bodies, masked and scalar tails), then the whole array.
template <typename T>
auto raw_bits(const T x) {
  if constexpr (sizeof(T) == 2) {
    return std::bit_cast<uint16_t>(x);
  } else {
    return std::bit_cast<uint32_t>(x);
  }
}

template <typename Out, typename In, typename Run, typename Want>
void expect_bitwise(const std::vector<In>& in, Run run, Want want, const std::string& what) {
  std::vector<Out> out(in.size());
  for (size_t start = 0; start < 4; ++start) {
    for (size_t n = 0; n <= 70 && start + n <= in.size(); ++n) {
      std::fill(out.begin(), out.end(), Out{});
      run(out.data() + start, in.data() + start, static_cast<int64_t>(n));
      for (size_t i = start; i < start + n; ++i) {
        ASSERT_EQ(raw_bits(out[i]), want(in[i])) << what << " element " << i << " of a run of " << n;
      }
    }
  }
  run(out.data(), in.data(), static_cast<int64_t>(in.size()));
  int64_t wrong = 0;
  size_t first = 0;
  for (size_t i = 0; i < in.size(); ++i) {
    if (raw_bits(out[i]) != want(in[i])) {
      if (wrong++ == 0) first = i;
    }
  }
  EXPECT_EQ(wrong, 0) << what << ": first wrong element " << first;
}

TEST(KernelsConvert, EveryPathEncodesAsTheScalarFunctions) {
  const std::vector<float> in = encoding_inputs();
  for (const ConvertIsa isa : supported_isas()) {
    const std::string name(cpu::convert_isa_name(isa));
    expect_bitwise<uint16_t>(
        in, [isa](uint16_t* o, const float* i, int64_t n) { cpu::encode_bf16(o, i, n, isa); },
        [](const float x) { return fp32_to_bf16(x); }, name + " fp32 -> bf16");
    expect_bitwise<uint16_t>(
        in, [isa](uint16_t* o, const float* i, int64_t n) { cpu::encode_fp16(o, i, n, isa); },
        [](const float x) { return fp32_to_fp16(x); }, name + " fp32 -> fp16");
  }
}

TEST(KernelsConvert, EveryPathDecodesEveryPatternAsTheScalarFunctions) {
  const std::vector<uint16_t> in = all_patterns();
  for (const ConvertIsa isa : supported_isas()) {
    const std::string name(cpu::convert_isa_name(isa));
    expect_bitwise<float>(
        in, [isa](float* o, const uint16_t* i, int64_t n) { cpu::decode_bf16(o, i, n, isa); },
        [](const uint16_t h) { return bits_of(bf16_to_fp32(h)); }, name + " bf16 -> fp32");
    expect_bitwise<float>(
        in, [isa](float* o, const uint16_t* i, int64_t n) { cpu::decode_fp16(o, i, n, isa); },
        [](const uint16_t h) { return bits_of(fp16_to_fp32(h)); }, name + " fp16 -> fp32");
  }
}

TEST(KernelsConvert, EncodingEveryDecodedPatternRoundTrips) {
  // Each bf16 / fp16 value is exactly representable, so encoding it gives its pattern back (NaNs: a quiet NaN of
  // the same sign, as the scalar functions).
  const std::vector<uint16_t> patterns = all_patterns();
  for (const ConvertIsa isa : supported_isas()) {
    const std::string name(cpu::convert_isa_name(isa));
    std::vector<float> decoded(patterns.size());
    std::vector<uint16_t> again(patterns.size());
    cpu::decode_bf16(decoded.data(), patterns.data(), 65536, isa);
    cpu::encode_bf16(again.data(), decoded.data(), 65536, isa);
    for (uint32_t h = 0; h < 65536; ++h) {
      const bool nan = (h & 0x7f80u) == 0x7f80u && (h & 0x7fu) != 0;
      ASSERT_EQ(again[h], nan ? (h | 0x40u) : h) << name << " bf16 pattern " << h;
    }
    cpu::decode_fp16(decoded.data(), patterns.data(), 65536, isa);
    cpu::encode_fp16(again.data(), decoded.data(), 65536, isa);
    for (uint32_t h = 0; h < 65536; ++h) {
      const bool nan = (h & 0x7c00u) == 0x7c00u && (h & 0x3ffu) != 0;
      ASSERT_EQ(again[h], nan ? ((h & 0x8000u) | 0x7e00u) : h) << name << " fp16 pattern " << h;
    }
  }
}

TEST(KernelsConvert, ParallelArraysMatchTheScalarFunctions) {
  // Long enough for several OpenMP chunks, with a ragged end.
  std::vector<float> in(300001);
  std::mt19937 gen(3);
  for (float& x : in) x = std::bit_cast<float>(static_cast<uint32_t>(gen()));
  std::vector<uint16_t> bf(in.size()), hf(in.size());
  std::vector<float> back(in.size());
  for (const int threads : {1, 2}) {
    omp_set_num_threads(threads);
    cpu::encode_bf16(bf.data(), in.data(), static_cast<int64_t>(in.size()));
    cpu::encode_fp16(hf.data(), in.data(), static_cast<int64_t>(in.size()));
    for (size_t i = 0; i < in.size(); ++i) {
      ASSERT_EQ(bf[i], fp32_to_bf16(in[i])) << i;
      ASSERT_EQ(hf[i], fp32_to_fp16(in[i])) << i;
    }
    cpu::decode_bf16(back.data(), bf.data(), static_cast<int64_t>(bf.size()));
    for (size_t i = 0; i < in.size(); ++i) ASSERT_EQ(bits_of(back[i]), bits_of(bf16_to_fp32(bf[i]))) << i;
    cpu::decode_fp16(back.data(), hf.data(), static_cast<int64_t>(hf.size()));
    for (size_t i = 0; i < in.size(); ++i) ASSERT_EQ(bits_of(back[i]), bits_of(fp16_to_fp32(hf[i]))) << i;
  }
}

TEST(KernelsConvert, ReferenceArraysAreTheScalarFunctions) {
  const std::vector<float> in = encoding_inputs();
  std::vector<uint16_t> out(in.size());
  ref::encode_bf16(out.data(), in.data(), static_cast<int64_t>(in.size()));
  for (size_t i = 0; i < in.size(); ++i) ASSERT_EQ(out[i], fp32_to_bf16(in[i])) << i;
  ref::encode_fp16(out.data(), in.data(), static_cast<int64_t>(in.size()));
  for (size_t i = 0; i < in.size(); ++i) ASSERT_EQ(out[i], fp32_to_fp16(in[i])) << i;
  const std::vector<uint16_t> patterns = all_patterns();
  std::vector<float> decoded(patterns.size());
  ref::decode_bf16(decoded.data(), patterns.data(), 65536);
  for (uint32_t h = 0; h < 65536; ++h) ASSERT_EQ(bits_of(decoded[h]), bits_of(bf16_to_fp32(static_cast<uint16_t>(h))));
  ref::decode_fp16(decoded.data(), patterns.data(), 65536);
  for (uint32_t h = 0; h < 65536; ++h) ASSERT_EQ(bits_of(decoded[h]), bits_of(fp16_to_fp32(static_cast<uint16_t>(h))));
}

// Doubles are rounded once: the fast version (round to odd in fp32, then the fp32 rounding) against the reference's
// search for the nearest pattern, on values exactly representable in fp32 (where both must equal the fp32 rounding),
// on midpoints between neighbouring patterns nudged by less than an fp32 ulp (where rounding through fp32 with
// round-to-nearest would round twice and go wrong), and on random doubles over the whole range.
TEST(KernelsConvert, DoublesAreRoundedOnce) {
  std::vector<double> in = {0.0,
                            -0.0,
                            1.0,
                            -1.0,
                            65504.0,
                            65519.99,
                            65520.0,
                            1e300,
                            -1e300,
                            1e-300,
                            -1e-300,
                            std::numeric_limits<double>::infinity(),
                            -std::numeric_limits<double>::infinity(),
                            std::numeric_limits<double>::denorm_min(),
                            3.3895313892515355e38,
                            3.4e38};
  for (const float x : encoding_inputs()) {
    if (std::isfinite(x)) in.push_back(x);
  }
  const std::vector<uint16_t> patterns = all_patterns();
  for (const bool bf16 : {true, false}) {
    const uint32_t largest_finite = bf16 ? 0x7f7fu : 0x7bffu;
    for (uint32_t h = 0; h < largest_finite; h += 7) {
      const double a = bf16 ? bf16_to_fp32(static_cast<uint16_t>(h)) : fp16_to_fp32(static_cast<uint16_t>(h));
      const double b = bf16 ? bf16_to_fp32(static_cast<uint16_t>(h + 1)) : fp16_to_fp32(static_cast<uint16_t>(h + 1));
      const double mid = (a + b) / 2;
      for (const double nudge : {0.0, 1e-3, -1e-3}) in.push_back(mid + nudge * std::ldexp(b - a, -24));
    }
  }
  std::mt19937_64 gen(11);
  for (int i = 0; i < 100000; ++i) {
    const double x = std::bit_cast<double>(gen());
    if (!std::isnan(x)) in.push_back(x);
  }
  in.push_back(std::numeric_limits<double>::quiet_NaN());
  std::vector<uint16_t> fast(in.size()), want(in.size());
  cpu::encode_bf16(fast.data(), in.data(), static_cast<int64_t>(in.size()));
  ref::encode_bf16(want.data(), in.data(), static_cast<int64_t>(in.size()));
  for (size_t i = 0; i < in.size(); ++i) ASSERT_EQ(fast[i], want[i]) << "bf16 of " << in[i];
  cpu::encode_fp16(fast.data(), in.data(), static_cast<int64_t>(in.size()));
  ref::encode_fp16(want.data(), in.data(), static_cast<int64_t>(in.size()));
  for (size_t i = 0; i < in.size(); ++i) ASSERT_EQ(fast[i], want[i]) << "fp16 of " << in[i];
  // On values exact in fp32, both equal the fp32 rounding of dtype.h.
  for (const float x : encoding_inputs()) {
    if (std::isnan(x)) continue;
    ASSERT_EQ(ref::round_to_bf16(x), fp32_to_bf16(x)) << x;
    ASSERT_EQ(ref::round_to_fp16(x), fp32_to_fp16(x)) << x;
  }
  std::vector<double> wide(65536);
  cpu::decode_bf16(wide.data(), patterns.data(), 65536);
  for (uint32_t h = 0; h < 65536; ++h) {
    const float want_value = bf16_to_fp32(static_cast<uint16_t>(h));
    if (!std::isnan(want_value)) {
      ASSERT_EQ(wide[h], static_cast<double>(want_value)) << h;
    }
  }
  cpu::decode_fp16(wide.data(), patterns.data(), 65536);
  for (uint32_t h = 0; h < 65536; ++h) {
    const float want_value = fp16_to_fp32(static_cast<uint16_t>(h));
    if (!std::isnan(want_value)) {
      ASSERT_EQ(wide[h], static_cast<double>(want_value)) << h;
    }
  }
}

TEST(KernelsConvert, MissingPathIsRefused) {
  EXPECT_TRUE(cpu::convert_isa_supported(ConvertIsa::kScalar));
  EXPECT_TRUE(cpu::convert_isa_supported(cpu::best_convert_isa()));
  for (const ConvertIsa isa : {ConvertIsa::kAvx2, ConvertIsa::kAvx512, ConvertIsa::kAvx512Bf16}) {
    if (cpu::convert_isa_supported(isa)) continue;
    uint16_t out = 0;
    const float in = 1.0f;
    EXPECT_THROW(cpu::encode_bf16(&out, &in, 1, isa), std::invalid_argument) << cpu::convert_isa_name(isa);
  }
}

}  // namespace
}  // namespace moecore::kernels
