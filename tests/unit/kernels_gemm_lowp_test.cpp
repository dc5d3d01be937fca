// Low-precision GEMM and linear kernels (kernels/cpu/gemm_lowp.h): each path (native, convert) forced in turn, bf16
// and fp16, fp32 and low-precision outputs, every transpose combination, padded leading dimensions and shapes that
// cross the convert path's tiles, against the double-precision reference.
//
// Tolerance, derived from the formats: the inputs are exact in fp32 and their products too, so the fast result
// differs from the exact sum S = alpha * sum_k a_ik b_kj + beta * c_ij only by fp32 summation (at most
// (K + 2) * 2^-24 * S_abs, S_abs the same sum over absolute values: K additions, the alpha scaling and the beta term)
// and by the final rounding to the output format; the reference rounds the exact sum once. Two roundings of values
// that close are at most one unit in the last place of the output format apart (at the larger magnitude):
//   |fast - ref| <= ulp_out(max(|fast|, |ref|)) + (K + 2) * 2^-24 * S_abs.
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include "moecore/kernels/cpu/bf16_dot_rate.h"
#include "moecore/kernels/cpu/convert.h"
#include "moecore/kernels/cpu/gemm_lowp.h"
#include "moecore/tensor/dtype.h"

namespace moecore::kernels {
namespace {

using cpu::LowpGemmPath;

constexpr LowpType kTypes[] = {LowpType::kBF16, LowpType::kF16};
constexpr double kFp32Unit = 0x1p-24;

double decode(const LowpType type, const uint16_t bits) {
  return type == LowpType::kBF16 ? bf16_to_fp32(bits) : fp16_to_fp32(bits);
}
double decode(LowpType, const float x) { return x; }

// Unit in the last place of `x` in the output format (fp32 when T is float).
template <typename T>
double ulp(const LowpType type, const double x) {
  int mantissa_bits = 23, min_exponent = -126;
  if constexpr (std::is_same_v<T, uint16_t>) {
    mantissa_bits = type == LowpType::kBF16 ? 7 : 10;
    min_exponent = type == LowpType::kBF16 ? -126 : -14;
  }
  const int exponent = x == 0.0 ? min_exponent : std::max(std::ilogb(x), min_exponent);
  return std::ldexp(1.0, exponent - mantissa_bits);
}

std::vector<uint16_t> random_lowp(const LowpType type, const size_t n, std::mt19937& gen, const double scale = 1.0) {
  std::uniform_real_distribution<double> dist(-scale, scale);
  std::vector<uint16_t> out(n);
  for (uint16_t& x : out) x = type == LowpType::kBF16 ? ref::round_to_bf16(dist(gen)) : ref::round_to_fp16(dist(gen));
  return out;
}
std::vector<uint16_t> abs_lowp(std::vector<uint16_t> x) {
  for (uint16_t& v : x) v &= 0x7fffu;
  return x;
}

// Random contents of a C buffer of type T.
template <typename T>
std::vector<T> random_c(const LowpType type, const size_t n, std::mt19937& gen) {
  if constexpr (std::is_same_v<T, uint16_t>) {
    return random_lowp(type, n, gen);
  } else {
    std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
    std::vector<float> out(n);
    for (float& x : out) x = dist(gen);
    return out;
  }
}
template <typename T>
std::vector<float> abs_as_float(const LowpType type, const std::vector<T>& x) {
  std::vector<float> out(x.size());
  for (size_t i = 0; i < x.size(); ++i) out[i] = static_cast<float>(std::abs(decode(type, x[i])));
  return out;
}

// Every element of got within the bound of want (both of type T), with terms = K + 2 and abs_sum = S_abs.
template <typename T>
::testing::AssertionResult within_bound(const LowpType type, const std::vector<T>& got, const std::vector<T>& want,
                                        const std::vector<float>& abs_sum, const int64_t terms) {
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::memcmp(&got[i], &want[i], sizeof(T)) == 0) continue;  // equal bits (also C's untouched NaN padding)
    const double g = decode(type, got[i]), w = decode(type, want[i]);
    const double bound =
        ulp<T>(type, std::max(std::abs(g), std::abs(w))) + static_cast<double>(terms) * kFp32Unit * abs_sum[i];
    if (!(std::abs(g - w) <= bound)) {
      return ::testing::AssertionFailure() << "element " << i << ": got " << g << ", reference " << w << ", bound "
                                           << bound << " (|sum| " << abs_sum[i] << ")";
    }
  }
  return ::testing::AssertionSuccess();
}

