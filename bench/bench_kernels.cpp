// Times the fast kernels against their naive references at training sizes; prints one line per kernel.
// usage: bench_kernels [--threads N] [--repeats N] [--attention] [--case NAME] [--no-ref]
//   --attention: only the attention cases; --case: only that attention case (demo, moe, gqa, drop, long, long4k,
//   cp4, long4kdrop, cp4drop, docs, mla, mla192, tinymla, tinygqa); --no-ref: skip the naive references (slow).
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "moecore/kernels/cpu/attention.h"
#include "moecore/kernels/cpu/attention_products.h"
#include "moecore/kernels/cpu/loss.h"
#include "moecore/tensor/rng.h"

namespace {

using namespace moecore;

std::vector<float> random_floats(const size_t n, const uint64_t key, const float scale) {
  const CounterRng rng(1, key);
  std::vector<float> out(n);
  for (size_t i = 0; i < n; ++i) out[i] = scale * static_cast<float>(rng.normal(i));
  return out;
}

// Median milliseconds of `repeats` calls after one warm-up call.
double time_ms(const std::function<void()>& fn, const int repeats) {
  fn();
  std::vector<double> times;
  for (int r = 0; r < repeats; ++r) {
    const auto start = std::chrono::steady_clock::now();
    fn();
    times.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count());
  }
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

void bench_cross_entropy(const bool with_ref) {
  const int64_t T = 2048, V = 50304;
  const std::vector<float> logits = random_floats(static_cast<size_t>(T * V), 1, 2.0f);
  std::vector<float> dlogits(logits.size()), lse(T), losses(T), dlosses(T, 1.0f / T);
  std::vector<int32_t> targets(T);
  for (int64_t t = 0; t < T; ++t) targets[t] = static_cast<int32_t>((t * 7919) % V);
  for (const bool fast : {true, false}) {
    if (!fast && !with_ref) continue;
    const double fwd = time_ms(
        [&] {
          (fast ? kernels::cpu::cross_entropy_forward<float>
                : kernels::ref::cross_entropy_forward<float>)(losses.data(), lse.data(), logits.data(), targets.data(),
                                                              T, V);
        },
        5);
    const double bwd = time_ms(
        [&] {
          (fast ? kernels::cpu::cross_entropy_backward<float>
                : kernels::ref::cross_entropy_backward<float>)(dlogits.data(), dlosses.data(), logits.data(),
                                                               lse.data(), targets.data(), T, V);
        },
        5);
    std::printf("cross_entropy %-4s T=%ld V=%ld fp32: forward %.1f ms, backward %.1f ms\n", fast ? "cpu" : "ref",
                static_cast<long>(T), static_cast<long>(V), fwd, bwd);
  }
}

struct AttentionCase {
  const char* name;
  int64_t S, B, N, G, d;
  float dropout;
  bool with_ref;  // the naive reference is slow (minutes at S = 2048): only on the smallest case
  // > 0: the S rows split over cp context-parallel ranks (2 cp chunks, rank r holding chunks r and 2 cp - 1 - r),
  // every rank's attention run as cp ring steps (a key block each, merged); the times are the sums over all ranks.
  int64_t cp = 0;
  int64_t document = 0;  // > 0: packed documents of this many rows (block path, no attention across documents)
  int64_t dv = 0;        // > 0: value heads this wide (multi-latent attention; not with cp)
};

// Rows of rank r: chunks r and 2 cp - 1 - r of `chunk` rows.
std::vector<int64_t> cp_rows(const int64_t cp, const int64_t r, const int64_t chunk) {
  std::vector<int64_t> rows;
  for (const int64_t c : {r, 2 * cp - 1 - r}) {
    for (int64_t i = 0; i < chunk; ++i) rows.push_back(c * chunk + i);
  }
  return rows;
}

std::vector<float> take_rows(const std::vector<float>& x, const std::vector<int64_t>& rows, const int64_t width) {
  std::vector<float> out;
  for (const int64_t r : rows) out.insert(out.end(), x.begin() + r * width, x.begin() + (r + 1) * width);
  return out;
}

// Ring attention of every rank of c.cp: forward = per rank, cp block forwards (Sk = S / cp) and cp - 1 merges;
// backward = per rank, cp block backwards with the final out and lse. The same FLOPs as the one-process attention.
void bench_ring_attention(const AttentionCase& c, const int repeats) {
  const int64_t chunk = c.S / (2 * c.cp), local = 2 * chunk;
  kernels::AttentionDims dims;
  dims.S = local;
  dims.Sk = local;
  dims.B = c.B;
  dims.N = c.N;
  dims.G = c.G;
  dims.head_dim = c.d;
  dims.scale = 1.0 / std::sqrt(static_cast<double>(c.d));
  dims.dropout_seq_len = c.S;
  const int64_t q_width = c.B * c.N * c.d, kv_width = c.B * c.G * c.d;
  const std::vector<float> q = random_floats(static_cast<size_t>(c.S * q_width), 2, 1.0f),
                           k = random_floats(static_cast<size_t>(c.S * kv_width), 3, 1.0f),
                           v = random_floats(static_cast<size_t>(c.S * kv_width), 4, 1.0f),
                           dout = random_floats(static_cast<size_t>(c.S * q_width), 5, 1.0f);
  struct Rank {
    std::vector<int64_t> rows;
    std::vector<float> q, k, v, dout, out, lse, part_out, part_lse, dq, dk, dv;
  };
  std::vector<Rank> ranks(static_cast<size_t>(c.cp));
  for (int64_t r = 0; r < c.cp; ++r) {
    Rank& rank = ranks[static_cast<size_t>(r)];
    rank.rows = cp_rows(c.cp, r, chunk);
    rank.q = take_rows(q, rank.rows, q_width);
    rank.k = take_rows(k, rank.rows, kv_width);
    rank.v = take_rows(v, rank.rows, kv_width);
    rank.dout = take_rows(dout, rank.rows, q_width);
    rank.out.resize(rank.q.size());
    rank.part_out.resize(rank.q.size());
    rank.lse.resize(static_cast<size_t>(c.B * c.N * local));
    rank.part_lse.resize(rank.lse.size());
    rank.dq.resize(rank.q.size());
    rank.dk.resize(rank.k.size());
    rank.dv.resize(rank.v.size());
  }
  const kernels::DropoutSpec dropout{c.dropout, 7, 11};
  // fp32 products, then bf16 products on AMX tiles where usable (the --bf16 default there).
  for (const bool bf16 : {false, true}) {
    if (bf16 && !kernels::cpu::bf16_product_unit_usable(kernels::cpu::Bf16ProductUnit::kAmx)) continue;
    dims.bf16_products = bf16;
    auto dims_of = [&](const int64_t r, const int64_t s) {
      kernels::AttentionDims block = dims;
      block.q_index = ranks[static_cast<size_t>(r)].rows.data();
      block.k_index = ranks[static_cast<size_t>(s)].rows.data();
      return block;
    };
    const double fwd = time_ms(
        [&] {
          for (int64_t r = 0; r < c.cp; ++r) {
            Rank& rank = ranks[static_cast<size_t>(r)];
            for (int64_t t = 0; t < c.cp; ++t) {
              const int64_t s = (r - t + c.cp) % c.cp;
              const Rank& keys = ranks[static_cast<size_t>(s)];
              const kernels::AttentionDims block = dims_of(r, s);
              float* out = t == 0 ? rank.out.data() : rank.part_out.data();
              float* lse = t == 0 ? rank.lse.data() : rank.part_lse.data();
              kernels::cpu::attention_forward(out, lse, rank.q.data(), keys.k.data(), keys.v.data(), block, dropout);
              if (t > 0) {
                kernels::cpu::attention_merge(rank.out.data(), rank.lse.data(), rank.part_out.data(),
                                              rank.part_lse.data(), block);
              }
            }
          }
        },
        repeats);
    const double bwd = time_ms(
        [&] {
          for (int64_t r = 0; r < c.cp; ++r) {
            Rank& rank = ranks[static_cast<size_t>(r)];
            for (int64_t t = c.cp - 1; t >= 0; --t) {
              const int64_t s = (r - t + c.cp) % c.cp;
              Rank& keys = ranks[static_cast<size_t>(s)];
              kernels::cpu::attention_backward(rank.dq.data(), keys.dk.data(), keys.dv.data(), rank.dout.data(),
                                               rank.q.data(), keys.k.data(), keys.v.data(), rank.out.data(),
                                               rank.lse.data(), dims_of(r, s), dropout);
            }
          }
        },
        repeats);
    std::printf(
        "attention     cpu  %-7s S=%ld B=%ld N=%ld G=%ld d=%ld p=%.1f cp=%ld (%ld ranks x %ld blocks of %ldx%ld) %s: "
        "forward %.1f ms, backward %.1f ms\n",
        c.name, static_cast<long>(c.S), static_cast<long>(c.B), static_cast<long>(c.N), static_cast<long>(c.G),
        static_cast<long>(c.d), static_cast<double>(c.dropout), static_cast<long>(c.cp), static_cast<long>(c.cp),
        static_cast<long>(c.cp), static_cast<long>(local), static_cast<long>(local),
        bf16 ? "bf16 products (AMX-BF16 tiles)" : "fp32 products", fwd, bwd);
  }
}

// Forward and backward of the causal attention kernel, fp32, median of `repeats` calls each.
void bench_attention(const AttentionCase& c, const int repeats, const bool allow_ref) {
  if (c.cp > 0) return bench_ring_attention(c, repeats);
  kernels::AttentionDims dims;
  dims.S = c.S;
  dims.B = c.B;
  dims.N = c.N;
  dims.G = c.G;
  dims.head_dim = c.d;
  dims.scale = 1.0 / std::sqrt(static_cast<double>(c.d));
  dims.v_head_dim = c.dv;
  const int64_t value_dim = c.dv > 0 ? c.dv : c.d;
  const size_t q_size = static_cast<size_t>(dims.S * dims.B * dims.N * dims.head_dim);
  const size_t kv_size = static_cast<size_t>(dims.S * dims.B * dims.G * dims.head_dim);
  const size_t out_size = static_cast<size_t>(dims.S * dims.B * dims.N * value_dim);
  const size_t v_size = static_cast<size_t>(dims.S * dims.B * dims.G * value_dim);
  const std::vector<float> q = random_floats(q_size, 2, 1.0f), k = random_floats(kv_size, 3, 1.0f),
                           v = random_floats(v_size, 4, 1.0f), dout = random_floats(out_size, 5, 1.0f);
  std::vector<float> out(out_size), lse(static_cast<size_t>(dims.B * dims.N * dims.S)), dq(q_size), dk(kv_size),
      dv(v_size);
  const kernels::DropoutSpec dropout{c.dropout, 7, 11};
  std::vector<int32_t> documents_SB;
  if (c.document > 0) {
    for (int64_t s = 0; s < c.S; ++s)
      documents_SB.insert(documents_SB.end(), c.B, static_cast<int32_t>(s / c.document));
    dims.q_document_SB = dims.k_document_SB = documents_SB.data();
  }
  // The fast kernel with fp32 products, then with bf16 products on each unit this CPU has (AMX tiles: the --bf16
  // default; AVX512-BF16 vdpbf16ps), then the reference.
  using kernels::cpu::Bf16ProductUnit;
  for (const int run : {0, 1, 2, 3}) {
    const bool fast = run < 3;
    if (!fast && !(c.with_ref && allow_ref)) continue;
    const Bf16ProductUnit unit = run == 2 ? Bf16ProductUnit::kAvx512Bf16 : Bf16ProductUnit::kAmx;
    if ((run == 1 || run == 2) && !kernels::cpu::bf16_product_unit_usable(unit)) continue;
    const kernels::cpu::ScopedBf16ProductUnit on(run == 1 || run == 2 ? unit : Bf16ProductUnit::kEmulated);
    dims.bf16_products = run == 1 || run == 2;
    const std::string products = dims.bf16_products
                                     ? "bf16 products (" + std::string(kernels::cpu::bf16_product_unit_name(unit)) + ")"
                                     : "fp32 products";
    auto forward = fast ? kernels::cpu::attention_forward<float> : kernels::ref::attention_forward<float>;
    auto backward = fast ? kernels::cpu::attention_backward<float> : kernels::ref::attention_backward<float>;
    const int n = fast ? repeats : 1;
    const double fwd =
        time_ms([&] { forward(out.data(), lse.data(), q.data(), k.data(), v.data(), dims, dropout); }, n);
    const double bwd = time_ms(
        [&] {
          backward(dq.data(), dk.data(), dv.data(), dout.data(), q.data(), k.data(), v.data(), out.data(), lse.data(),
                   dims, dropout);
        },
        n);
    std::printf(
        "attention     %-4s %-7s S=%ld B=%ld N=%ld G=%ld d=%ld%s p=%.1f%s %s: forward %.1f ms, backward %.1f ms\n",
        fast ? "cpu" : "ref", c.name, static_cast<long>(c.S), static_cast<long>(c.B), static_cast<long>(c.N),
        static_cast<long>(c.G), static_cast<long>(c.d), c.dv > 0 ? (" dv=" + std::to_string(c.dv)).c_str() : "",
        static_cast<double>(c.dropout), c.document > 0 ? (" documents of " + std::to_string(c.document)).c_str() : "",
        products.c_str(), fwd, bwd);
  }
}

// The demo model's shape, the MoE benchmark's (S=512, B=4, 8 heads of 64), a GQA variant of it, the same with
// attention dropout, and a long sequence with GQA; then S = 4096 with GQA in one process (long4k), split over two
// context-parallel ranks (cp4: 4 chunks, each rank 2 ring steps of 2048 x 2048 blocks, without and with dropout),
// and as packed documents of 512 tokens (the block path skipping the key tiles of other documents); multi-latent
// attention's heads (DeepSeek-V3: q / k 192 wide, values 128) and the same with 192-wide values; the attention of
// configs/deepseek-v3-tiny.args (4 heads of 32 + 16, values 32) and of its GQA counterpart (4 heads of 32, 2 groups).
const AttentionCase kAttentionCases[] = {
    {"demo", 256, 8, 8, 8, 64, 0.0f, true},
    {"moe", 512, 4, 8, 8, 64, 0.0f, false},
    {"gqa", 512, 4, 8, 2, 64, 0.0f, false},
    {"drop", 512, 4, 8, 8, 64, 0.1f, false},
    {"long", 2048, 1, 8, 2, 64, 0.0f, false},
    {"long4k", 4096, 1, 8, 2, 64, 0.0f, false},
    {"cp4", 4096, 1, 8, 2, 64, 0.0f, false, 2},
    {"long4kdrop", 4096, 1, 8, 2, 64, 0.1f, false},
    {"cp4drop", 4096, 1, 8, 2, 64, 0.1f, false, 2},
    {"docs", 4096, 1, 8, 2, 64, 0.0f, false, 0, 512},
    {"mla", 1024, 1, 16, 16, 192, 0.0f, false, 0, 0, 128},
    {"mla192", 1024, 1, 16, 16, 192, 0.0f, false},
    {"tinymla", 256, 4, 4, 4, 48, 0.0f, false, 0, 0, 32},
    {"tinygqa", 256, 4, 4, 2, 32, 0.0f, false},
};

}  // namespace

