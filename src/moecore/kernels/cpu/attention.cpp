// Fast causal GQA attention, flash-style (Dao, "FlashAttention-2", 2023, algorithms 1 and 2): a task takes a block
// of query rows of every head of one kv group (the heads share each K/V tile, read in place from the [Sk, B, G, d]
// and [Sk, B, G, dv] tensors), walks the keys up to the diagonal in tiles that stay in cache, and keeps an online
// softmax (running row max and sum, the output accumulator rescaled when the max grows), so no [rows, S] tile is ever
// formed. Tiles above the diagonal are skipped; the block's own keys, where the mask cuts, go in narrow tiles against
// only the rows that see them. Backward recomputes the probabilities of each tile from the saved lse. Products are
// single-threaded GEMMs (gemm.h) inside OpenMP loops; the element-wise loops (vectorised exp, fast_exp.h; the dropout
// mask's Philox) are compiled per vector ISA (vector_isa.h).
//
// Every output element is a fixed sequence of tile operations whatever the thread count: a task owns its outputs
// (forward: its query rows; backward: dK, dV of its key tile or all tiles of its group, dQ of its query block), and
// both backward schedules below visit the tiles of one output in the same order with the same tile shapes.
//
// Block attention (query / key indices, documents, Sk != S: attention.h) takes the general path: each key row is
// classed against a query block by its index and document (seen by no row, by every row, by some), runs of keys
// seen by every row go in tiles without a mask, keys seen by some go in narrow tiles masked element by element from
// the first row that sees any, and keys seen by none are skipped. Tiles stay inside the key-tile-aligned ranges, as
// on the plain path. The plain causal self-attention keeps its own tiling (the prefix mask of each row).
//
// bf16 products (AttentionDims::bf16_products; attention_products.h), on both paths and in both schedules, with the
// same tiles: every product takes bf16 operands and sums in fp32 (AMX tiles where usable). Operands are packed once
// where they are reused: k and v of every (b, group) per call, q and dout per block; on AMX the softmax writes P and
// the backward dS as bf16 rows directly. dK and dV of a task's keys gather in contiguous per-thread accumulators
// and are added to the gradients once, in both schedules alike, so the results stay independent of the thread
// count. In fp64 (tests) the operands are rounded to bf16 values and multiplied in double.
#include "moecore/kernels/cpu/attention.h"

#include <cblas.h>
#include <omp.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "moecore/kernels/cpu/attention_checks.h"
#include "moecore/kernels/cpu/attention_products.h"
#include "moecore/kernels/cpu/fast_exp.h"
#include "moecore/kernels/cpu/gemm.h"
#include "moecore/kernels/cpu/vector_isa.h"
#include "moecore/tensor/dtype.h"

namespace moecore::kernels::cpu {
namespace {

// A query block holds kPackedRows / (heads per group) query rows (rounded down to a power of two, at least
// kMinBlockRows, at most kMaxBlockRows) of every head of its group: about kPackedRows rows in the GEMMs whatever the
// grouping.
constexpr int64_t kPackedRows = 256;
constexpr int64_t kMinBlockRows = 16;
constexpr int64_t kMaxBlockRows = 128;
// Keys per tile: the [packed rows, tile] scores (two tiles in backward) stay in L2. A block's own keys, where the
// causal mask cuts, go in tiles of kDiagonalTile keys, each against the rows that see it.
constexpr int64_t kKeyTileForward = 256;
constexpr int64_t kKeyTileBackward = 128;
constexpr int64_t kDiagonalTile = 32;
static_assert(kMaxBlockRows <= kKeyTileBackward && kMaxBlockRows <= kKeyTileForward,
              "a block's own keys must fit in one key tile");
// Below this many multiply-adds (S^2 B N d) a call runs on one thread: fork/join would cost more than it saves.
constexpr int64_t kParallelWork = int64_t{1} << 18;

CBLAS_TRANSPOSE blas_op(const bool transpose) { return transpose ? CblasTrans : CblasNoTrans; }

// Row-major C = alpha op(A) op(B) + beta C.
void gemm_rm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
             const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  sgemm(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}
void gemm_rm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, double alpha, const double* A, int64_t lda,
             const double* B, int64_t ldb, double beta, double* C, int64_t ldc) {
  cblas_dgemm(CblasRowMajor, blas_op(trans_a), blas_op(trans_b), static_cast<blasint>(M), static_cast<blasint>(N),
              static_cast<blasint>(K), alpha, A, static_cast<blasint>(lda), B, static_cast<blasint>(ldb), beta, C,
              static_cast<blasint>(ldc));
}

// exp for the softmax loops: the vectorisable float one, libm's in double (the tests' precise path).
inline float exp_of(const float x) { return fast_exp(x); }
inline double exp_of(const double x) { return std::exp(x); }

// True for causal self-attention over one whole sequence: no indices, no documents, Sk = S, dropout length S.
bool is_plain(const AttentionDims& dims) {
  return (dims.Sk == 0 || dims.Sk == dims.S) && dims.q_index == nullptr && dims.k_index == nullptr &&
         dims.q_document_SB == nullptr && (dims.dropout_seq_len == 0 || dims.dropout_seq_len == dims.S);
}

// The general path's indices and documents for one call: identity indices where the caller gave none, documents
// transposed to [B, S] / [B, Sk] so that a tile's keys are contiguous, and for every key row the end of its run of
// consecutive key indices (the dropout counters of such a run are consecutive).
struct BlockLayout {
  explicit BlockLayout(const AttentionDims& dims) {
    if (is_plain(dims)) return;
    const int64_t S = dims.S, Sk = detail::key_rows(dims), B = dims.B;
    auto identity = [](std::vector<int64_t>& v, const int64_t n) {
      v.resize(static_cast<size_t>(n));
      for (int64_t r = 0; r < n; ++r) v[static_cast<size_t>(r)] = r;
      return v.data();
    };
    q_index = dims.q_index != nullptr ? dims.q_index : identity(q_identity, S);
    k_index = dims.k_index != nullptr ? dims.k_index : identity(k_identity, Sk);
    k_runs.resize(static_cast<size_t>(Sk));
    for (int64_t j = Sk - 1; j >= 0; --j) {
      const bool continues = j + 1 < Sk && k_index[j + 1] == k_index[j] + 1;
      k_runs[static_cast<size_t>(j)] = continues ? k_runs[static_cast<size_t>(j + 1)] : j + 1;
    }
    k_run_end = k_runs.data();
    if (dims.q_document_SB == nullptr) return;
    auto transpose = [B](std::vector<int32_t>& out_BR, const int32_t* doc_RB, const int64_t R) {
      out_BR.resize(static_cast<size_t>(R * B));
      for (int64_t r = 0; r < R; ++r) {
        for (int64_t b = 0; b < B; ++b) out_BR[static_cast<size_t>(b * R + r)] = doc_RB[r * B + b];
      }
      return out_BR.data();
    };
    q_doc_BS = transpose(q_docs, dims.q_document_SB, S);
    k_doc_BS = transpose(k_docs, dims.k_document_SB, Sk);
  }
  const int64_t* q_index = nullptr;  // all null on the plain path
  const int64_t* k_index = nullptr;
  const int32_t* q_doc_BS = nullptr;  // null without documents
  const int32_t* k_doc_BS = nullptr;
  const int64_t* k_run_end = nullptr;  // [Sk]: keys [j, k_run_end[j]) have consecutive indices

 private:
  std::vector<int64_t> q_identity, k_identity, k_runs;
  std::vector<int32_t> q_docs, k_docs;
};

struct Bf16KeyValues;

// Strides and offsets of the [S, B, N, d] / [Sk, B, G, d] layouts (q, k; out and v have dv channels), the blocking,
// and the general path's indices.
struct Geometry {
  Geometry(const AttentionDims& dims, const BlockLayout& layout)
      : S(dims.S),
        Sk(detail::key_rows(dims)),
        B(dims.B),
        N(dims.N),
        G(dims.G),
        d(dims.head_dim),
        dv(detail::value_dim(dims)),
        heads_per_group(dims.N / dims.G),
        ld_q(dims.B * dims.N * dims.head_dim),
        ld_kv(dims.B * dims.G * dims.head_dim),
        ld_v(dims.B * dims.G * dv),
        block_rows(std::clamp<int64_t>(std::bit_floor(static_cast<uint64_t>(kPackedRows / heads_per_group)),
                                       kMinBlockRows, kMaxBlockRows)),
        diagonal_tile(std::min(block_rows, kDiagonalTile)),
        packed_rows(block_rows * heads_per_group),
        dropout_heads(dims.dropout_total_heads > 0 ? dims.dropout_total_heads : dims.N),
        dropout_head_offset(dims.dropout_head_offset),
        dropout_len(detail::dropout_seq_len(dims)),
        general(!is_plain(dims)),
        q_index(layout.q_index),
        k_index(layout.k_index),
        q_doc_BS(layout.q_doc_BS),
        k_doc_BS(layout.k_doc_BS),
        k_run_end(layout.k_run_end),
        bf16_products(dims.bf16_products),
        bf16_unit(best_bf16_product_unit()) {}
  int64_t q_offset(int64_t i, int64_t b, int64_t h) const { return ((i * B + b) * N + h) * d; }
  int64_t kv_offset(int64_t j, int64_t b, int64_t g) const { return ((j * B + b) * G + g) * d; }
  int64_t out_offset(int64_t i, int64_t b, int64_t h) const { return ((i * B + b) * N + h) * dv; }  // out, dout
  int64_t v_offset(int64_t j, int64_t b, int64_t g) const { return ((j * B + b) * G + g) * dv; }    // v, dv
  int64_t row_offset(int64_t b, int64_t h) const { return (b * N + h) * S; }                        // into lse_BNS
  int64_t n_query_blocks() const { return (S + block_rows - 1) / block_rows; }
  bool parallel() const { return S * Sk * B * N * (d + dv) / 2 > kParallelWork; }
  int64_t q_pos(int64_t i) const { return general ? q_index[i] : i; }
  // Key row j (general path) is visible to query row i of batch row b.
  bool sees(int64_t b, int64_t i, int64_t j) const {
    return k_index[j] <= q_index[i] && (q_doc_BS == nullptr || q_doc_BS[b * S + i] == k_doc_BS[b * Sk + j]);
  }
  // RNG counter of probability (i, key index 0) of head h: the one-process head index under tensor parallelism,
  // the query's index in the whole sequence under context parallelism.
  uint64_t dropout_row_counter(int64_t b, int64_t h, int64_t i) const {
    return (static_cast<uint64_t>((b * dropout_heads + dropout_head_offset + h) * dropout_len) +
            static_cast<uint64_t>(q_pos(i))) *
           static_cast<uint64_t>(dropout_len);
  }

