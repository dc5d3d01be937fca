#include "moecore/ops/linear_cross_entropy.h"

#include <algorithm>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "moecore/kernels/cpu/convert.h"
#include "moecore/ops/convert.h"
#include "moecore/ops/dispatch.h"
#include "moecore/ops/linear.h"
#include "moecore/ops/loss.h"
#include "moecore/ops/precision.h"
#include "moecore/ops/quantization.h"
#include "moecore/ops/staging.h"
#include "moecore/ops/weight_casts.h"

namespace moecore::ops {
namespace {

constexpr const char* kOp = "linear_cross_entropy";

void check(const bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument(std::string(kOp) + ": " + what);
}

void check_numel(const Tensor& t, const char* name, const int64_t numel, const DType dtype) {
  check(t.defined(), std::string(name) + " is undefined");
  check(t.numel() == numel,
        std::string(name) + " has " + std::to_string(t.numel()) + " elements, expected " + std::to_string(numel));
  check(t.dtype() == dtype, std::string(name) + " has dtype " + std::string(dtype_name(t.dtype())) + ", expected " +
                                std::string(dtype_name(dtype)));
}

// The 16-bit dtype whose native GEMMs the output layer runs on, as the linear layers do (linear.h): fp32 operands
// holding the activation dtype's values under --bf16 / --fp16, where the device's table picks the native path.
std::optional<DType> native_dtype(const Tensor& weight_VI) {
  if (weight_VI.dtype() != DType::kF32 || linear_quantization(weight_VI.device()) != nullptr) return std::nullopt;
  return detail::native_gemm_dtype(weight_VI.device());
}

// t's values in `dtype` (exact: they are values of that format); a tensor of that dtype already is itself.
Tensor narrowed(const Tensor& t, const DType dtype, const std::vector<int64_t>& shape) {
  if (t.dtype() == dtype) return t.view(shape);
  Tensor out = Tensor::uninitialized(shape, dtype, MemCategory::kOther, t.device());
  convert(out, t);
  return out;
}

}  // namespace

int64_t linear_cross_entropy_chunk_rows(const int64_t T, const int64_t V_local, const int64_t budget_bytes,
                                        const int64_t logit_bytes) {
  check(logit_bytes > 0, "logit_bytes must be positive, got " + std::to_string(logit_bytes));
  int64_t rows = budget_bytes / (logit_bytes * std::max<int64_t>(V_local, 1));
  // A multiple of the GEMM kernels' row blocking: oneDNN's bf16 matmul on AMX ran 522-row chunks at half the rate
  // per row of 512-row ones (bench/RESULTS.md); the fp32 sgemm ran 166 rows as fast per row as 160 (hidden 192,
  // vocabulary 50304), where rounding down to 128 cost it 8% a row.
  const int64_t multiple = logit_bytes == 2 ? 64 : 16;
  if (rows >= multiple) rows -= rows % multiple;
  return std::clamp<int64_t>(rows, 1, std::max<int64_t>(T, 1));
}

int64_t linear_cross_entropy_logit_bytes(const Tensor& weight_VI, const bool vocab_split) {
  check(weight_VI.defined(), "weight_VI is undefined");
  if (!vocab_split && native_dtype(weight_VI)) return 2;
  return static_cast<int64_t>(dtype_size(weight_VI.dtype()));
}

void linear_cross_entropy(Tensor& losses_T, const Tensor& input_16_TI, const Tensor& weight_VI,
                          const std::span<const int32_t> targets_T, const int64_t chunk_rows, const Tensor* dlosses_T,
                          Tensor* dinput_16_TI, Tensor* dweight_VI, const VocabShard* shard) {
  // The native 16-bit GEMMs read the 16-bit weight and input once for every chunk (the linear layers' path would
  // narrow the whole weight again for each chunk's GEMMs). Every other op reads fp32: a 16-bit input and its
  // gradient are staged (staging.h).
  const std::optional<DType> native = native_dtype(weight_VI);
  detail::Staging staging;
  const Tensor& input_TI = native && input_16_TI.dtype() == *native ? input_16_TI : staging.in(input_16_TI);
  Tensor* dinput_TI = staging.out(dinput_16_TI);
  check(weight_VI.defined() && weight_VI.ndim() == 2, "weight_VI must be a matrix");
  check(chunk_rows > 0, "chunk_rows must be positive, got " + std::to_string(chunk_rows));
  const DType dtype = weight_VI.dtype();
  const auto T = static_cast<int64_t>(targets_T.size());
  const int64_t Vl = weight_VI.dim(0), I = weight_VI.dim(1);
  check_numel(input_TI, "input_TI", T * I, native && input_TI.dtype() == *native ? *native : dtype);
  check_numel(losses_T, "losses_T", T, dtype);
  if (dlosses_T) check_numel(*dlosses_T, "dlosses_T", T, dtype);
  if (dinput_TI) check_numel(*dinput_TI, "dinput_TI", T * I, dtype);
  if (dweight_VI) check_numel(*dweight_VI, "dweight_VI", Vl * I, dtype);
  check(dlosses_T != nullptr || (dinput_TI == nullptr && dweight_VI == nullptr),
        "gradients requested without dlosses_T");
  const bool split = shard != nullptr && shard->reduce_max;
  if (split) check(shard->reduce_sum != nullptr, "a vocabulary shard needs both reductions");
  if (T == 0) return;

  const Tensor x_TI = native ? narrowed(input_TI, *native, {T, I}) : input_TI.view({T, I});
  Tensor weight16_VI;
  if (native) {
    const Tensor kept = cached_weight_cast(weight_VI, *native);  // the step's cast (weight_casts.h), if kept
    weight16_VI = kept.defined() ? kept.view({Vl, I}) : narrowed(weight_VI, *native, {Vl, I});
  }
  const Tensor& gemm_weight_VI = native ? weight16_VI : weight_VI;
  Tensor loss_T = losses_T.view({T});
  const DType act = activation_dtype(input_TI.device());
  const kernels::ActivationRounding rounding = dtype != DType::kF32  ? kernels::ActivationRounding::kNone
                                               : act == DType::kBF16 ? kernels::ActivationRounding::kBF16
                                               : act == DType::kF16  ? kernels::ActivationRounding::kF16
                                                                     : kernels::ActivationRounding::kNone;
  // The logits chunk: a workspace of this op, read and rewritten by the loss and the GEMMs of each chunk. On the
  // native 16-bit GEMMs without a vocabulary split it holds the GEMM's 16-bit logits, which the loss's one pass over
  // each row (cross_entropy_fused16) replaces with their 16-bit gradient; otherwise it stays fp32 under 16-bit
  // activations too (16-bit storage would add a staged fp32 copy for each op), the loss and gradient one pass
  // (cross_entropy_fused, which rounds the logits and the gradient as the unfused ops do) where the vocabulary is
  // whole.
  const bool logits16 = native && !split;
  // cross_entropy_fused rounds the fp32 logits as it reads each row: a rounding pass of the linear layer's over the
  // whole chunk before it would give the same values for one more trip through memory.
  const bool logits_rounded_by_loss = !logits16 && !split && rounding != kernels::ActivationRounding::kNone &&
                                      linear_quantization(input_TI.device()) == nullptr;
  Tensor logits_buffer = Tensor::uninitialized({std::min(chunk_rows, T), Vl}, logits16 ? *native : dtype,
                                               MemCategory::kActivations, input_TI.device());
  for (int64_t t0 = 0; t0 < T; t0 += chunk_rows) {
    const int64_t t1 = std::min(T, t0 + chunk_rows), n = t1 - t0;
    const std::span<const int32_t> targets_n = targets_T.subspan(static_cast<size_t>(t0), static_cast<size_t>(n));
    const Tensor x_nI = x_TI.slice_rows(t0, t1);
    Tensor logits_nV = logits_buffer.slice_rows(0, n);
    {
      std::optional<ScopedActivationDType> unrounded;
      if (logits_rounded_by_loss) unrounded.emplace(DType::kF32, input_TI.device());
      linear_forward(logits_nV, x_nI, gemm_weight_VI);
    }
    Tensor loss_n = loss_T.slice_rows(t0, t1);
    Tensor lse_n({n}, dtype, MemCategory::kActivations, input_TI.device());
    Tensor dloss_n;
    if (dlosses_T != nullptr) dloss_n = dlosses_T->view({T}).slice_rows(t0, t1);
    Tensor dlogits_nV = logits_nV;  // the gradient overwrites the logits
    if (split) {
      if (native) detail::round_activations({&logits_nV});  // as the linear layers round their native outputs
      Tensor max_n({n}, dtype, MemCategory::kActivations, input_TI.device());
      vocab_ce_local_max(max_n, logits_nV);
      shard->reduce_max(max_n);
      Tensor stats_2n({2 * n}, dtype, MemCategory::kActivations, input_TI.device());
      vocab_ce_local_stats(stats_2n, logits_nV, max_n, targets_n, shard->V, shard->vocab_begin);
      shard->reduce_sum(stats_2n);
      vocab_ce_finish(loss_n, lse_n, max_n, stats_2n);
      if (dlosses_T == nullptr) continue;
      vocab_ce_backward(logits_nV, dloss_n, logits_nV, lse_n, targets_n, shard->vocab_begin);
      if (native) dlogits_nV = narrowed(logits_nV, *native, {n, Vl});
    } else if (logits16) {
      detail::with_kernels(kOp, input_TI.device(), [&](auto k) {
        k.cross_entropy_fused16(loss_n.data<float>(), lse_n.data<float>(), logits_nV.data<uint16_t>(),
                                dlosses_T != nullptr ? dloss_n.data<float>() : nullptr, targets_n.data(), rounding, n,
                                Vl);
      });
      if (dlosses_T == nullptr) continue;
    } else {
      detail::dispatch(kOp, logits_nV, [&]<typename S>(auto k) {
        k.cross_entropy_fused(detail::ptr<S>(loss_n), detail::ptr<S>(lse_n), detail::ptr<S>(logits_nV),
                              dlosses_T != nullptr ? detail::ptr<S>(dloss_n) : nullptr, nullptr, targets_n.data(),
                              rounding, n, Vl);
      });
      if (dlosses_T == nullptr) continue;
    }
    Tensor dx_nI;
    if (dinput_TI) dx_nI = dinput_TI->view({T, I}).slice_rows(t0, t1);
    linear_backward(dinput_TI ? &dx_nI : nullptr, dweight_VI, nullptr, dlogits_nV, &x_nI, gemm_weight_VI);
    if (native && dinput_TI) detail::round_activations({&dx_nI});
  }
}

}  // namespace moecore::ops