struct GemmShape {
  int64_t M, N, K, pad;  // pad: extra elements in every leading dimension
};

// Tiny and odd shapes, square, padded leading dimensions; and the convert path's tile edges (kTileM 1024, kTileN
// 2048, kTileK 2048), fewer variants of those since the reference is a naive loop.
const GemmShape kShapes[] = {{1, 1, 1, 0}, {7, 5, 3, 0}, {33, 17, 65, 3}, {64, 64, 64, 0}, {130, 131, 8, 1}};
const GemmShape kTileEdgeShapes[] = {{1030, 3, 5, 0}, {3, 2100, 4, 2}, {3, 5, 2500, 0}, {1030, 2049, 1, 1}};

template <typename CT>
void check_gemm(const LowpType type, const bool trans_a, const bool trans_b, const GemmShape& s, const float alpha,
                const float beta, std::mt19937& gen, const std::string& what) {
  const int64_t a_rows = trans_a ? s.K : s.M, a_cols = trans_a ? s.M : s.K;
  const int64_t b_rows = trans_b ? s.N : s.K, b_cols = trans_b ? s.K : s.N;
  const int64_t lda = std::max<int64_t>(1, a_cols) + s.pad, ldb = std::max<int64_t>(1, b_cols) + s.pad;
  const int64_t ldc = s.N + s.pad;
  const std::vector<uint16_t> A = random_lowp(type, static_cast<size_t>(a_rows * lda), gen);
  const std::vector<uint16_t> B = random_lowp(type, static_cast<size_t>(b_rows * ldb), gen);
  std::vector<CT> C0 = random_c<CT>(type, static_cast<size_t>(s.M * ldc), gen);
  if (beta == 0.0f) {  // C must not be read: fill it with NaN
    for (CT& c : C0) {
      if constexpr (std::is_same_v<CT, float>) {
        c = std::numeric_limits<float>::quiet_NaN();
      } else {
        c = 0x7fc0;  // NaN in bf16 and fp16
      }
    }
  }
  std::vector<CT> got = C0, want = C0;
  cpu::gemm_lowp(type, trans_a, trans_b, s.M, s.N, s.K, alpha, A.data(), lda, B.data(), ldb, beta, got.data(), ldc);
  ref::gemm_lowp(type, trans_a, trans_b, s.M, s.N, s.K, alpha, A.data(), lda, B.data(), ldb, beta, want.data(), ldc);
  std::vector<float> abs_sum = beta == 0.0f ? std::vector<float>(C0.size(), 0.0f) : abs_as_float(type, C0);
  ref::gemm_lowp(type, trans_a, trans_b, s.M, s.N, s.K, std::abs(alpha), abs_lowp(A).data(), lda, abs_lowp(B).data(),
                 ldb, std::abs(beta), abs_sum.data(), ldc);
  // Only the M x N block: the padding columns of C must be untouched.
  for (int64_t i = 0; i < s.M; ++i) {
    for (int64_t j = s.N; j < ldc; ++j) {
      const size_t at = static_cast<size_t>(i * ldc + j);
      ASSERT_EQ(std::memcmp(&got[at], &C0[at], sizeof(CT)), 0) << what << ": wrote padding at " << i << ", " << j;
    }
  }
  EXPECT_TRUE(within_bound(type, got, want, abs_sum, s.K + 2)) << what;
}