  int64_t S, Sk, B, N, G, d, dv, heads_per_group, ld_q, ld_kv, ld_v, block_rows, diagonal_tile, packed_rows,
      dropout_heads, dropout_head_offset, dropout_len;
  bool general;  // block attention: the masks come from q_index, k_index and the documents
  const int64_t *q_index, *k_index;
  const int32_t *q_doc_BS, *k_doc_BS;
  const int64_t* k_run_end;
  bool bf16_products;  // AttentionDims::bf16_products
  Bf16ProductUnit bf16_unit;
  const Bf16KeyValues* bf16_kv = nullptr;  // fp32 kernels with bf16 products: the call's packed k and v
};

// A tile product: gemm_rm, or with bf16 products gemm_bf16 (fp32; in fp64, the test precision, the operands
// rounded to bf16 values and multiplied in double).
void product(const Geometry& geo, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
             const float* A, int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  if (!geo.bf16_products) return gemm_rm(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
  gemm_bf16(geo.bf16_unit, trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}
void product(const Geometry& geo, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, double alpha,
             const double* A, int64_t lda, const double* B, int64_t ldb, double beta, double* C, int64_t ldc) {
  if (!geo.bf16_products) return gemm_rm(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
  thread_local std::vector<double> a, b;
  auto round_copy = [](std::vector<double>& out, const double* x, const int64_t rows, const int64_t cols,
                       const int64_t ld) {
    out.resize(static_cast<size_t>(rows * cols));
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < cols; ++c) {
        out[static_cast<size_t>(r * cols + c)] = bf16_to_fp32(fp32_to_bf16(static_cast<float>(x[r * ld + c])));
      }
    }
  };
  const int64_t a_cols = trans_a ? M : K, b_cols = trans_b ? K : N;
  round_copy(a, A, trans_a ? K : M, a_cols, lda);
  round_copy(b, B, trans_b ? N : K, b_cols, ldb);
  gemm_rm(trans_a, trans_b, M, N, K, alpha, a.data(), a_cols, b.data(), b_cols, beta, C, ldc);
}

// The operands of the bf16 products of one thread (fp32 kernels): the block's rows packed once per block, each key
// tile's and each probability / gradient tile's once per product.
struct Bf16Operands {
  Bf16Panel q_a, dout_a, q_b, dout_b;  // the block's q and dout as A operands, and as B operands (dK, dV)
  Bf16Panel keys, values;              // a tile's k, v (B of dS k, P v) where Bf16KeyValues' do not fit
  Bf16Panel tile_a, tile_t;            // P or dS as an A operand, P^T or dS^T
  // dK, dV of the keys [acc_k0, acc_k1) of the task's (b, group), contiguous: summed here over the task's tiles and
  // added to the gradients once (flush_key_grads), instead of tile by tile into their [Sk, B, G, d] rows.
  // A key's first tile stores its rows (beta 0), later ones add: no zero-fill of the whole range. acc_written marks
  // the rows stored so far; rows never written have no tile and add nothing.
  std::vector<float> dk_acc, dv_acc;
  std::vector<uint8_t> acc_written;
  int64_t acc_k0 = 0, acc_k1 = 0;
};
Bf16Operands& bf16_operands() {
  thread_local Bf16Operands operands;
  return operands;
}
// The keys and values of every (b, kv group) packed once per call for the bf16 products: k^T and v^T as the B
// operands of q k^T and dout v^T (a tile is a range of columns), k and v as those of dS k and P v (a range of rows,
// used where the tile starts on a 32-key step: other tiles pack their own).
struct Bf16KeyValues {
  // Parallel over 32-key slices, each slice for every (b, group) in turn: the slice's rows of k and v are
  // contiguous in [Sk, B, G, d], so they stream through the cache once.
  void pack(const Geometry& geo, const float* k_SBGd, const float* v_SBGd, const bool backward) {
    const int64_t n_pairs = geo.B * geo.G, n_slices = (geo.Sk + 31) / 32;
    for (auto* panels : {&keys_t, &values_t, &keys, &values}) {
      if (panels->size() < static_cast<size_t>(n_pairs)) panels->resize(static_cast<size_t>(n_pairs));
    }
    for (int64_t bg = 0; bg < n_pairs; ++bg) {
      const auto at = static_cast<size_t>(bg);
      keys_t[at].shape_b(geo.bf16_unit, geo.d, geo.Sk);
      if (backward) {
        values_t[at].shape_b(geo.bf16_unit, geo.dv, geo.Sk);
        keys[at].shape_b(geo.bf16_unit, geo.Sk, geo.d);
      } else {
        values[at].shape_b(geo.bf16_unit, geo.Sk, geo.dv);
      }
    }
#pragma omp parallel for schedule(static) if (geo.parallel())
    for (int64_t task = 0; task < n_slices * n_pairs; ++task) {
      const int64_t bg = task % n_pairs, r0 = task / n_pairs * 32, r1 = std::min(r0 + 32, geo.Sk);
      const auto at = static_cast<size_t>(bg);
      const float* k = k_SBGd + geo.kv_offset(0, bg / geo.G, bg % geo.G);
      const float* v = v_SBGd + geo.v_offset(0, bg / geo.G, bg % geo.G);
      keys_t[at].pack_b_slice(true, k, geo.ld_kv, r0, r1);
      if (backward) {
        values_t[at].pack_b_slice(true, v, geo.ld_v, r0, r1);
        keys[at].pack_b_slice(false, k, geo.ld_kv, r0, r1);
      } else {
        values[at].pack_b_slice(false, v, geo.ld_v, r0, r1);
      }
    }
  }
  std::vector<Bf16Panel> keys_t, values_t, keys, values;  // [B * G]
};

// Whether a tile's products run on packed bf16 operands: fp32 kernels with AttentionDims::bf16_products (fp64 ones
// emulate them in product()).
template <typename T>
bool packed_bf16(const Geometry& geo) {
  return std::is_same_v<T, float> && geo.bf16_products;
}

constexpr uint32_t kPhiloxMul0 = 0xD2511F53u, kPhiloxMul1 = 0xCD9E8D57u;
constexpr uint32_t kPhiloxWeyl0 = 0x9E3779B9u, kPhiloxWeyl1 = 0xBB67AE85u;

// The dropout mask of one call: probability (b, h, i, j) is kept iff CounterRng(seed, key).uniform(counter) >= p,
// counter = dropout_row_counter(b, h, i) + j (attention.h). CounterRng::uniform (tensor/rng.cpp) is
// (word >> 8) * 2^-24 for the first word of Philox-4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1,
// 2, 3", 2011) of counter (lo, hi) under key (key_lo, key_hi) and round keys from (seed_lo, seed_hi); philox_words
// below computes the words of a run of counters, many lanes at a time.
struct MaskStream {
  explicit MaskStream(const DropoutSpec& spec)
      : active(spec.p > 0.0f),
        p(spec.p),
        keep_scale(1.0 / (1.0 - static_cast<double>(spec.p))),
        seed_lo(static_cast<uint32_t>(spec.seed)),
        seed_hi(static_cast<uint32_t>(spec.seed >> 32)),
        key_lo(static_cast<uint32_t>(spec.key)),
        key_hi(static_cast<uint32_t>(spec.key >> 32)) {}
  // The Philox word of one counter.
  uint32_t word(const uint64_t counter) const {
    uint32_t c0 = static_cast<uint32_t>(counter), c1 = static_cast<uint32_t>(counter >> 32), c2 = key_lo, c3 = key_hi;
    uint32_t k0 = seed_lo, k1 = seed_hi;
    for (int round = 0; round < 10; ++round) {
      const uint64_t p0 = uint64_t{kPhiloxMul0} * c0, p1 = uint64_t{kPhiloxMul1} * c2;
      c0 = static_cast<uint32_t>(p1 >> 32) ^ c1 ^ k0;
      c1 = static_cast<uint32_t>(p1);
      c2 = static_cast<uint32_t>(p0 >> 32) ^ c3 ^ k1;
      c3 = static_cast<uint32_t>(p0);
      k0 += kPhiloxWeyl0;
      k1 += kPhiloxWeyl1;
    }
    return c0;
  }
  // The decision for a word, in plain arithmetic (the loops applying the mask vectorise).
  bool kept(const uint32_t philox_word) const {
    return static_cast<float>(static_cast<int32_t>(philox_word >> 8)) * 0x1p-24f >= p;
  }

  bool active;
  float p;
  double keep_scale;
  uint32_t seed_lo, seed_hi, key_lo, key_hi;
};

void philox_words_scalar(uint32_t* words, const uint64_t first, const int64_t n, const MaskStream& mask) {
  for (int64_t c = 0; c < n; ++c) words[c] = mask.word(first + static_cast<uint64_t>(c));
}

#if defined(__x86_64__) && defined(__GNUC__)
// 16 and 8 counters at a time. The 32 x 32 -> 64-bit products are even / odd lane vpmuludq: compilers left to
// themselves widen them to far slower 64 x 64-bit multiplies. Lane c holds counter first + c: its low word
// first_lo + c (mod 2^32), its high word first_hi plus the carry out of that sum.
#define MOECORE_PHILOX_X86 1
// GCC 12's AVX-512 intrinsics pass _mm512_undefined_epi32() as the unused merge source, which -Wmaybe-uninitialized
// reports (GCC bug 105593, fixed in GCC 13).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
__attribute__((target("avx512f"))) void philox_words_avx512(uint32_t* words, const uint64_t first, const int64_t n,
                                                            const MaskStream& mask) {
  const auto first_lo = static_cast<uint32_t>(first), first_hi = static_cast<uint32_t>(first >> 32);
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i mul0 = _mm512_set1_epi64(kPhiloxMul0), mul1 = _mm512_set1_epi64(kPhiloxMul1);
  int64_t c = 0;
  for (; c + 16 <= n; c += 16) {
    __m512i c0 = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(first_lo + static_cast<uint32_t>(c))), lane);
    const __mmask16 carry = _mm512_cmplt_epu32_mask(c0, _mm512_set1_epi32(static_cast<int>(first_lo)));
    const __m512i high = _mm512_set1_epi32(static_cast<int>(first_hi));
    __m512i c1 = _mm512_mask_add_epi32(high, carry, high, _mm512_set1_epi32(1));
    __m512i c2 = _mm512_set1_epi32(static_cast<int>(mask.key_lo)),
            c3 = _mm512_set1_epi32(static_cast<int>(mask.key_hi));
    uint32_t k0 = mask.seed_lo, k1 = mask.seed_hi;
    for (int round = 0; round < 10; ++round) {
      const __m512i even0 = _mm512_mul_epu32(c0, mul0), odd0 = _mm512_mul_epu32(_mm512_srli_epi64(c0, 32), mul0);
      const __m512i even1 = _mm512_mul_epu32(c2, mul1), odd1 = _mm512_mul_epu32(_mm512_srli_epi64(c2, 32), mul1);
      const __m512i lo0 = _mm512_mask_blend_epi32(0xAAAA, even0, _mm512_slli_epi64(odd0, 32));
      const __m512i hi0 = _mm512_mask_blend_epi32(0xAAAA, _mm512_srli_epi64(even0, 32), odd0);
      const __m512i lo1 = _mm512_mask_blend_epi32(0xAAAA, even1, _mm512_slli_epi64(odd1, 32));
      const __m512i hi1 = _mm512_mask_blend_epi32(0xAAAA, _mm512_srli_epi64(even1, 32), odd1);
      c0 = _mm512_xor_si512(_mm512_xor_si512(hi1, c1), _mm512_set1_epi32(static_cast<int>(k0)));
      c1 = lo1;
      c2 = _mm512_xor_si512(_mm512_xor_si512(hi0, c3), _mm512_set1_epi32(static_cast<int>(k1)));
      c3 = lo0;
      k0 += kPhiloxWeyl0;
      k1 += kPhiloxWeyl1;
    }
    _mm512_storeu_si512(words + c, c0);
  }
  philox_words_scalar(words + c, first + static_cast<uint64_t>(c), n - c, mask);
}
#pragma GCC diagnostic pop

