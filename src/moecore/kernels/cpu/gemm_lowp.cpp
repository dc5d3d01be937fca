// Fast low-precision GEMM: oneDNN's matmul primitive on bf16 / fp16 memory (the native path: oneDNN JIT-compiles
// kernels with AVX512_BF16 / AMX instructions when the CPU has them), or conversion of the inputs to fp32 in tiles and
// the fp32 sgemm (the convert path). Both sum in fp32 and round a low-precision output once.
#include "moecore/kernels/cpu/gemm_lowp.h"

#include <cpuid.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdlib>
#include <dnnl.hpp>
#include <memory>
#include <stdexcept>
#include <type_traits>
#include <vector>

#include "moecore/kernels/cpu/bf16_dot_rate.h"
#include "moecore/kernels/cpu/blocked_accumulate.h"
#include "moecore/kernels/cpu/convert.h"
#include "moecore/kernels/cpu/gemm.h"
#include "moecore/kernels/cpu/onednn_matmul.h"

namespace moecore::kernels {

std::string_view lowp_type_name(const LowpType type) { return type == LowpType::kBF16 ? "bf16" : "fp16"; }

namespace cpu {
namespace {

// ---- arguments and small helpers ----------------------------------------------------------------------------------

void check_args(const bool trans_a, const bool trans_b, const int64_t M, const int64_t N, const int64_t K,
                const int64_t lda, const int64_t ldb, const int64_t ldc) {
  if (M < 0 || N < 0 || K < 0) {
    throw std::invalid_argument("gemm_lowp: negative size M=" + std::to_string(M) + " N=" + std::to_string(N) +
                                " K=" + std::to_string(K));
  }
  if (lda < std::max<int64_t>(1, trans_a ? M : K) || ldb < std::max<int64_t>(1, trans_b ? K : N) ||
      ldc < std::max<int64_t>(1, N)) {
    throw std::invalid_argument("gemm_lowp: leading dimension too small (lda=" + std::to_string(lda) +
                                " ldb=" + std::to_string(ldb) + " ldc=" + std::to_string(ldc) + ")");
  }
  const int64_t biggest = std::max({M, N, K, lda, ldb, ldc});
  if (biggest > INT_MAX) throw std::invalid_argument("gemm_lowp: size " + std::to_string(biggest) + " exceeds int");
}

void decode(const LowpType type, float* out, const uint16_t* in, const int64_t n, const ConvertIsa isa) {
  type == LowpType::kBF16 ? decode_bf16(out, in, n, isa) : decode_fp16(out, in, n, isa);
}
void encode(const LowpType type, uint16_t* out, const float* in, const int64_t n, const ConvertIsa isa) {
  type == LowpType::kBF16 ? encode_bf16(out, in, n, isa) : encode_fp16(out, in, n, isa);
}

// Rows of a strided matrix converted to / from a dense fp32 one, in parallel over rows only when large: a tile
// converts at several GB/s on one core, and every parallel region is one more barrier at which a busy machine can
// stall both threads for a scheduling quantum.
constexpr int64_t kParallelConvert = int64_t{1} << 21;
void decode_rows(const LowpType type, float* out, const uint16_t* in, const int64_t ld_in, const int64_t rows,
                 const int64_t cols) {
  const ConvertIsa isa = best_convert_isa();
#pragma omp parallel for schedule(static) if (rows * cols > kParallelConvert)
  for (int64_t r = 0; r < rows; ++r) decode(type, out + r * cols, in + r * ld_in, cols, isa);
}
void encode_rows(const LowpType type, uint16_t* out, const int64_t ld_out, const float* in, const int64_t rows,
                 const int64_t cols) {
  const ConvertIsa isa = best_convert_isa();
#pragma omp parallel for schedule(static) if (rows * cols > kParallelConvert)
  for (int64_t r = 0; r < rows; ++r) encode(type, out + r * ld_out, in + r * cols, cols, isa);
}

// Uninitialised fp32 scratch (no zero-fill: every tile is written before it is read).
struct FloatBuffer {
  explicit FloatBuffer(const int64_t n) : data(n > 0 ? new float[static_cast<size_t>(n)] : nullptr) {}
  std::unique_ptr<float[]> data;
};

// C = beta * C (+ bias row) for K == 0, where no product contributes.
template <typename CT>
void scale_only(const LowpType type, const int64_t M, const int64_t N, const float beta, CT* C, const int64_t ldc,
                const float* bias_N) {
  std::vector<float> row(static_cast<size_t>(N));
  const ConvertIsa isa = best_convert_isa();
  for (int64_t i = 0; i < M; ++i) {
    CT* c = C + i * ldc;
    if constexpr (std::is_same_v<CT, float>) {
      std::copy_n(c, N, row.data());
    } else {
      decode(type, row.data(), c, N, isa);
    }
    for (int64_t j = 0; j < N; ++j) {
      const float old = beta == 0.0f ? 0.0f : beta * row[static_cast<size_t>(j)];
      row[static_cast<size_t>(j)] = old + (bias_N != nullptr ? bias_N[j] : 0.0f);
    }
    if constexpr (std::is_same_v<CT, float>) {
      std::copy_n(row.data(), N, c);
    } else {
      encode(type, c, row.data(), N, isa);
    }
  }
}

// ---- path choice --------------------------------------------------------------------------------------------------

constexpr int kNoOverride = -1;
std::atomic<int> g_path_override{kNoOverride};

int env_path() {
  // Read once; a bad value is reported by every call, so it cannot be missed.
  static const std::string value = [] {
    const char* v = std::getenv("MOECORE_LOWP_GEMM");
    return std::string(v == nullptr ? "" : v);
  }();
  return value.empty() ? kNoOverride : static_cast<int>(parse_lowp_gemm_path(value));
}

std::string onednn_version() {
  const dnnl_version_t* v = dnnl_version();
  return "oneDNN " + std::to_string(v->major) + "." + std::to_string(v->minor) + "." + std::to_string(v->patch);
}

// ---- native path: oneDNN matmul -----------------------------------------------------------------------------------

MatmulInput matmul_input(const LowpType type) {
  return type == LowpType::kBF16 ? MatmulInput::kBF16 : MatmulInput::kF16;
}

std::string probe_native(const LowpType type) {
  MatmulShape shape;
  shape.input = matmul_input(type);
  shape.trans_b = true;
  shape.M = shape.N = shape.K = shape.lda = shape.ldb = shape.ldc = 64;
  return onednn_matmul_impl(shape);
}

// oneDNN's implementation name for a plain row-major shape ("brg:avx512_core_bf16"), or "" when it has none.
const std::string& native_impl(const LowpType type) {
  static const std::string bf16 = probe_native(LowpType::kBF16);
  static const std::string fp16 = probe_native(LowpType::kF16);
  return type == LowpType::kBF16 ? bf16 : fp16;
}

// oneDNN 2.6.3's bf16 matmul accumulating into a large fp32 C runs in blocks of rows (blocked_accumulate.h). It also
// ran a long K into a small C (512 x 512 x 32128, the output layer's input gradient) at 800-850 GFLOP/s, and the same
// product in K blocks of 4096 accumulated into C (which stays in cache) at 910-925 (AMD Zen 5; the fp32 sgemm gained
// nothing so): an fp32 C of at most kLongKMaxC elements over K >= kLongK runs so.
constexpr int64_t kLongK = 16384, kLongKBlock = 4096, kLongKMaxC = int64_t{1} << 20;

template <typename CT>
void gemm_native(const LowpType type, const bool trans_a, const bool trans_b, const int64_t M, const int64_t N,
                 const int64_t K, const float alpha, const uint16_t* A, const int64_t lda, const uint16_t* B,
                 const int64_t ldb, const float beta, CT* C, const int64_t ldc, const float* bias_N) {
  if constexpr (std::is_same_v<CT, float>) {
    if (beta == 1.0f && bias_N == nullptr && blocked_accumulate::applies(M, N)) {
      blocked_accumulate::run(
          M, N, C, ldc, onednn_matmul_threads(), [&](const int64_t m0, const int64_t rows, float* buffer) {
            const uint16_t* a = trans_a ? A + m0 : A + m0 * lda;  // op(A)'s rows m0..
            gemm_native<float>(type, trans_a, trans_b, rows, N, K, alpha, a, lda, B, ldb, 0.0f, buffer, N, nullptr);
          });
      return;
    }
    if (K >= kLongK && M * N <= kLongKMaxC && bias_N == nullptr) {
      for (int64_t k0 = 0; k0 < K; k0 += kLongKBlock) {
        const uint16_t* a = trans_a ? A + k0 * lda : A + k0;  // op(A)'s columns k0..
        const uint16_t* b = trans_b ? B + k0 : B + k0 * ldb;  // op(B)'s rows k0..
        gemm_native<float>(type, trans_a, trans_b, M, N, std::min(kLongKBlock, K - k0), alpha, a, lda, b, ldb,
                           k0 == 0 ? beta : 1.0f, C, ldc, nullptr);
      }
      return;
    }
  }
  const MatmulShape shape{matmul_input(type),
                          std::is_same_v<CT, uint16_t>,
                          trans_a,
                          trans_b,
                          bias_N != nullptr,
                          M,
                          N,
                          K,
                          lda,
                          ldb,
                          ldc,
                          alpha,
                          beta,
                          onednn_matmul_threads()};
  onednn_matmul("gemm_lowp", shape, A, B, C, bias_N);
}

// ---- convert path: fp32 tiles and sgemm ---------------------------------------------------------------------------

// Tile sizes: op(A) tiles of kTileM x kTileK and op(B) tiles of kTileK x kTileN, widened to fp32 (8 + 16 MiB at
// most), and for a low-precision C an fp32 tile of kTileM x kTileN. Large enough that each widened element feeds
// >= 2 x 1024 flops, so the conversion costs little next to the sgemm.
constexpr int64_t kTileM = 1024, kTileN = 2048, kTileK = 2048;

template <typename CT>
void gemm_convert(const LowpType type, const bool trans_a, const bool trans_b, const int64_t M, const int64_t N,
                  const int64_t K, const float alpha, const uint16_t* A, const int64_t lda, const uint16_t* B,
                  const int64_t ldb, const float beta, CT* C, const int64_t ldc, const float* bias_N) {
  constexpr bool kLowC = std::is_same_v<CT, uint16_t>;
  const int64_t mb = std::min(M, kTileM), nb = std::min(N, kTileN), kb = std::min(K, kTileK);
  FloatBuffer a_tile(mb * kb), b_tile(kb * nb), c_tile(kLowC || bias_N != nullptr ? mb * nb : 0);
  int64_t a_at_m = -1, a_at_k = -1, b_at_k = -1, b_at_n = -1;  // the tiles a_tile / b_tile hold now
  for (int64_t n0 = 0; n0 < N; n0 += nb) {
    const int64_t n_len = std::min(nb, N - n0);
    for (int64_t m0 = 0; m0 < M; m0 += mb) {
      const int64_t m_len = std::min(mb, M - m0);
      // Where this C tile is summed: in place for fp32 C, else (and for a bias row) in the fp32 tile.
      const bool in_tile = kLowC || bias_N != nullptr;
      float* c = nullptr;
      int64_t ldc_tile = n_len;
      float tile_beta = beta;
      if (in_tile) {
        c = c_tile.data.get();
        if (bias_N != nullptr) {  // linear forward: out = bias + products (beta is 0 there)
          for (int64_t i = 0; i < m_len; ++i) std::copy_n(bias_N + n0, n_len, c + i * n_len);
          tile_beta = 1.0f;
        } else if (beta != 0.0f) {
          if constexpr (kLowC) decode_rows(type, c, C + m0 * ldc + n0, ldc, m_len, n_len);
        }
      } else {
        if constexpr (!kLowC) c = C + m0 * ldc + n0;
        ldc_tile = ldc;
      }
      for (int64_t k0 = 0; k0 < K; k0 += kb) {
        const int64_t k_len = std::min(kb, K - k0);
        if (a_at_m != m0 || a_at_k != k0) {  // op(A) rows m0.., columns k0.. (stored transposed when trans_a)
          trans_a ? decode_rows(type, a_tile.data.get(), A + k0 * lda + m0, lda, k_len, m_len)
                  : decode_rows(type, a_tile.data.get(), A + m0 * lda + k0, lda, m_len, k_len);
          a_at_m = m0;
          a_at_k = k0;
        }
        if (b_at_k != k0 || b_at_n != n0) {
          trans_b ? decode_rows(type, b_tile.data.get(), B + n0 * ldb + k0, ldb, n_len, k_len)
                  : decode_rows(type, b_tile.data.get(), B + k0 * ldb + n0, ldb, k_len, n_len);
          b_at_k = k0;
          b_at_n = n0;
        }
        sgemm(trans_a, trans_b, m_len, n_len, k_len, alpha, a_tile.data.get(), trans_a ? m_len : k_len,
              b_tile.data.get(), trans_b ? k_len : n_len, tile_beta, c, ldc_tile);
        tile_beta = 1.0f;
      }
      if (in_tile) {
        if constexpr (kLowC) {
          encode_rows(type, C + m0 * ldc + n0, ldc, c, m_len, n_len);
        } else {
          for (int64_t i = 0; i < m_len; ++i) std::copy_n(c + i * n_len, n_len, C + (m0 + i) * ldc + n0);
        }
      }
    }
  }
}

// Both paths behind one entry; bias_N (fp32, may be null) only with alpha 1 and beta 0 (linear forward).
template <typename CT>
void gemm_any(const LowpType type, const bool trans_a, const bool trans_b, const int64_t M, const int64_t N,
              const int64_t K, const float alpha, const uint16_t* A, const int64_t lda, const uint16_t* B,
              const int64_t ldb, const float beta, CT* C, const int64_t ldc, const float* bias_N) {
  check_args(trans_a, trans_b, M, N, K, lda, ldb, ldc);
  if (M == 0 || N == 0) return;
  if (K == 0) {
    scale_only(type, M, N, beta, C, ldc, bias_N);
    return;
  }
  if (lowp_gemm_path(type) == LowpGemmPath::kConvert) {
    gemm_convert(type, trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, bias_N);
    return;
  }
  std::string why_not;
  if (!lowp_native_available(type, &why_not)) {
    throw std::runtime_error("gemm_lowp: the native " + std::string(lowp_type_name(type)) +
                             " path was forced (MOECORE_LOWP_GEMM=native), but " + why_not);
  }
  gemm_native(type, trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, bias_N);
}

template <typename T>
std::vector<float> bias_fp32(const LowpType type, const T* bias_O, const int64_t n) {
  std::vector<float> out;
  if (bias_O == nullptr) return out;
  out.resize(static_cast<size_t>(n));
  if constexpr (std::is_same_v<T, float>) {
    std::copy_n(bias_O, n, out.data());
  } else {
    decode(type, out.data(), bias_O, n, best_convert_isa());
  }
  return out;
}

}  // namespace

LowpGemmPath parse_lowp_gemm_path(const std::string_view value) {
  if (value == "native") return LowpGemmPath::kNative;
  if (value == "convert") return LowpGemmPath::kConvert;
  throw std::invalid_argument("MOECORE_LOWP_GEMM=" + std::string(value) + ": expected native or convert");
}

std::string_view lowp_gemm_path_name(const LowpGemmPath path) {
  return path == LowpGemmPath::kNative ? "native" : "convert";
}

bool cpu_has_lowp_dot(const LowpType type) {
  __builtin_cpu_init();
  if (type == LowpType::kBF16) return __builtin_cpu_supports("avx512bf16") || __builtin_cpu_supports("amx-bf16");
  return __builtin_cpu_supports("avx512fp16");
}

bool cpu_has_lowp_amx(const LowpType type) {
  if (dnnl_get_effective_cpu_isa() != dnnl_cpu_isa_avx512_core_amx) return false;  // AMX-BF16 (and INT8) tiles
  if (type == LowpType::kBF16) return true;
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;  // AMX-FP16: CPUID leaf 7 subleaf 1, EAX bit 21
  return __get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx) != 0 && (eax & (1u << 21)) != 0;
}

bool lowp_native_available(const LowpType type, std::string* why_not) {
  std::string reason;
  if (!onednn_matmul_built()) {
    reason = "moecore's native path uses the oneDNN 2.x API; this build has " + onednn_version();
  } else if (native_impl(type).empty()) {
    reason = onednn_version() + " has no CPU " + std::string(lowp_type_name(type)) + " matmul on this CPU";
  } else if (native_impl(type).rfind("ref", 0) == 0) {
    reason = onednn_version() + " has only its reference " + std::string(lowp_type_name(type)) + " matmul (" +
             native_impl(type) + ")";
  }
  if (why_not != nullptr) *why_not = reason;
  return reason.empty();
}

LowpGemmPath lowp_gemm_path(const LowpType type) {
  const int forced = g_path_override.load();
  if (forced != kNoOverride) return static_cast<LowpGemmPath>(forced);
  const int from_env = env_path();
  if (from_env != kNoOverride) return static_cast<LowpGemmPath>(from_env);
  const bool matrix_rate = cpu_has_lowp_amx(type) || (type == LowpType::kBF16 && avx512_bf16_outpaces_fp32());
  return matrix_rate && lowp_native_available(type) ? LowpGemmPath::kNative : LowpGemmPath::kConvert;
}

ScopedLowpGemmPath::ScopedLowpGemmPath(const LowpGemmPath path)
    : previous_(g_path_override.exchange(static_cast<int>(path))) {}
ScopedLowpGemmPath::~ScopedLowpGemmPath() { g_path_override.store(previous_); }

std::string gemm_lowp_library(const LowpType type) { return gemm_lowp_library(type, lowp_gemm_path(type)); }

bool lowp_gemm_native(const LowpType type) { return lowp_gemm_path(type) == LowpGemmPath::kNative; }

std::string gemm_lowp_library(const LowpType type, const LowpGemmPath path) {
  const std::string name(lowp_type_name(type));
  if (path == LowpGemmPath::kConvert) {
    return name + " -> fp32 conversion (" + std::string(convert_isa_name(best_convert_isa())) + ") + " + gemm_library();
  }
  std::string why_not;
  if (!lowp_native_available(type, &why_not)) return name + " native path unavailable: " + why_not;
  return onednn_version() + " " + name + " matmul, " + native_impl(type) + " kernels";
}

template <typename CT>
void gemm_lowp(const LowpType type, const bool trans_a, const bool trans_b, const int64_t M, const int64_t N,
               const int64_t K, const float alpha, const uint16_t* A, const int64_t lda, const uint16_t* B,
               const int64_t ldb, const float beta, CT* C, const int64_t ldc) {
  gemm_any(type, trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, nullptr);
}

template <typename Out, typename Bias>
void linear_forward_lowp(const LowpType type, Out* out_TO, const uint16_t* inp_TI, const uint16_t* weight_OI,
                         const Bias* bias_O, const int64_t n_tokens, const int64_t in_features,
                         const int64_t out_features) {
  const std::vector<float> bias = bias_fp32(type, bias_O, out_features);
  gemm_any(type, false, true, n_tokens, out_features, in_features, 1.0f, inp_TI, in_features, weight_OI, in_features,
           0.0f, out_TO, out_features, bias_O != nullptr ? bias.data() : nullptr);
}

template <typename DInp, typename DWeight, typename DBias>
void linear_backward_lowp(const LowpType type, DInp* dinp_TI, DWeight* dweight_OI, DBias* dbias_O,
                          const uint16_t* dout_TO, const uint16_t* inp_TI, const uint16_t* weight_OI,
                          const int64_t n_tokens, const int64_t in_features, const int64_t out_features) {
  if (dinp_TI != nullptr) {
    gemm_any(type, false, false, n_tokens, in_features, out_features, 1.0f, dout_TO, out_features, weight_OI,
             in_features, 1.0f, dinp_TI, in_features, nullptr);
  }
  if (dweight_OI != nullptr) {
    gemm_any(type, true, false, out_features, in_features, n_tokens, 1.0f, dout_TO, out_features, inp_TI, in_features,
             1.0f, dweight_OI, in_features, nullptr);
  }
  if (dbias_O != nullptr) {
    // Column sums in fp32 starting from the old value: each thread owns a block of columns and walks all rows.
    constexpr int64_t kBlock = 256;
    const int64_t n_blocks = (out_features + kBlock - 1) / kBlock;
    const ConvertIsa isa = best_convert_isa();
#pragma omp parallel for schedule(static) if (n_tokens * out_features > 16384)
    for (int64_t block = 0; block < n_blocks; ++block) {
      const int64_t o_begin = block * kBlock, len = std::min(out_features, o_begin + kBlock) - o_begin;
      float sum[kBlock], row[kBlock];
      if constexpr (std::is_same_v<DBias, float>) {
        std::copy_n(dbias_O + o_begin, len, sum);
      } else {
        decode(type, sum, dbias_O + o_begin, len, isa);
      }
      for (int64_t t = 0; t < n_tokens; ++t) {
        decode(type, row, dout_TO + t * out_features + o_begin, len, isa);
        for (int64_t o = 0; o < len; ++o) sum[o] += row[o];
      }
      if constexpr (std::is_same_v<DBias, float>) {
        std::copy_n(sum, len, dbias_O + o_begin);
      } else {
        encode(type, dbias_O + o_begin, sum, len, isa);
      }
    }
  }
}

#define MOECORE_INSTANTIATE_GEMM(CT)                                                                            \
  template void gemm_lowp<CT>(LowpType, bool, bool, int64_t, int64_t, int64_t, float, const uint16_t*, int64_t, \
                              const uint16_t*, int64_t, float, CT*, int64_t);
#define MOECORE_INSTANTIATE_FORWARD(Out, Bias)                                                                         \
  template void linear_forward_lowp<Out, Bias>(LowpType, Out*, const uint16_t*, const uint16_t*, const Bias*, int64_t, \
                                               int64_t, int64_t);
#define MOECORE_INSTANTIATE_BACKWARD(DInp, DWeight, DBias)                                                     \
  template void linear_backward_lowp<DInp, DWeight, DBias>(LowpType, DInp*, DWeight*, DBias*, const uint16_t*, \
                                                           const uint16_t*, const uint16_t*, int64_t, int64_t, \
                                                           int64_t);
#include "moecore/kernels/cpu/gemm_lowp_instances.h"

}  // namespace cpu
}  // namespace moecore::kernels
