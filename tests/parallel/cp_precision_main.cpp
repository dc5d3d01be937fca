// Context-parallel attention under 16-bit activations (mpirun -np 2 and 4): the attention keeps its partial results
// in fp32 across kernel calls and rounds what it hands back once, as TransformerEngine's ring attention does.
// For every --cp-comm-type and for bf16 and fp16, on random 16-bit q, k, v, dout:
// - forward: the output under ScopedActivationDType(dtype) equals the fp32 run's output rounded once, bit for bit
//   (lse is fp32 in both);
// - forward: each output element is one of the two 16-bit neighbours of the one-process fp32 attention (a result
//   rounded once from a value within fp32 rounding of the exact one always is; per-step rounding drifts by up to
//   CP half-ulps and leaves them);
// - backward: dq, dk, dv (accumulated onto non-zero 16-bit gradients) under the scope equal the fp32 run's rounded
//   once, bit for bit;
// - fp32 backward: dq, dk, dv equal the one-process fp32 attention's gradients at this rank's rows.
// Each with value heads as wide as the query / key heads (16), narrower (12: multi-latent attention) and wider (24).
// The attention's products run in fp32 here (ScopedAttentionProductPath): the bit-for-bit claims are about the
// context-parallel layer's fp32 partial results, and bf16 products round P and dS inside every block's kernel call
// (checked against the reference in kernels_attention_bf16_test, and the bf16 cp2 model against the one-process run
// in dist.equiv.bf16_cp2).
// Exit status 1 on any mismatch, on any rank.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "moecore/kernels/cpu/attention_products.h"
#include "moecore/model/context_parallel_attention.h"
#include "moecore/ops/precision.h"
#include "moecore/parallel/mpi_runtime.h"
#include "moecore/parallel/process_group.h"
#include "moecore/tensor/dtype.h"