__attribute__((target("avx2"))) void philox_words_avx2(uint32_t* words, const uint64_t first, const int64_t n,
                                                       const MaskStream& mask) {
  const auto first_lo = static_cast<uint32_t>(first), first_hi = static_cast<uint32_t>(first >> 32);
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i mul0 = _mm256_set1_epi64x(kPhiloxMul0), mul1 = _mm256_set1_epi64x(kPhiloxMul1);
  const __m256i sign = _mm256_set1_epi32(std::numeric_limits<int32_t>::min());  // unsigned compare via signed
  int64_t c = 0;
  for (; c + 8 <= n; c += 8) {
    __m256i c0 = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(first_lo + static_cast<uint32_t>(c))), lane);
    const __m256i carry = _mm256_cmpgt_epi32(_mm256_xor_si256(_mm256_set1_epi32(static_cast<int>(first_lo)), sign),
                                             _mm256_xor_si256(c0, sign));  // -1 where the low word wrapped
    __m256i c1 = _mm256_sub_epi32(_mm256_set1_epi32(static_cast<int>(first_hi)), carry);
    __m256i c2 = _mm256_set1_epi32(static_cast<int>(mask.key_lo)),
            c3 = _mm256_set1_epi32(static_cast<int>(mask.key_hi));
    uint32_t k0 = mask.seed_lo, k1 = mask.seed_hi;
    for (int round = 0; round < 10; ++round) {
      const __m256i even0 = _mm256_mul_epu32(c0, mul0), odd0 = _mm256_mul_epu32(_mm256_srli_epi64(c0, 32), mul0);
      const __m256i even1 = _mm256_mul_epu32(c2, mul1), odd1 = _mm256_mul_epu32(_mm256_srli_epi64(c2, 32), mul1);
      const __m256i lo0 = _mm256_blend_epi32(even0, _mm256_slli_epi64(odd0, 32), 0xAA);
      const __m256i hi0 = _mm256_blend_epi32(_mm256_srli_epi64(even0, 32), odd0, 0xAA);
      const __m256i lo1 = _mm256_blend_epi32(even1, _mm256_slli_epi64(odd1, 32), 0xAA);
      const __m256i hi1 = _mm256_blend_epi32(_mm256_srli_epi64(even1, 32), odd1, 0xAA);
      c0 = _mm256_xor_si256(_mm256_xor_si256(hi1, c1), _mm256_set1_epi32(static_cast<int>(k0)));
      c1 = lo1;
      c2 = _mm256_xor_si256(_mm256_xor_si256(hi0, c3), _mm256_set1_epi32(static_cast<int>(k1)));
      c3 = lo0;
      k0 += kPhiloxWeyl0;
      k1 += kPhiloxWeyl1;
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(words + c), c0);
  }
  philox_words_scalar(words + c, first + static_cast<uint64_t>(c), n - c, mask);
}
#endif

// words[c] = the Philox word of counter first + c, c < n, with the widest vector unit this CPU has.
void philox_words(uint32_t* words, const uint64_t first, const int64_t n, const MaskStream& mask) {
#if defined(MOECORE_PHILOX_X86)
  static const int isa = __builtin_cpu_supports("avx512f") ? 2 : (__builtin_cpu_supports("avx2") ? 1 : 0);
  if (isa == 2) return philox_words_avx512(words, first, n, mask);
  if (isa == 1) return philox_words_avx2(words, first, n, mask);
#endif
  philox_words_scalar(words, first, n, mask);
}

// The words of the dropout counters of query row i's keys [j0, j0 + cols), row_counter = dropout_row_counter(b, h,
// i): on the general path key c has counter row_counter + k_index[j0 + c], drawn run by run of consecutive indices.
void tile_words(uint32_t* words, const Geometry& geo, const uint64_t row_counter, const int64_t j0, const int64_t cols,
                const MaskStream& mask) {
  if (!geo.general) return philox_words(words, row_counter + static_cast<uint64_t>(j0), cols, mask);
  for (int64_t c = 0; c < cols;) {
    const int64_t end = std::min(cols, geo.k_run_end[j0 + c] - j0);
    philox_words(words + c, row_counter + static_cast<uint64_t>(geo.k_index[j0 + c]), end - c, mask);
    c = end;
  }
}