// The native path runs only where oneDNN has kernels for the format; else the test says why it skips.
bool skip_native(const LowpType type, std::string& why) {
  std::string why_not;
  if (cpu::lowp_native_available(type, &why_not)) return false;
  why = std::string(lowp_type_name(type)) + " native path unavailable: " + why_not;
  return true;
}

void gemm_all_cases(const LowpType type, const LowpGemmPath path) {
  const cpu::ScopedLowpGemmPath scope(path);
  std::mt19937 gen(5);
  for (const GemmShape& s : kShapes) {
    for (const bool trans_a : {false, true}) {
      for (const bool trans_b : {false, true}) {
        std::ostringstream what;
        what << cpu::lowp_gemm_path_name(path) << " " << lowp_type_name(type) << " M=" << s.M << " N=" << s.N
             << " K=" << s.K << " pad=" << s.pad << " trans_a=" << trans_a << " trans_b=" << trans_b;
        check_gemm<float>(type, trans_a, trans_b, s, 1.0f, 0.0f, gen, what.str() + " C fp32");
        check_gemm<uint16_t>(type, trans_a, trans_b, s, 1.0f, 0.0f, gen, what.str() + " C low");
        check_gemm<float>(type, trans_a, trans_b, s, 1.0f, 1.0f, gen, what.str() + " C fp32 beta 1");
        check_gemm<uint16_t>(type, trans_a, trans_b, s, 1.0f, 1.0f, gen, what.str() + " C low beta 1");
      }
    }
    // alpha and beta other than 0 / 1, once per shape.
    check_gemm<float>(type, false, true, s, -0.75f, 0.5f, gen, "alpha -0.75 beta 0.5 C fp32");
    check_gemm<uint16_t>(type, true, false, s, 2.0f, -1.5f, gen, "alpha 2 beta -1.5 C low");
  }
  for (const GemmShape& s : kTileEdgeShapes) {
    for (const bool trans_a : {false, true}) {
      for (const bool trans_b : {false, true}) {
        if (s.M * s.N > 1000000 && trans_a == trans_b) continue;
        std::ostringstream what;
        what << cpu::lowp_gemm_path_name(path) << " " << lowp_type_name(type) << " M=" << s.M << " N=" << s.N
             << " K=" << s.K << " trans_a=" << trans_a << " trans_b=" << trans_b;
        check_gemm<float>(type, trans_a, trans_b, s, 1.0f, 1.0f, gen, what.str() + " C fp32 beta 1");
        check_gemm<uint16_t>(type, trans_a, trans_b, s, -0.5f, 1.0f, gen, what.str() + " C low alpha -0.5 beta 1");
      }
    }
  }
  // K == 0: C = beta * C.
  check_gemm<float>(type, false, false, {4, 3, 0, 0}, 1.0f, 0.5f, gen, "K=0 C fp32");
  check_gemm<uint16_t>(type, true, true, {4, 3, 0, 1}, 1.0f, 2.0f, gen, "K=0 C low");
}

TEST(KernelsGemmLowp, ConvertPathBf16MatchesReference) { gemm_all_cases(LowpType::kBF16, LowpGemmPath::kConvert); }
TEST(KernelsGemmLowp, ConvertPathFp16MatchesReference) { gemm_all_cases(LowpType::kF16, LowpGemmPath::kConvert); }

TEST(KernelsGemmLowp, NativePathBf16MatchesReference) {
  std::string why;
  if (skip_native(LowpType::kBF16, why)) GTEST_SKIP() << why;
  gemm_all_cases(LowpType::kBF16, LowpGemmPath::kNative);
}
TEST(KernelsGemmLowp, NativePathFp16MatchesReference) {
  std::string why;
  if (skip_native(LowpType::kF16, why)) GTEST_SKIP() << why;
  gemm_all_cases(LowpType::kF16, LowpGemmPath::kNative);
}