namespace {

using namespace moecore;
using parallel::ProcessGroup;

constexpr int64_t kS = 32, kB = 2, kN = 8, kG = 4, kD = 16;

int failures = 0;

void check(const bool ok, const std::string& what) {
  if (!ok) ++failures;
  if (!ok) std::printf("FAIL: %s\n", what.c_str());
}

uint16_t bits_of(const float x, const DType dtype) { return dtype == DType::kBF16 ? fp32_to_bf16(x) : fp32_to_fp16(x); }
float value_of(const uint16_t bits, const DType dtype) {
  return dtype == DType::kBF16 ? bf16_to_fp32(bits) : fp16_to_fp32(bits);
}
float round_to(const float x, const DType dtype) { return value_of(bits_of(x, dtype), dtype); }

// Deterministic values in [-2, 2), already representable in `dtype` (16-bit activations).
Tensor random_tensor(std::vector<int64_t> shape, uint64_t seed, const DType dtype) {
  Tensor t(std::move(shape), DType::kF32);
  float* x = t.data<float>();
  for (int64_t i = 0; i < t.numel(); ++i) {
    seed = seed * 6364136223846793005ULL + 1442695040888963407ULL;
    const float u = static_cast<float>(seed >> 40) / static_cast<float>(1ULL << 24);
    x[i] = round_to(4.0f * u - 2.0f, dtype);
  }
  return t;
}

// Rows [S, ...] of the whole-sequence tensor at the given sequence indices.
Tensor rows_at(const Tensor& whole, const std::vector<int64_t>& index) {
  const int64_t row = whole.numel() / whole.shape()[0];
  std::vector<int64_t> shape = whole.shape();
  shape[0] = static_cast<int64_t>(index.size());
  Tensor out(shape, DType::kF32);
  for (size_t s = 0; s < index.size(); ++s) {
    for (int64_t j = 0; j < row; ++j) out.data<float>()[s * row + j] = whole.data<float>()[index[s] * row + j];
  }
  return out;
}

// Elements of `got` that differ from `want` rounded to `dtype`, bit for bit.
int64_t mismatches_rounded_once(const Tensor& got, const Tensor& want, const DType dtype) {
  int64_t bad = 0;
  for (int64_t i = 0; i < got.numel(); ++i) {
    const float rounded = round_to(want.data<float>()[i], dtype);
    if (std::bit_cast<uint32_t>(got.data<float>()[i]) != std::bit_cast<uint32_t>(rounded)) ++bad;
  }
  return bad;
}

// Elements of `got` that are not one of the two `dtype` values around `exact`, nor the rounding of a value within
// fp32 summation error of it (1e-6 of the largest |exact|): an entry that cancels to near zero keeps the absolute
// error of its summands, far more than a 16-bit ulp of its own tiny magnitude.
int64_t outside_neighbours(const Tensor& got, const Tensor& exact, const DType dtype) {
  float largest = 0.0f;
  for (int64_t i = 0; i < exact.numel(); ++i) largest = std::max(largest, std::abs(exact.data<float>()[i]));
  const float summation_error = 1e-6f * largest;
  int64_t bad = 0;
  for (int64_t i = 0; i < got.numel(); ++i) {
    const float x = exact.data<float>()[i], y = got.data<float>()[i];
    const uint16_t nearest = bits_of(x, dtype);
    const float r = value_of(nearest, dtype);
    bool ok = y == r || (round_to(x - summation_error, dtype) <= y && y <= round_to(x + summation_error, dtype));
    for (const uint16_t other : {static_cast<uint16_t>(nearest + 1), static_cast<uint16_t>(nearest - 1)}) {
      const float o = value_of(other, dtype);
      ok = ok || (y == o && (o - x) * (r - x) <= 0.0f);
    }
    if (!ok) ++bad;
  }
  return bad;
}

// max |got - want| / max |want|.
double normwise_error(const Tensor& got, const Tensor& want) {
  double error = 0.0, largest = 0.0;
  for (int64_t i = 0; i < got.numel(); ++i) {
    const double g = got.data<float>()[i], w = want.data<float>()[i];
    error = std::max(error, std::abs(g - w));
    largest = std::max(largest, std::abs(w));
  }
  return largest > 0.0 ? error / largest : error;
}

struct Grads {
  Tensor dq, dk, dv;
};

// dv: the value head width (0: kD).
void run_case(const ProcessGroup& cp, const CpCommType type, const DType dtype, const int64_t dv) {
  const int64_t v_width = dv > 0 ? dv : kD;
  const std::string name = std::string(cp_comm_type_name(type)) + " " + std::string(dtype_name(dtype)) + " cp" +
                           std::to_string(cp.size()) + " dv " + std::to_string(v_width) + " rank " +
                           std::to_string(cp.rank());
  const Tensor q_all = random_tensor({kS, kB, kN, kD}, 1, dtype), k_all = random_tensor({kS, kB, kG, kD}, 2, dtype),
               v_all = random_tensor({kS, kB, kG, v_width}, 3, dtype),
               dout_all = random_tensor({kS, kB, kN, v_width}, 4, dtype);
  SequenceInfo seq;
  seq.S = kS;
  seq.B = kB;
  seq.cp_rank = cp.rank();
  seq.cp_size = cp.size();
  const std::vector<int64_t> local = seq.local_index();
  const int64_t S_l = seq.local_length();
  const Tensor q = rows_at(q_all, local), k = rows_at(k_all, local), v = rows_at(v_all, local),
               dout = rows_at(dout_all, local);
  ops::AttentionDims dims;  // S: the local rows
  dims.S = S_l;
  dims.B = kB;
  dims.N = kN;
  dims.G = kG;
  dims.head_dim = kD;
  dims.scale = 1.0 / std::sqrt(static_cast<double>(kD));
  dims.v_head_dim = dv;
  const ops::DropoutSpec no_dropout;

  // Forward: under the 16-bit scope, and in fp32.
  Tensor out16({S_l, kB, kN, v_width}, DType::kF32), lse16({kB, kN, S_l}, DType::kF32);
  {
    const ops::ScopedActivationDType scope(dtype);
    context_parallel_attention_forward(out16, lse16, q, k, v, dims, no_dropout, seq, cp, type);
  }
  Tensor out32({S_l, kB, kN, v_width}, DType::kF32), lse32({kB, kN, S_l}, DType::kF32);
  context_parallel_attention_forward(out32, lse32, q, k, v, dims, no_dropout, seq, cp, type);
  const int64_t fwd_bad = mismatches_rounded_once(out16, out32, dtype);
  check(fwd_bad == 0, name + ": forward output is the fp32 output rounded once (" + std::to_string(fwd_bad) + " of " +
                          std::to_string(out16.numel()) + " elements differ)");
  bool same_lse = true;
  for (int64_t i = 0; i < lse16.numel(); ++i) same_lse = same_lse && lse16.data<float>()[i] == lse32.data<float>()[i];
  check(same_lse, name + ": forward lse is the fp32 lse");

  // The one-process fp32 attention over the whole sequence, at this rank's rows.
  Tensor out_one({kS, kB, kN, v_width}, DType::kF32), lse_one({kB, kN, kS}, DType::kF32);
  SequenceInfo one = seq;
  one.cp_rank = 0;
  one.cp_size = 1;
  ops::AttentionDims one_dims = dims;
  one_dims.S = kS;
  context_parallel_attention_forward(out_one, lse_one, q_all, k_all, v_all, one_dims, no_dropout, one,
                                     ProcessGroup::self(), type);
  const int64_t far = outside_neighbours(out16, rows_at(out_one, local), dtype);
  check(far == 0, name + ": forward output is a 16-bit neighbour of the one-process fp32 attention (" +
                      std::to_string(far) + " elements are not)");

  // Backward from the 16-bit forward's out and lse, accumulating onto 16-bit gradients.
  const auto start = [&] {
    return Grads{random_tensor({S_l, kB, kN, kD}, 10 + cp.rank(), dtype),
                 random_tensor({S_l, kB, kG, kD}, 20 + cp.rank(), dtype),
                 random_tensor({S_l, kB, kG, v_width}, 30 + cp.rank(), dtype)};
  };
  Grads g16 = start(), g32 = start();
  {
    const ops::ScopedActivationDType scope(dtype);
    context_parallel_attention_backward(g16.dq, g16.dk, g16.dv, dout, q, k, v, out16, lse16, dims, no_dropout, seq, cp,
                                        type);
  }
  context_parallel_attention_backward(g32.dq, g32.dk, g32.dv, dout, q, k, v, out16, lse16, dims, no_dropout, seq, cp,
                                      type);
  const std::pair<const char*, std::pair<const Tensor*, const Tensor*>> grads[] = {
      {"dq", {&g16.dq, &g32.dq}}, {"dk", {&g16.dk, &g32.dk}}, {"dv", {&g16.dv, &g32.dv}}};
  for (const auto& [what, pair] : grads) {
    const int64_t bad = mismatches_rounded_once(*pair.first, *pair.second, dtype);
    check(bad == 0, name + ": backward " + what + " is the fp32 " + what + " rounded once (" + std::to_string(bad) +
                        " of " + std::to_string(pair.first->numel()) + " elements differ)");
  }

  // The fp32 backward from the fp32 forward against the one-process fp32 attention's gradients at this rank's rows.
  const auto zeros = [](const int64_t rows, const int64_t heads, const int64_t width) {
    Tensor t({rows, kB, heads, width}, DType::kF32);
    std::fill_n(t.data<float>(), t.numel(), 0.0f);
    return t;
  };
  Grads g_cp{zeros(S_l, kN, kD), zeros(S_l, kG, kD), zeros(S_l, kG, v_width)};
  context_parallel_attention_backward(g_cp.dq, g_cp.dk, g_cp.dv, dout, q, k, v, out32, lse32, dims, no_dropout, seq, cp,
                                      type);
  Grads g_one{zeros(kS, kN, kD), zeros(kS, kG, kD), zeros(kS, kG, v_width)};
  context_parallel_attention_backward(g_one.dq, g_one.dk, g_one.dv, dout_all, q_all, k_all, v_all, out_one, lse_one,
                                      one_dims, no_dropout, one, ProcessGroup::self(), type);
  const std::pair<const char*, std::pair<const Tensor*, const Tensor*>> vs_one[] = {
      {"dq", {&g_cp.dq, &g_one.dq}}, {"dk", {&g_cp.dk, &g_one.dk}}, {"dv", {&g_cp.dv, &g_one.dv}}};
  for (const auto& [what, pair] : vs_one) {
    const double error = normwise_error(*pair.first, rows_at(*pair.second, local));
    check(error < 1e-5, name + ": fp32 backward " + what + " is the one-process " + what + " (normwise error " +
                            std::to_string(error) + ")");
  }
  const double out_error = normwise_error(out32, rows_at(out_one, local));
  check(out_error < 1e-5,
        name + ": fp32 forward output is the one-process output (normwise error " + std::to_string(out_error) + ")");
}

}  // namespace

int main(int argc, char** argv) {
  const parallel::MpiRuntime mpi(&argc, &argv);
  const ProcessGroup world = ProcessGroup::world();
  const kernels::cpu::ScopedAttentionProductPath fp32_products(kernels::cpu::AttentionProductPath::kF32);
  for (const CpCommType type : {CpCommType::kP2P, CpCommType::kAllGather, CpCommType::kA2A}) {
    for (const DType dtype : {DType::kBF16, DType::kF16}) {
      for (const int64_t dv : {0, 12, 24}) run_case(world, type, dtype, dv);
    }
  }
  std::vector<float> failed = {static_cast<float>(failures)};
  world.all_reduce<float>(std::span<float>(failed), parallel::ReduceOp::kMax);
  if (world.rank() == 0) std::printf("%s\n", failed[0] == 0.0f ? "cp precision: ok" : "cp precision: FAILED");
  return failed[0] == 0.0f ? 0 : 1;
}