// The packed rows of a query block [i0, i1) of kv group (b, g): row r * heads_per_group + hh is query row i0 + r of
// head g * heads_per_group + hh, so all rows of one query position are adjacent and share the causal limit. On the
// general path the block also knows the range of its rows' indices and documents.
struct Block {
  Block(const Geometry& geo, int64_t batch, int64_t group, int64_t first_query)
      : b(batch),
        g(group),
        h0(group * geo.heads_per_group),
        hpg(geo.heads_per_group),
        i0(first_query),
        i1(std::min(geo.S, first_query + geo.block_rows)),
        rows((i1 - i0) * hpg) {
    if (!geo.general) return;
    for (int64_t i = i0; i < i1; ++i) {
      q_min = std::min(q_min, geo.q_index[i]);
      q_max = std::max(q_max, geo.q_index[i]);
      if (geo.q_doc_BS == nullptr) continue;
      doc_min = std::min(doc_min, geo.q_doc_BS[b * geo.S + i]);
      doc_max = std::max(doc_max, geo.q_doc_BS[b * geo.S + i]);
    }
  }
  int64_t query(int64_t p) const { return i0 + p / hpg; }  // query position of packed row p
  int64_t head(int64_t p) const { return h0 + p % hpg; }
  // How many of the keys [j0, j0 + cols) packed row p sees (a prefix; plain path).
  int64_t visible(int64_t p, int64_t j0, int64_t cols) const { return std::clamp<int64_t>(query(p) + 1 - j0, 0, cols); }

  int64_t b, g, h0, hpg, i0, i1, rows;
  int64_t q_min = std::numeric_limits<int64_t>::max(), q_max = std::numeric_limits<int64_t>::min();
  int32_t doc_min = std::numeric_limits<int32_t>::max(), doc_max = std::numeric_limits<int32_t>::min();
};

// How a tile's scores are masked: the plain path's causal prefix of each row, none (every row sees every key), or
// key by key from the indices and documents (general path).
enum class TileMask : uint8_t { kCausalPrefix, kNone, kPerKey };

// Keys [j0, j0 + cols) against the block's packed rows [p0, rows): the rows before p0 see none of these keys.
struct KeyTile {
  int64_t j0, cols, p0;
  TileMask mask = TileMask::kCausalPrefix;
};

// Sets the scores of the keys packed row p does not see to -inf (row: the tile's cols scores of that row).
template <typename T>
inline void mask_scores(T* row, const Geometry& geo, const Block& blk, const KeyTile& tile, const int64_t p) {
  constexpr T kMinusInf = -std::numeric_limits<T>::infinity();
  if (tile.mask == TileMask::kCausalPrefix) {
    std::fill(row + blk.visible(p, tile.j0, tile.cols), row + tile.cols, kMinusInf);
  } else if (tile.mask == TileMask::kPerKey) {
    const int64_t i = blk.query(p), qi = geo.q_index[i], cols = tile.cols;
    const int64_t* k = geo.k_index + tile.j0;
    if (geo.q_doc_BS == nullptr) {
#pragma omp simd
      for (int64_t c = 0; c < cols; ++c) row[c] = k[c] <= qi ? row[c] : kMinusInf;
    } else {
      const int32_t doc = geo.q_doc_BS[blk.b * geo.S + i];
      const int32_t* k_doc = geo.k_doc_BS + blk.b * geo.Sk + tile.j0;
#pragma omp simd
      for (int64_t c = 0; c < cols; ++c) row[c] = k[c] <= qi && k_doc[c] == doc ? row[c] : kMinusInf;
    }
  }
}

// The key tiles of a block on the plain path, in the order every schedule visits them: keys [0, i0 + diagonal_tile)
// in tiles of `tile` keys aligned to multiples of `tile` (all rows), then the rest of the block's own keys in tiles
// of diagonal_tile keys, each against the rows from the first query that sees it, so that only about
// block_rows * diagonal_tile / 2 masked scores per block are computed. block_rows (a power of two) divides `tile`,
// so every tile lies inside one `tile`-aligned key range.
template <typename F>
void for_each_plain_key_tile(const Geometry& geo, const Block& blk, int64_t tile, F&& visit) {
  const int64_t full_end = std::min(blk.i1, blk.i0 + geo.diagonal_tile);
  for (int64_t j0 = 0; j0 < full_end; j0 += tile) visit(KeyTile{j0, std::min(tile, full_end - j0), 0});
  for (int64_t j0 = full_end; j0 < blk.i1; j0 += geo.diagonal_tile) {
    visit(KeyTile{j0, std::min(geo.diagonal_tile, blk.i1 - j0), (j0 - blk.i0) * blk.hpg});
  }
}

// Key row j against a block (general path), from the block's index and document ranges: seen by none of its rows,
// by all, or maybe by some.
enum class KeyClass : uint8_t { kHidden, kSeenByAll, kSeenBySome };

KeyClass classify_key(const Geometry& geo, const Block& blk, const int64_t j) {
  const int64_t index = geo.k_index[j];
  if (index > blk.q_max) return KeyClass::kHidden;
  const bool one_document = geo.k_doc_BS == nullptr || blk.doc_min == blk.doc_max;
  if (geo.k_doc_BS != nullptr) {
    const int32_t doc = geo.k_doc_BS[blk.b * geo.Sk + j];
    if (doc < blk.doc_min || doc > blk.doc_max) return KeyClass::kHidden;
  }
  return index <= blk.q_min && one_document ? KeyClass::kSeenByAll : KeyClass::kSeenBySome;
}

// The first packed row of the block that sees any of keys [j0, j0 + cols), or blk.rows if none does.
int64_t first_row_seeing(const Geometry& geo, const Block& blk, const int64_t j0, const int64_t cols) {
  for (int64_t i = blk.i0; i < blk.i1; ++i) {
    for (int64_t j = j0; j < j0 + cols; ++j) {
      if (geo.sees(blk.b, i, j)) return (i - blk.i0) * blk.hpg;
    }
  }
  return blk.rows;
}

// The key tiles of a block on the general path within keys [k_begin, k_end) (k_begin a multiple of `tile`), in the
// order every schedule visits them: per `tile`-aligned key range, runs of keys of one class in key order; a run
// seen by all rows is one unmasked tile, a run seen by some is cut in tiles of diagonal_tile keys masked key by key
// from the first row that sees any (tiles no row sees are dropped), hidden runs are skipped.
template <typename F>
void for_each_general_key_tile(const Geometry& geo, const Block& blk, int64_t tile, int64_t k_begin, int64_t k_end,
                               F&& visit) {
  for (int64_t range = k_begin; range < k_end; range += tile) {
    const int64_t range_end = std::min(range + tile, k_end);
    for (int64_t j = range; j < range_end;) {
      const KeyClass kind = classify_key(geo, blk, j);
      int64_t run_end = j + 1;
      while (run_end < range_end && classify_key(geo, blk, run_end) == kind) ++run_end;
      if (kind == KeyClass::kSeenByAll) {
        visit(KeyTile{j, run_end - j, 0, TileMask::kNone});
      } else if (kind == KeyClass::kSeenBySome) {
        for (int64_t j0 = j; j0 < run_end; j0 += geo.diagonal_tile) {
          const int64_t cols = std::min(geo.diagonal_tile, run_end - j0);
          const int64_t p0 = first_row_seeing(geo, blk, j0, cols);
          if (p0 < blk.rows) visit(KeyTile{j0, cols, p0, TileMask::kPerKey});
        }
      }
      j = run_end;
    }
  }
}

template <typename F>
void for_each_key_tile(const Geometry& geo, const Block& blk, int64_t tile, F&& visit) {
  if (geo.general) {
    for_each_general_key_tile(geo, blk, tile, 0, geo.Sk, visit);
  } else {
    for_each_plain_key_tile(geo, blk, tile, visit);
  }
}

// Copies the block's rows of a [S, B, N, width] tensor into x_Md ([block.rows, width]): each query position's heads
// of the group are one contiguous run of hpg * width values.
template <typename T>
void pack_rows(T* x_Md, const T* x_SBNd, const int64_t width, const Geometry& geo, const Block& blk) {
  const int64_t run = blk.hpg * width;
  for (int64_t i = blk.i0; i < blk.i1; ++i) {
    std::memcpy(x_Md + (i - blk.i0) * run, x_SBNd + ((i * geo.B + blk.b) * geo.N + blk.h0) * width, sizeof(T) * run);
  }
}

// Per-thread scratch: `per_thread` values for each thread, not initialised.
template <typename T>
class Scratch {
 public:
  explicit Scratch(int64_t per_thread)
      : per_thread_(per_thread), buf_(std::make_unique_for_overwrite<T[]>(per_thread * omp_get_max_threads())) {}
  T* mine() { return buf_.get() + omp_get_thread_num() * per_thread_; }

 private:
  int64_t per_thread_;
  std::unique_ptr<T[]> buf_;
};

// ---------------------------------------------------------------------------------------------------------------
// Forward