// fn(type, gen) for each format whose native path runs here, under that path (the others print why they skip).
template <typename Fn>
void on_native_paths(const unsigned seed, Fn&& fn) {
  for (const LowpType type : kTypes) {
    std::string why;
    if (skip_native(type, why)) {
      std::printf("%s\n", why.c_str());
      continue;
    }
    const cpu::ScopedLowpGemmPath scope(LowpGemmPath::kNative);
    std::mt19937 gen(seed);
    fn(type, gen);
  }
}

// The native path accumulates into an fp32 C of >= 8 Mi elements (an output layer's weight gradient) in blocks of
// rows through a buffer: against the reference, with M not a multiple of the blocks' rows, padded leading dimensions
// (C's padding untouched), both layouts of A (the weight gradient's is transposed).
TEST(KernelsGemmLowp, NativeAccumulationIntoALargeCMatchesReference) {
  on_native_paths(21, [](const LowpType type, std::mt19937& gen) {
    for (const bool trans_a : {true, false}) {
      check_gemm<float>(type, trans_a, false, {16500, 512, 24, 3}, 1.0f, 1.0f, gen,
                        std::string(lowp_type_name(type)) + " large C, trans_a=" + std::to_string(trans_a));
    }
  });
}

// A long K into a small fp32 C (an output layer's input gradient) runs in blocks of K on the native path: against
// the reference, K not a multiple of the blocks, every transpose combination, beta 0 and 1, alpha other than 1.
TEST(KernelsGemmLowp, NativeLongKMatchesReference) {
  on_native_paths(22, [](const LowpType type, std::mt19937& gen) {
    for (const bool trans_a : {false, true}) {
      for (const bool trans_b : {false, true}) {
        const std::string what = std::string(lowp_type_name(type)) + " long K, trans_a=" + std::to_string(trans_a) +
                                 " trans_b=" + std::to_string(trans_b);
        check_gemm<float>(type, trans_a, trans_b, {33, 40, 16500, 2}, 1.0f, 0.0f, gen, what + " beta 0");
        check_gemm<float>(type, trans_a, trans_b, {33, 40, 16500, 2}, -0.5f, 1.0f, gen, what + " beta 1");
      }
    }
  });
}

// ---- linear layer -------------------------------------------------------------------------------------------------

template <typename Out, typename Bias>
void check_linear_forward(const LowpType type, const int64_t T, const int64_t I, const int64_t O, const bool bias,
                          std::mt19937& gen, const std::string& what) {
  const std::vector<uint16_t> inp = random_lowp(type, static_cast<size_t>(T * I), gen);
  const std::vector<uint16_t> weight = random_lowp(type, static_cast<size_t>(O * I), gen);
  const std::vector<Bias> b = random_c<Bias>(type, static_cast<size_t>(O), gen);
  const Bias* bias_O = bias ? b.data() : nullptr;
  std::vector<Out> got = random_c<Out>(type, static_cast<size_t>(T * O), gen), want = got;  // overwritten
  cpu::linear_forward_lowp(type, got.data(), inp.data(), weight.data(), bias_O, T, I, O);
  ref::linear_forward_lowp(type, want.data(), inp.data(), weight.data(), bias_O, T, I, O);
  std::vector<float> abs_sum(got.size());
  const std::vector<float> abs_bias = abs_as_float(type, b);
  ref::linear_forward_lowp(type, abs_sum.data(), abs_lowp(inp).data(), abs_lowp(weight).data(),
                           bias ? abs_bias.data() : nullptr, T, I, O);
  EXPECT_TRUE(within_bound(type, got, want, abs_sum, I + 2)) << what;
}