int main(int argc, char** argv) {
  bool attention_only = false, with_ref = true;
  const char* only_case = nullptr;
  int repeats = 5;
  for (int a = 1; a < argc; ++a) {
    if (std::strcmp(argv[a], "--threads") == 0 && a + 1 < argc) {
      omp_set_num_threads(std::atoi(argv[++a]));
    } else if (std::strcmp(argv[a], "--repeats") == 0 && a + 1 < argc) {
      repeats = std::max(1, std::atoi(argv[++a]));
    } else if (std::strcmp(argv[a], "--attention") == 0) {
      attention_only = true;
    } else if (std::strcmp(argv[a], "--case") == 0 && a + 1 < argc) {
      only_case = argv[++a];
      attention_only = true;
    } else if (std::strcmp(argv[a], "--no-ref") == 0) {
      with_ref = false;
    } else {
      std::fprintf(stderr, "usage: bench_kernels [--threads N] [--repeats N] [--attention] [--case NAME] [--no-ref]\n");
      return 2;
    }
  }
  std::printf("threads: %d\n", omp_get_max_threads());
  if (!attention_only) bench_cross_entropy(with_ref);
  for (const AttentionCase& c : kAttentionCases) {
    if (only_case == nullptr || std::strcmp(only_case, c.name) == 0) bench_attention(c, repeats, with_ref);
  }
  return 0;
}