// One key tile for the packed rows of a block. In: s_MC = scaled scores (rows [p0, rows), ld cols), m_M, l_M = the
// running max and sum of exp(s - m) over the keys so far (-inf, 0 before the first tile), o_Md = the output
// accumulator sum of exp(s - m) (dropped) v. Out: s_MC = exp(s - m_new), 0 where masked or dropped; m, l updated;
// o_Md rows rescaled by exp(m_old - m_new) unless this is the first tile (o not yet written). Masked scores become
// -inf (exp gives 0), so every row runs the same full-width loops. On the general path o starts at zero and a row
// may see no key of a tile (row_max stays -inf: its exponentials are 0, m and l unchanged).
template <typename T>
MOECORE_VECTOR_CLONES void forward_tile(T* s_MC, T* m_M, T* l_M, T* o_Md, const Geometry& geo, const Block& blk,
                                        const KeyTile& tile, const MaskStream& mask, uint16_t* p_bits = nullptr,
                                        const int64_t ld_bits = 0) {
  const int64_t j0 = tile.j0, cols = tile.cols;
  for (int64_t p = tile.p0; p < blk.rows; ++p) {
    T* row = s_MC + p * cols;
    uint16_t* bits_row = p_bits == nullptr ? nullptr : p_bits + (p - tile.p0) * ld_bits;
    mask_scores(row, geo, blk, tile, p);
    T row_max = m_M[p];
#pragma omp simd reduction(max : row_max)
    for (int64_t c = 0; c < cols; ++c) row_max = row[c] > row_max ? row[c] : row_max;
    if (row_max == -std::numeric_limits<T>::infinity()) {
      std::fill(row, row + cols, T(0));
      if (bits_row != nullptr) std::fill(bits_row, bits_row + cols, uint16_t{0});
      continue;
    }
    T sum = 0;
#pragma omp simd reduction(+ : sum)
    for (int64_t c = 0; c < cols; ++c) {
      const T e = exp_of(row[c] - row_max);
      sum += e;
      row[c] = e;
    }
    if (mask.active) {
      uint32_t words[kKeyTileForward];
      tile_words(words, geo, geo.dropout_row_counter(blk.b, blk.head(p), blk.query(p)), j0, cols, mask);
#pragma omp simd
      for (int64_t c = 0; c < cols; ++c) row[c] = mask.kept(words[c]) ? row[c] : T(0);
    }
    if (bits_row != nullptr) {  // the bf16 operand of P v, rounded while the row is in cache
#pragma omp simd
      for (int64_t c = 0; c < cols; ++c) bits_row[c] = bf16_bits(static_cast<float>(row[c]));
    }
    if ((j0 > 0 || geo.general) && row_max != m_M[p]) {
      const T rescale = exp_of(m_M[p] - row_max);
      T* o_row = o_Md + p * geo.dv;
      for (int64_t c = 0; c < geo.dv; ++c) o_row[c] *= rescale;
      l_M[p] = l_M[p] * rescale + sum;
    } else {
      l_M[p] += sum;
    }
    m_M[p] = row_max;
  }
}

// out = o / l (times 1 / (1 - p) under dropout), lse = m + log(l), into the [S, B, N, dv] and [B, N, S] outputs; a
// row that saw no key (l = 0, general path only) gets out = 0, lse = -inf.
template <typename T>
MOECORE_VECTOR_CLONES void forward_finish(T* out_SBNd, T* lse_BNS, const T* o_Md, const T* m_M, const T* l_M,
                                          const Geometry& geo, const Block& blk, const MaskStream& mask) {
  for (int64_t p = 0; p < blk.rows; ++p) {
    if (l_M[p] == T(0)) {
      std::fill_n(out_SBNd + geo.out_offset(blk.query(p), blk.b, blk.head(p)), geo.dv, T(0));
      lse_BNS[geo.row_offset(blk.b, blk.head(p)) + blk.query(p)] = -std::numeric_limits<T>::infinity();
      continue;
    }
    const T inv = static_cast<T>(mask.keep_scale / static_cast<double>(l_M[p]));
    const T* o_row = o_Md + p * geo.dv;
    T* out_row = out_SBNd + geo.out_offset(blk.query(p), blk.b, blk.head(p));
    for (int64_t c = 0; c < geo.dv; ++c) out_row[c] = o_row[c] * inv;
    lse_BNS[geo.row_offset(blk.b, blk.head(p)) + blk.query(p)] =
        static_cast<T>(static_cast<double>(m_M[p]) + std::log(static_cast<double>(l_M[p])));
  }
}

template <typename T>
struct ForwardScratch {
  static int64_t size(const Geometry& geo) { return geo.packed_rows * (geo.d + geo.dv + kKeyTileForward + 2); }
  ForwardScratch(T* base, const Geometry& geo)
      : q_Md(base),
        o_Md(q_Md + geo.packed_rows * geo.d),
        s_MC(o_Md + geo.packed_rows * geo.dv),
        m_M(s_MC + geo.packed_rows * kKeyTileForward),
        l_M(m_M + geo.packed_rows) {}
  T *q_Md, *o_Md, *s_MC, *m_M, *l_M;  // o_Md: [packed rows, dv]
};

// forward_block's tiles on packed bf16 operands (q_Md, m_M, l_M and o_Md set up by it).
void forward_block_bf16(float* out_SBNd, float* lse_BNS, const float* v_SBGd, const Geometry& geo, double scale,
                        const MaskStream& mask, const Block& blk, ForwardScratch<float>& sc) {
  Bf16Operands& x = bf16_operands();
  const Bf16ProductUnit unit = geo.bf16_unit;
  x.q_a.pack_a(unit, false, blk.rows, geo.d, sc.q_Md, geo.d);
  for_each_key_tile(geo, blk, kKeyTileForward, [&](const KeyTile& tile) {
    const int64_t rows = blk.rows - tile.p0, cols = tile.cols;
    float* s_MC = sc.s_MC + tile.p0 * cols;
    const auto bg = static_cast<size_t>(blk.b * geo.G + blk.g);
    gemm_bf16_packed(rows, cols, geo.d, static_cast<float>(scale), x.q_a, tile.p0, geo.bf16_kv->keys_t[bg], 0, tile.j0,
                     0.0f, s_MC, cols);
    if (unit != Bf16ProductUnit::kEmulated) {
      uint16_t* bits = x.tile_a.a_for_writing(unit, rows, cols);
      forward_tile(sc.s_MC, sc.m_M, sc.l_M, sc.o_Md, geo, blk, tile, mask, bits, x.tile_a.a_row_stride());
    } else {
      forward_tile(sc.s_MC, sc.m_M, sc.l_M, sc.o_Md, geo, blk, tile, mask);
      x.tile_a.pack_a(unit, false, rows, cols, s_MC, cols);
    }
    const float beta = tile.j0 == 0 && !geo.general ? 0.0f : 1.0f;
    if (tile.j0 % 32 == 0) {
      gemm_bf16_packed(rows, geo.dv, cols, 1.0f, x.tile_a, 0, geo.bf16_kv->values[bg], tile.j0, 0, beta,
                       sc.o_Md + tile.p0 * geo.dv, geo.dv);
    } else {
      x.values.pack_b(unit, false, cols, geo.dv, v_SBGd + geo.v_offset(tile.j0, blk.b, blk.g), geo.ld_v);
      gemm_bf16_packed(rows, geo.dv, cols, 1.0f, x.tile_a, 0, x.values, 0, 0, beta, sc.o_Md + tile.p0 * geo.dv, geo.dv);
    }
  });
  forward_finish(out_SBNd, lse_BNS, sc.o_Md, sc.m_M, sc.l_M, geo, blk, mask);
}

template <typename T>
void forward_block(T* out_SBNd, T* lse_BNS, const T* q_SBNd, const T* k_SBGd, const T* v_SBGd, const Geometry& geo,
                   double scale, const MaskStream& mask, const Block& blk, ForwardScratch<T>& sc) {
  pack_rows(sc.q_Md, q_SBNd, geo.d, geo, blk);
  std::fill(sc.m_M, sc.m_M + blk.rows, -std::numeric_limits<T>::infinity());
  std::fill(sc.l_M, sc.l_M + blk.rows, T(0));
  if (geo.general) std::fill(sc.o_Md, sc.o_Md + blk.rows * geo.dv, T(0));  // its first tile need not be key 0's
  if constexpr (std::is_same_v<T, float>) {
    if (geo.bf16_products) return forward_block_bf16(out_SBNd, lse_BNS, v_SBGd, geo, scale, mask, blk, sc);
  }
  for_each_key_tile(geo, blk, kKeyTileForward, [&](const KeyTile& tile) {
    const int64_t kv_off = geo.kv_offset(tile.j0, blk.b, blk.g), rows = blk.rows - tile.p0;
    T* s_MC = sc.s_MC + tile.p0 * tile.cols;
    product(geo, false, true, rows, tile.cols, geo.d, static_cast<T>(scale), sc.q_Md + tile.p0 * geo.d, geo.d,
            k_SBGd + kv_off, geo.ld_kv, T(0), s_MC, tile.cols);
    forward_tile(sc.s_MC, sc.m_M, sc.l_M, sc.o_Md, geo, blk, tile, mask);
    product(geo, false, false, rows, geo.dv, tile.cols, T(1), s_MC, tile.cols,
            v_SBGd + geo.v_offset(tile.j0, blk.b, blk.g), geo.ld_v, T(tile.j0 == 0 && !geo.general ? 0 : 1),
            sc.o_Md + tile.p0 * geo.dv, geo.dv);
  });
  forward_finish(out_SBNd, lse_BNS, sc.o_Md, sc.m_M, sc.l_M, geo, blk, mask);
}