template <typename DInp, typename DWeight, typename DBias>
void check_linear_backward(const LowpType type, const int64_t T, const int64_t I, const int64_t O, std::mt19937& gen,
                           const std::string& what) {
  const std::vector<uint16_t> inp = random_lowp(type, static_cast<size_t>(T * I), gen);
  const std::vector<uint16_t> weight = random_lowp(type, static_cast<size_t>(O * I), gen);
  const std::vector<uint16_t> dout = random_lowp(type, static_cast<size_t>(T * O), gen);
  const std::vector<DInp> dinp0 = random_c<DInp>(type, static_cast<size_t>(T * I), gen);
  const std::vector<DWeight> dweight0 = random_c<DWeight>(type, static_cast<size_t>(O * I), gen);
  const std::vector<DBias> dbias0 = random_c<DBias>(type, static_cast<size_t>(O), gen);
  std::vector<DInp> dinp = dinp0, dinp_ref = dinp0;
  std::vector<DWeight> dweight = dweight0, dweight_ref = dweight0;
  std::vector<DBias> dbias = dbias0, dbias_ref = dbias0;
  cpu::linear_backward_lowp(type, dinp.data(), dweight.data(), dbias.data(), dout.data(), inp.data(), weight.data(), T,
                            I, O);
  ref::linear_backward_lowp(type, dinp_ref.data(), dweight_ref.data(), dbias_ref.data(), dout.data(), inp.data(),
                            weight.data(), T, I, O);
  std::vector<float> abs_dinp = abs_as_float(type, dinp0), abs_dweight = abs_as_float(type, dweight0),
                     abs_dbias = abs_as_float(type, dbias0);
  ref::linear_backward_lowp(type, abs_dinp.data(), abs_dweight.data(), abs_dbias.data(), abs_lowp(dout).data(),
                            abs_lowp(inp).data(), abs_lowp(weight).data(), T, I, O);
  EXPECT_TRUE(within_bound(type, dinp, dinp_ref, abs_dinp, O + 2)) << what << " dinp";
  EXPECT_TRUE(within_bound(type, dweight, dweight_ref, abs_dweight, T + 2)) << what << " dweight";
  EXPECT_TRUE(within_bound(type, dbias, dbias_ref, abs_dbias, T + 2)) << what << " dbias";
  // Null outputs are skipped: only dinp, then nothing at all.
  std::vector<DInp> only_dinp = dinp0;
  cpu::linear_backward_lowp(type, only_dinp.data(), static_cast<DWeight*>(nullptr), static_cast<DBias*>(nullptr),
                            dout.data(), static_cast<const uint16_t*>(nullptr), weight.data(), T, I, O);
  EXPECT_TRUE(within_bound(type, only_dinp, dinp_ref, abs_dinp, O + 2)) << what << " dinp alone";
}

void linear_all_cases(const LowpType type, const LowpGemmPath path) {
  const cpu::ScopedLowpGemmPath scope(path);
  std::mt19937 gen(9);
  struct Shape {
    int64_t T, I, O;
  };
  for (const Shape s : {Shape{1, 1, 1}, Shape{6, 7, 9}, Shape{130, 8, 131}, Shape{300, 33, 600}}) {
    const std::string what = std::string(cpu::lowp_gemm_path_name(path)) + " " + std::string(lowp_type_name(type)) +
                             " T=" + std::to_string(s.T) + " I=" + std::to_string(s.I) + " O=" + std::to_string(s.O);
    for (const bool bias : {false, true}) {
      check_linear_forward<float, float>(type, s.T, s.I, s.O, bias, gen, what + " out fp32, bias fp32");
      check_linear_forward<float, uint16_t>(type, s.T, s.I, s.O, bias, gen, what + " out fp32, bias low");
      check_linear_forward<uint16_t, float>(type, s.T, s.I, s.O, bias, gen, what + " out low, bias fp32");
      check_linear_forward<uint16_t, uint16_t>(type, s.T, s.I, s.O, bias, gen, what + " out low, bias low");
    }
    check_linear_backward<float, float, float>(type, s.T, s.I, s.O, gen, what + " grads fp32");
    check_linear_backward<uint16_t, float, float>(type, s.T, s.I, s.O, gen, what + " dinp low, main grads fp32");
    check_linear_backward<uint16_t, uint16_t, uint16_t>(type, s.T, s.I, s.O, gen, what + " grads low");
    check_linear_backward<float, uint16_t, float>(type, s.T, s.I, s.O, gen, what + " dweight low");
  }
}