// ---------------------------------------------------------------------------------------------------------------
// Backward

// Inputs of the backward shared by all tasks.
template <typename T>
struct BackwardInputs {
  const T *dout, *q, *k, *v, *lse, *delta;  // delta_BNS = rowsum(dout * out) = rowsum(dP * P)
  Geometry geo;
  double scale;
  MaskStream mask;
};

// For the packed rows [p0, rows) of a block and the tile's keys: in, pd_MC = scaled scores s and ds_MC = dPd =
// dout v^T; out (ld cols, zero where masked)
//   pd = P * mask / (1 - p)  (dropped probabilities, for dV)
//   ds = scale * P * (dPd * mask / (1 - p) - delta)  (gradient of the unscaled scores q k^T)
// with P = exp(s - lse), masked scores set to -inf first so that every row runs the same full-width loop. A row
// with lse = -inf saw no key at all (general path): zeros.
template <typename T>
MOECORE_VECTOR_CLONES void backward_tile(T* pd_MC, T* ds_MC, const T* lse_M, const T* delta_M,
                                         const BackwardInputs<T>& in, const Block& blk, const KeyTile& tile,
                                         uint16_t* ds_bits = nullptr, const int64_t ld_bits = 0) {
  const T scale = static_cast<T>(in.scale), keep_scale = static_cast<T>(in.mask.keep_scale);
  const int64_t j0 = tile.j0, cols = tile.cols;
  for (int64_t p = tile.p0; p < blk.rows; ++p) {
    T* pd_row = pd_MC + p * cols;
    T* ds_row = ds_MC + p * cols;
    uint16_t* bits_row = ds_bits == nullptr ? nullptr : ds_bits + (p - tile.p0) * ld_bits;
    const T lse = lse_M[p], delta = delta_M[p];
    if (lse == -std::numeric_limits<T>::infinity()) {
      std::fill(pd_row, pd_row + cols, T(0));
      std::fill(ds_row, ds_row + cols, T(0));
      if (bits_row != nullptr) std::fill(bits_row, bits_row + cols, uint16_t{0});
      continue;
    }
    mask_scores(pd_row, in.geo, blk, tile, p);
    if (in.mask.active) {
      uint32_t words[kKeyTileBackward];
      tile_words(words, in.geo, in.geo.dropout_row_counter(blk.b, blk.head(p), blk.query(p)), j0, cols, in.mask);
#pragma omp simd
      for (int64_t c = 0; c < cols; ++c) {
        const T prob = exp_of(pd_row[c] - lse);
        const T mult = in.mask.kept(words[c]) ? keep_scale : T(0);
        pd_row[c] = prob * mult;
        ds_row[c] = scale * prob * (ds_row[c] * mult - delta);
      }
    } else {
#pragma omp simd
      for (int64_t c = 0; c < cols; ++c) {
        const T prob = exp_of(pd_row[c] - lse);
        pd_row[c] = prob;
        ds_row[c] = scale * prob * (ds_row[c] - delta);
      }
    }
    if (bits_row != nullptr) {  // the bf16 operand of dS k, rounded while the row is in cache
#pragma omp simd
      for (int64_t c = 0; c < cols; ++c) bits_row[c] = bf16_bits(static_cast<float>(ds_row[c]));
    }
  }
}

template <typename T>
struct BackwardScratch {
  static int64_t size(const Geometry& geo) { return geo.packed_rows * (2 * geo.d + geo.dv + 2 * kKeyTileBackward + 2); }
  BackwardScratch(T* base, const Geometry& geo)
      : q_Md(base),
        dout_Md(q_Md + geo.packed_rows * geo.d),
        dq_Md(dout_Md + geo.packed_rows * geo.dv),
        pd_MC(dq_Md + geo.packed_rows * geo.d),
        ds_MC(pd_MC + geo.packed_rows * kKeyTileBackward),
        lse_M(ds_MC + geo.packed_rows * kKeyTileBackward),
        delta_M(lse_M + geo.packed_rows) {}
  T *q_Md, *dout_Md, *dq_Md, *pd_MC, *ds_MC, *lse_M, *delta_M;  // dout_Md: [packed rows, dv]
};

// Packs q, dout, lse and delta of a block (and zeroes its dq on the general path, where its first tile need not
// be key 0's).
template <typename T>
void load_block(BackwardScratch<T>& sc, const BackwardInputs<T>& in, const Block& blk) {
  pack_rows(sc.q_Md, in.q, in.geo.d, in.geo, blk);
  pack_rows(sc.dout_Md, in.dout, in.geo.dv, in.geo, blk);
  if (in.geo.general) std::fill(sc.dq_Md, sc.dq_Md + blk.rows * in.geo.d, T(0));
  for (int64_t p = 0; p < blk.rows; ++p) {
    const int64_t at = in.geo.row_offset(blk.b, blk.head(p)) + blk.query(p);
    sc.lse_M[p] = in.lse[at];
    sc.delta_M[p] = in.delta[at];
  }
  if constexpr (std::is_same_v<T, float>) {
    if (in.geo.bf16_products) {
      Bf16Operands& x = bf16_operands();
      const Bf16ProductUnit unit = in.geo.bf16_unit;
      x.q_a.pack_a(unit, false, blk.rows, in.geo.d, sc.q_Md, in.geo.d);
      x.dout_a.pack_a(unit, false, blk.rows, in.geo.dv, sc.dout_Md, in.geo.dv);
      x.q_b.pack_b(unit, false, blk.rows, in.geo.d, sc.q_Md, in.geo.d);
      x.dout_b.pack_b(unit, false, blk.rows, in.geo.dv, sc.dout_Md, in.geo.dv);
    }
  }
}

// The tile's scores and gradients (backward_tile) in pd_MC and ds_MC, rows [tile.p0, rows), ld tile.cols.
template <typename T>
void compute_tile(BackwardScratch<T>& sc, const BackwardInputs<T>& in, const Block& blk, const KeyTile& tile) {
  const Geometry& geo = in.geo;
  const int64_t kv_off = geo.kv_offset(tile.j0, blk.b, blk.g), rows = blk.rows - tile.p0;
  if constexpr (std::is_same_v<T, float>) {
    if (geo.bf16_products) {
      Bf16Operands& x = bf16_operands();
      const int64_t cols = tile.cols;
      const auto bg = static_cast<size_t>(blk.b * geo.G + blk.g);
      gemm_bf16_packed(rows, cols, geo.d, static_cast<float>(in.scale), x.q_a, tile.p0, geo.bf16_kv->keys_t[bg], 0,
                       tile.j0, 0.0f, sc.pd_MC + tile.p0 * cols, cols);
      gemm_bf16_packed(rows, cols, geo.dv, 1.0f, x.dout_a, tile.p0, geo.bf16_kv->values_t[bg], 0, tile.j0, 0.0f,
                       sc.ds_MC + tile.p0 * cols, cols);
      if (geo.bf16_unit == Bf16ProductUnit::kEmulated)
        return backward_tile(sc.pd_MC, sc.ds_MC, sc.lse_M, sc.delta_M, in, blk, tile);
      uint16_t* bits = x.tile_a.a_for_writing(geo.bf16_unit, rows, cols);  // dS as the A operand of accumulate_dq
      return backward_tile(sc.pd_MC, sc.ds_MC, sc.lse_M, sc.delta_M, in, blk, tile, bits, x.tile_a.a_row_stride());
    }
  }
  product(geo, false, true, rows, tile.cols, geo.d, static_cast<T>(in.scale), sc.q_Md + tile.p0 * geo.d, geo.d,
          in.k + kv_off, geo.ld_kv, T(0), sc.pd_MC + tile.p0 * tile.cols, tile.cols);
  product(geo, false, true, rows, tile.cols, geo.dv, T(1), sc.dout_Md + tile.p0 * geo.dv, geo.dv,
          in.v + geo.v_offset(tile.j0, blk.b, blk.g), geo.ld_v, T(0), sc.ds_MC + tile.p0 * tile.cols, tile.cols);
  backward_tile(sc.pd_MC, sc.ds_MC, sc.lse_M, sc.delta_M, in, blk, tile);
}

// dV[tile keys] += pd^T dout, dK[tile keys] += ds^T q.
template <typename T>
void accumulate_dk_dv(T* dk_SBGd, T* dv_SBGd, const BackwardScratch<T>& sc, const BackwardInputs<T>& in,
                      const Block& blk, const KeyTile& tile) {
  const Geometry& geo = in.geo;
  const int64_t kv_off = geo.kv_offset(tile.j0, blk.b, blk.g), rows = blk.rows - tile.p0;
  if constexpr (std::is_same_v<T, float>) {
    if (geo.bf16_products) {
      // The products sum over the packed rows from k0, p0 rounded down to the panels' 32-row steps; the rows below
      // p0 hold no values of this tile and read as 0.
      Bf16Operands& x = bf16_operands();
      const int64_t cols = tile.cols, k0 = tile.p0 / 32 * 32, depth = blk.rows - k0;
      const int64_t row = tile.j0 - x.acc_k0;
      uint8_t* written = x.acc_written.data() + row;
      const auto n_written = std::count(written, written + cols, uint8_t{1});
      if (n_written != 0 && n_written != cols) {  // mixed (general path): zero the new rows, then add to all
        for (int64_t r = 0; r < cols; ++r) {
          if (written[r] != 0) continue;
          std::fill_n(x.dk_acc.data() + (row + r) * geo.d, geo.d, 0.0f);
          std::fill_n(x.dv_acc.data() + (row + r) * geo.dv, geo.dv, 0.0f);
        }
      }
      const float beta = n_written == 0 ? 0.0f : 1.0f;
      std::fill_n(written, cols, uint8_t{1});
      x.tile_t.pack_a(geo.bf16_unit, true, cols, depth, sc.pd_MC + k0 * cols, cols, tile.p0 - k0);
      gemm_bf16_packed(cols, geo.dv, depth, 1.0f, x.tile_t, 0, x.dout_b, k0, 0, beta, x.dv_acc.data() + row * geo.dv,
                       geo.dv);
      x.tile_t.pack_a(geo.bf16_unit, true, cols, depth, sc.ds_MC + k0 * cols, cols, tile.p0 - k0);
      gemm_bf16_packed(cols, geo.d, depth, 1.0f, x.tile_t, 0, x.q_b, k0, 0, beta, x.dk_acc.data() + row * geo.d, geo.d);
      return;
    }
  }
  product(geo, true, false, tile.cols, geo.dv, rows, T(1), sc.pd_MC + tile.p0 * tile.cols, tile.cols,
          sc.dout_Md + tile.p0 * geo.dv, geo.dv, T(1), dv_SBGd + geo.v_offset(tile.j0, blk.b, blk.g), geo.ld_v);
  product(geo, true, false, tile.cols, geo.d, rows, T(1), sc.ds_MC + tile.p0 * tile.cols, tile.cols,
          sc.q_Md + tile.p0 * geo.d, geo.d, T(1), dk_SBGd + kv_off, geo.ld_kv);
}

// The block's dq (scratch) = / += ds k[tile keys].
template <typename T>
void accumulate_dq(BackwardScratch<T>& sc, const BackwardInputs<T>& in, const Block& blk, const KeyTile& tile) {
  const Geometry& geo = in.geo;
  if constexpr (std::is_same_v<T, float>) {
    if (geo.bf16_products) {
      Bf16Operands& x = bf16_operands();
      const int64_t rows = blk.rows - tile.p0, cols = tile.cols;
      // On AMX compute_tile wrote dS into tile_a already.
      if (geo.bf16_unit == Bf16ProductUnit::kEmulated) {
        x.tile_a.pack_a(geo.bf16_unit, false, rows, cols, sc.ds_MC + tile.p0 * cols, cols);
      }
      const float beta = tile.j0 == 0 && !geo.general ? 0.0f : 1.0f;
      if (tile.j0 % 32 == 0) {
        gemm_bf16_packed(rows, geo.d, cols, 1.0f, x.tile_a, 0,
                         geo.bf16_kv->keys[static_cast<size_t>(blk.b * geo.G + blk.g)], tile.j0, 0, beta,
                         sc.dq_Md + tile.p0 * geo.d, geo.d);
      } else {
        x.keys.pack_b(geo.bf16_unit, false, cols, geo.d, in.k + geo.kv_offset(tile.j0, blk.b, blk.g), geo.ld_kv);
        gemm_bf16_packed(rows, geo.d, cols, 1.0f, x.tile_a, 0, x.keys, 0, 0, beta, sc.dq_Md + tile.p0 * geo.d, geo.d);
      }
      return;
    }
  }
  product(geo, false, false, blk.rows - tile.p0, geo.d, tile.cols, T(1), sc.ds_MC + tile.p0 * tile.cols, tile.cols,
          in.k + geo.kv_offset(tile.j0, blk.b, blk.g), geo.ld_kv, T(tile.j0 == 0 && !geo.general ? 0 : 1),
          sc.dq_Md + tile.p0 * geo.d, geo.d);
}

// dq += the block's accumulated dq.
template <typename T>
void store_dq(T* dq_SBNd, const BackwardScratch<T>& sc, const Geometry& geo, const Block& blk) {
  const int64_t run = blk.hpg * geo.d;
  for (int64_t i = blk.i0; i < blk.i1; ++i) {
    T* dst = dq_SBNd + geo.q_offset(i, blk.b, blk.h0);
    const T* src = sc.dq_Md + (i - blk.i0) * run;
    for (int64_t c = 0; c < run; ++c) dst[c] += src[c];
  }
}

// With bf16 products, dK and dV of keys [k0, k1) gather in the thread's accumulators (accumulate_dk_dv);
// flush_key_grads adds them to dk, dv. Both schedules sum each key's tiles in the same order, then add once.
template <typename T>
void begin_key_grads(const Geometry& geo, const int64_t k0, const int64_t k1) {
  if (!packed_bf16<T>(geo)) return;
  Bf16Operands& x = bf16_operands();
  x.acc_k0 = k0;
  x.acc_k1 = k1;
  x.dk_acc.resize(static_cast<size_t>((k1 - k0) * geo.d));
  x.dv_acc.resize(static_cast<size_t>((k1 - k0) * geo.dv));
  x.acc_written.assign(static_cast<size_t>(k1 - k0), 0);
}

template <typename T>
MOECORE_VECTOR_CLONES void flush_key_grads(T* dk_SBGd, T* dv_SBGd, const Geometry& geo, const int64_t b,
                                           const int64_t g) {
  if (!packed_bf16<T>(geo)) return;
  const Bf16Operands& x = bf16_operands();
  for (int64_t j = x.acc_k0; j < x.acc_k1; ++j) {
    if (x.acc_written[static_cast<size_t>(j - x.acc_k0)] == 0) continue;
    T* dk = dk_SBGd + geo.kv_offset(j, b, g);
    T* dv = dv_SBGd + geo.v_offset(j, b, g);
    const float* dk_acc = x.dk_acc.data() + (j - x.acc_k0) * geo.d;
    const float* dv_acc = x.dv_acc.data() + (j - x.acc_k0) * geo.dv;
    for (int64_t c = 0; c < geo.d; ++c) dk[c] += static_cast<T>(dk_acc[c]);
    for (int64_t c = 0; c < geo.dv; ++c) dv[c] += static_cast<T>(dv_acc[c]);
  }
}

// One task per (b, kv group): its query blocks in order, each over its key tiles in order.
template <typename T>
void backward_by_group(T* dq, T* dk, T* dv, const BackwardInputs<T>& in) {
  const Geometry& geo = in.geo;
  Scratch<T> scratch(BackwardScratch<T>::size(geo));
#pragma omp parallel for schedule(dynamic, 1) if (geo.parallel())
  for (int64_t bg = 0; bg < geo.B * geo.G; ++bg) {
    BackwardScratch<T> sc(scratch.mine(), geo);
    begin_key_grads<T>(geo, 0, geo.Sk);
    for (int64_t i0 = 0; i0 < geo.S; i0 += geo.block_rows) {
      const Block blk(geo, bg / geo.G, bg % geo.G, i0);
      load_block(sc, in, blk);
      for_each_key_tile(geo, blk, kKeyTileBackward, [&](const KeyTile& tile) {
        compute_tile(sc, in, blk, tile);
        accumulate_dk_dv(dk, dv, sc, in, blk, tile);
        accumulate_dq(sc, in, blk, tile);
      });
      store_dq(dq, sc, geo, blk);
    }
    flush_key_grads(dk, dv, geo, bg / geo.G, bg % geo.G);
  }
}

// Two passes with more parallelism when there are few (b, group) pairs: tasks (b, group, key tile) produce dk, dv;
// tasks (b, group, query block) produce dq. Computes each tile twice, in the same way as backward_by_group, so the
// results are the same.
template <typename T>
void backward_by_block(T* dq, T* dk, T* dv, const BackwardInputs<T>& in) {
  const Geometry& geo = in.geo;
  const int64_t n_key_tiles = (geo.Sk + kKeyTileBackward - 1) / kKeyTileBackward, n_blocks = geo.n_query_blocks();
  const int64_t n_pairs = geo.B * geo.G;
  Scratch<T> scratch(BackwardScratch<T>::size(geo));
#pragma omp parallel if (geo.parallel())
  {
    BackwardScratch<T> sc(scratch.mine(), geo);
    // Key tile 0 sees every query row, the last one the fewest: start the big tasks first. The dq loop below reads
    // nothing this one writes, so threads move on without a barrier.
#pragma omp for schedule(dynamic, 1) nowait
    for (int64_t task = 0; task < n_key_tiles * n_pairs; ++task) {
      const int64_t bg = task % n_pairs, k0 = task / n_pairs * kKeyTileBackward, k1 = k0 + kKeyTileBackward;
      begin_key_grads<T>(geo, k0, std::min(k1, geo.Sk));
      if (geo.general) {
        // Every query block, each over its tiles in [k0, k1): the same tiles as backward_by_group's.
        for (int64_t i0 = 0; i0 < geo.S; i0 += geo.block_rows) {
          const Block blk(geo, bg / geo.G, bg % geo.G, i0);
          bool loaded = false;
          for_each_general_key_tile(geo, blk, kKeyTileBackward, k0, std::min(k1, geo.Sk), [&](const KeyTile& tile) {
            if (!loaded) load_block(sc, in, blk);
            loaded = true;
            compute_tile(sc, in, blk, tile);
            accumulate_dk_dv(dk, dv, sc, in, blk, tile);
          });
        }
        flush_key_grads(dk, dv, geo, bg / geo.G, bg % geo.G);
        continue;
      }
      for (int64_t i0 = k0 / geo.block_rows * geo.block_rows; i0 < geo.S; i0 += geo.block_rows) {
        const Block blk(geo, bg / geo.G, bg % geo.G, i0);
        load_block(sc, in, blk);
        for_each_key_tile(geo, blk, kKeyTileBackward, [&](const KeyTile& tile) {
          if (tile.j0 < k0 || tile.j0 >= k1) return;
          compute_tile(sc, in, blk, tile);
          accumulate_dk_dv(dk, dv, sc, in, blk, tile);
        });
      }
      flush_key_grads(dk, dv, geo, bg / geo.G, bg % geo.G);
    }
    // Query block n-1 sees the most keys: start it first.
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < n_blocks * n_pairs; ++task) {
      const int64_t bg = task % n_pairs, i0 = (n_blocks - 1 - task / n_pairs) * geo.block_rows;
      const Block blk(geo, bg / geo.G, bg % geo.G, i0);
      load_block(sc, in, blk);
      for_each_key_tile(geo, blk, kKeyTileBackward, [&](const KeyTile& tile) {
        compute_tile(sc, in, blk, tile);
        accumulate_dq(sc, in, blk, tile);
      });
      store_dq(dq, sc, geo, blk);
    }
  }
}