TEST(KernelsGemmLowp, ConvertPathBf16LinearMatchesReference) {
  linear_all_cases(LowpType::kBF16, LowpGemmPath::kConvert);
}
TEST(KernelsGemmLowp, ConvertPathFp16LinearMatchesReference) {
  linear_all_cases(LowpType::kF16, LowpGemmPath::kConvert);
}

TEST(KernelsGemmLowp, NativePathBf16LinearMatchesReference) {
  std::string why;
  if (skip_native(LowpType::kBF16, why)) GTEST_SKIP() << why;
  linear_all_cases(LowpType::kBF16, LowpGemmPath::kNative);
}
TEST(KernelsGemmLowp, NativePathFp16LinearMatchesReference) {
  std::string why;
  if (skip_native(LowpType::kF16, why)) GTEST_SKIP() << why;
  linear_all_cases(LowpType::kF16, LowpGemmPath::kNative);
}

TEST(KernelsGemmLowp, TwoThreadsGiveTheSameBoundAsOne) {
  std::mt19937 gen(13);
  for (const LowpType type : kTypes) {
    for (const LowpGemmPath path : {LowpGemmPath::kConvert, LowpGemmPath::kNative}) {
      if (path == LowpGemmPath::kNative && !cpu::lowp_native_available(type)) continue;
      const cpu::ScopedLowpGemmPath scope(path);
      for (const int threads : {1, 2}) {
        omp_set_num_threads(threads);
        check_gemm<uint16_t>(type, false, true, {257, 300, 190, 0}, 1.0f, 1.0f, gen,
                             std::string(cpu::lowp_gemm_path_name(path)) + " threads=" + std::to_string(threads));
      }
    }
  }
}

// ---- path choice --------------------------------------------------------------------------------------------------

TEST(KernelsGemmLowp, DefaultPathIsNativeOnlyWhereTheMatrixRateBeatsFp32) {
  if (std::getenv("MOECORE_LOWP_GEMM") != nullptr) GTEST_SKIP() << "MOECORE_LOWP_GEMM is set";
  for (const LowpType type : kTypes) {
    const bool faster = cpu::cpu_has_lowp_amx(type) || (type == LowpType::kBF16 && cpu::avx512_bf16_outpaces_fp32());
    const bool native = faster && cpu::lowp_native_available(type);
    if (cpu::cpu_has_lowp_amx(type)) {
      EXPECT_TRUE(cpu::cpu_has_lowp_dot(type)) << lowp_type_name(type);
    }
    EXPECT_EQ(cpu::lowp_gemm_path(type), native ? LowpGemmPath::kNative : LowpGemmPath::kConvert)
        << lowp_type_name(type);
    const std::string library = cpu::gemm_lowp_library(type);
    EXPECT_NE(library.find(lowp_type_name(type)), std::string::npos) << library;
    EXPECT_NE(library.find(native ? "matmul" : "conversion"), std::string::npos) << library;
  }
  // bf16 dot products: AVX512_BF16 or AMX-BF16, as the CPU reports them.
  __builtin_cpu_init();
  EXPECT_EQ(cpu::cpu_has_lowp_dot(LowpType::kBF16),
            __builtin_cpu_supports("avx512bf16") != 0 || __builtin_cpu_supports("amx-bf16") != 0);
  // The vector dot product's table: AMD family 1Ah (Zen 5) only, and only with the instructions.
  if (cpu::avx512_bf16_outpaces_fp32()) {
    EXPECT_NE(__builtin_cpu_supports("avx512bf16"), 0);
    EXPECT_NE(__builtin_cpu_is("amd"), 0);
  }
  if (__builtin_cpu_is("intel") != 0) {
    EXPECT_FALSE(cpu::avx512_bf16_outpaces_fp32());
  }
  // AMX only where the CPU has the instructions.
  if (__builtin_cpu_supports("amx-bf16") == 0) {
    EXPECT_FALSE(cpu::cpu_has_lowp_amx(LowpType::kBF16));
    EXPECT_FALSE(cpu::cpu_has_lowp_amx(LowpType::kF16));
  }
}