// delta_BNS[b, h, i] = dout_i . out_i (in double; dout rounded to bf16 under bf16 products, as in dP).
template <typename T>
MOECORE_VECTOR_CLONES void row_dots(T* delta_BNS, const T* dout_SBNd, const T* out_SBNd, const Geometry& geo,
                                    int64_t i) {
  for (int64_t bh = 0; bh < geo.B * geo.N; ++bh) {
    const T* dout_row = dout_SBNd + (i * geo.B * geo.N + bh) * geo.dv;
    const T* out_row = out_SBNd + (i * geo.B * geo.N + bh) * geo.dv;
    double dot = 0.0;
    if (geo.bf16_products) {
      for (int64_t c = 0; c < geo.dv; ++c) {
        const float rounded = std::bit_cast<float>(uint32_t{bf16_bits(static_cast<float>(dout_row[c]))} << 16);
        dot += static_cast<double>(rounded) * static_cast<double>(out_row[c]);
      }
    } else {
      for (int64_t c = 0; c < geo.dv; ++c) dot += static_cast<double>(dout_row[c]) * static_cast<double>(out_row[c]);
    }
    delta_BNS[bh * geo.S + i] = static_cast<T>(dot);
  }
}

// attention_merge for the B * N rows of query position i: weights exp(lse_side - lse_new) in double.
template <typename T>
MOECORE_VECTOR_CLONES void merge_position(T* out_SBNd, T* lse_BNS, const T* part_out_SBNd, const T* part_lse_BNS,
                                          const AttentionDims& dims, const int64_t i) {
  const int64_t S = dims.S, BN = dims.B * dims.N, d = detail::value_dim(dims);
  constexpr double kMinusInf = -std::numeric_limits<double>::infinity();
  for (int64_t bh = 0; bh < BN; ++bh) {
    const double a = static_cast<double>(lse_BNS[bh * S + i]), p = static_cast<double>(part_lse_BNS[bh * S + i]);
    if (p == kMinusInf) continue;  // the part saw no key: nothing to add
    T* out = out_SBNd + (i * BN + bh) * d;
    const T* part = part_out_SBNd + (i * BN + bh) * d;
    if (a == kMinusInf) {  // only the part saw keys (out may hold anything)
      std::copy(part, part + d, out);
      lse_BNS[bh * S + i] = part_lse_BNS[bh * S + i];
      continue;
    }
    const double lse = std::max(a, p) + std::log1p(std::exp(-std::abs(a - p)));
    const T wa = static_cast<T>(std::exp(a - lse)), wp = static_cast<T>(std::exp(p - lse));
#pragma omp simd
    for (int64_t c = 0; c < d; ++c) out[c] = out[c] * wa + part[c] * wp;
    lse_BNS[bh * S + i] = static_cast<T>(lse);
  }
}

}  // namespace

template <typename T>
void attention_forward(T* out_SBNd, T* lse_BNS, const T* q_SBNd, const T* k_SBGd, const T* v_SBGd,
                       const AttentionDims& dims, const DropoutSpec& dropout) {
  detail::check_attention_args(dims, dropout, "attention_forward");
  const BlockLayout layout(dims);
  Geometry geo(dims, layout);
  Bf16KeyValues kv;  // the call's packed k and v (bf16 products)
  if constexpr (std::is_same_v<T, float>) {
    if (geo.bf16_products) {
      kv.pack(geo, k_SBGd, v_SBGd, false);
      geo.bf16_kv = &kv;
    }
  }
  const MaskStream mask(dropout);
  const int64_t n_blocks = geo.n_query_blocks(), n_pairs = geo.B * geo.G;
  Scratch<T> scratch(ForwardScratch<T>::size(geo));
#pragma omp parallel for schedule(dynamic, 1) if (geo.parallel())
  for (int64_t task = 0; task < n_blocks * n_pairs; ++task) {
    const int64_t bg = task % n_pairs, i0 = (n_blocks - 1 - task / n_pairs) * geo.block_rows;  // biggest first
    ForwardScratch<T> sc(scratch.mine(), geo);
    forward_block(out_SBNd, lse_BNS, q_SBNd, k_SBGd, v_SBGd, geo, dims.scale, mask,
                  Block(geo, bg / geo.G, bg % geo.G, i0), sc);
  }
}

template <typename T>
void attention_backward(T* dq_SBNd, T* dk_SBGd, T* dv_SBGd, const T* dout_SBNd, const T* q_SBNd, const T* k_SBGd,
                        const T* v_SBGd, const T* out_SBNd, const T* lse_BNS, const AttentionDims& dims,
                        const DropoutSpec& dropout) {
  detail::check_attention_args(dims, dropout, "attention_backward");
  const BlockLayout layout(dims);
  Geometry geo(dims, layout);
  Bf16KeyValues kv;  // the call's packed k and v (bf16 products)
  if constexpr (std::is_same_v<T, float>) {
    if (geo.bf16_products) {
      kv.pack(geo, k_SBGd, v_SBGd, true);
      geo.bf16_kv = &kv;
    }
  }
  // rowsum(dP * P) = sum_j dPd_ij Pd_ij = dout_i . out_i, also with dropout (out is built from Pd).
  std::vector<T> delta_BNS(geo.B * geo.N * geo.S);
#pragma omp parallel for schedule(static) if (geo.parallel())
  for (int64_t i = 0; i < geo.S; ++i) row_dots(delta_BNS.data(), dout_SBNd, out_SBNd, geo, i);
  const BackwardInputs<T> in{dout_SBNd,          q_SBNd, k_SBGd, v_SBGd, lse_BNS, delta_BNS.data(), geo, dims.scale,
                             MaskStream(dropout)};
  // The per-group schedule computes each tile once, the two-pass one 1.5 times (measured): take the per-group one
  // unless its rounds of equal group tasks leave threads idle for more than that.
  const int64_t n_threads = omp_get_max_threads(), n_pairs = geo.B * geo.G;
  const int64_t rounds = (n_pairs + n_threads - 1) / n_threads;
  if (n_threads == 1 || 2 * rounds * n_threads <= 3 * n_pairs) {
    backward_by_group(dq_SBNd, dk_SBGd, dv_SBGd, in);
  } else {
    backward_by_block(dq_SBNd, dk_SBGd, dv_SBGd, in);
  }
}

template <typename T>
void attention_merge(T* out_SBNd, T* lse_BNS, const T* part_out_SBNd, const T* part_lse_BNS,
                     const AttentionDims& dims) {
  detail::check_merge_args(dims, "attention_merge");
#pragma omp parallel for schedule(static) if (dims.S * dims.B * dims.N * detail::value_dim(dims) > (int64_t{1} << 16))
  for (int64_t i = 0; i < dims.S; ++i) merge_position(out_SBNd, lse_BNS, part_out_SBNd, part_lse_BNS, dims, i);
}

#define MOECORE_ATTENTION_INSTANTIATE(T)                                                                              \
  template void attention_forward<T>(T*, T*, const T*, const T*, const T*, const AttentionDims&, const DropoutSpec&); \
  template void attention_backward<T>(T*, T*, T*, const T*, const T*, const T*, const T*, const T*, const T*,         \
                                      const AttentionDims&, const DropoutSpec&);                                      \
  template void attention_merge<T>(T*, T*, const T*, const T*, const AttentionDims&);
MOECORE_ATTENTION_INSTANTIATE(float)
MOECORE_ATTENTION_INSTANTIATE(double)
#undef MOECORE_ATTENTION_INSTANTIATE

}  // namespace moecore::kernels::cpu