TEST(KernelsGemmLowp, ScopedPathNestsAndRestores) {
  const LowpGemmPath before = cpu::lowp_gemm_path(LowpType::kBF16);
  {
    const cpu::ScopedLowpGemmPath convert(LowpGemmPath::kConvert);
    EXPECT_EQ(cpu::lowp_gemm_path(LowpType::kBF16), LowpGemmPath::kConvert);
    {
      const cpu::ScopedLowpGemmPath native(LowpGemmPath::kNative);
      EXPECT_EQ(cpu::lowp_gemm_path(LowpType::kF16), LowpGemmPath::kNative);
    }
    EXPECT_EQ(cpu::lowp_gemm_path(LowpType::kF16), LowpGemmPath::kConvert);
    EXPECT_NE(cpu::gemm_lowp_library(LowpType::kBF16).find("-> fp32 conversion"), std::string::npos);
  }
  EXPECT_EQ(cpu::lowp_gemm_path(LowpType::kBF16), before);
}

TEST(KernelsGemmLowp, ForcedNativeWithoutKernelsSaysWhy) {
  for (const LowpType type : kTypes) {
    std::string why_not;
    if (cpu::lowp_native_available(type, &why_not)) continue;
    EXPECT_FALSE(why_not.empty());
    const cpu::ScopedLowpGemmPath native(LowpGemmPath::kNative);
    const uint16_t a = 0x3f80, b = 0x3f80;
    float c = 0.0f;
    try {
      cpu::gemm_lowp(type, false, false, 1, 1, 1, 1.0f, &a, 1, &b, 1, 0.0f, &c, 1);
      ADD_FAILURE() << lowp_type_name(type) << ": no error";
    } catch (const std::runtime_error& error) {
      EXPECT_NE(std::string(error.what()).find(why_not), std::string::npos) << error.what();
    }
  }
}

TEST(KernelsGemmLowp, PathNamesParse) {
  EXPECT_EQ(cpu::parse_lowp_gemm_path("native"), LowpGemmPath::kNative);
  EXPECT_EQ(cpu::parse_lowp_gemm_path("convert"), LowpGemmPath::kConvert);
  try {
    cpu::parse_lowp_gemm_path("fast");
    ADD_FAILURE() << "no error";
  } catch (const std::invalid_argument& error) {
    EXPECT_STREQ(error.what(), "MOECORE_LOWP_GEMM=fast: expected native or convert");
  }
}

// The environment variable itself, in a fresh process (it is read once).
TEST(KernelsGemmLowpDeathTest, EnvironmentVariableChoosesOrIsRefused) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  const auto run_with = [](const char* value) {
    setenv("MOECORE_LOWP_GEMM", value, 1);
    try {
      const uint16_t a = 0x3f80, b = 0x4000;
      float c = 0.0f;
      cpu::gemm_lowp(LowpType::kBF16, false, false, 1, 1, 1, 1.0f, &a, 1, &b, 1, 0.0f, &c, 1);
      std::fprintf(stderr, "path %s c %g\n",
                   std::string(cpu::lowp_gemm_path_name(cpu::lowp_gemm_path(LowpType::kBF16))).c_str(), c);
      std::exit(0);
    } catch (const std::exception& error) {
      std::fprintf(stderr, "error: %s\n", error.what());
      std::exit(1);
    }
  };
  EXPECT_EXIT(run_with("bogus"), ::testing::ExitedWithCode(1),
              "error: MOECORE_LOWP_GEMM=bogus: expected native or convert");
  EXPECT_EXIT(run_with("convert"), ::testing::ExitedWithCode(0), "path convert c 2");
}

}  // namespace
}  // namespace moecore::kernels
