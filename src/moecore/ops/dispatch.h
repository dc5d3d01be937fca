// Internal to src/moecore/ops: routes an op to the kernel table of its tensors' device (ops/device.h).
// Usage inside an op:  dispatch("linear_forward", out, [&]<typename T>(auto k) { k.linear_forward(ptr<T>(out), ...);
// }); `k` is the device's table, whose static members forward to kernels::cpu (Device::kCPU) or kernels::ref
// (Device::kReference). Ops on other dtypes (16-bit, quantized) take the table with with_kernels().
#pragma once

#include <cstdint>
#include <initializer_list>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>

#include "moecore/kernels/cpu/activation.h"
#include "moecore/kernels/cpu/adamw.h"
#include "moecore/kernels/cpu/attention.h"
#include "moecore/kernels/cpu/convert.h"
#include "moecore/kernels/cpu/dropout.h"
#include "moecore/kernels/cpu/elementwise.h"
#include "moecore/kernels/cpu/expert_activation.h"
#include "moecore/kernels/cpu/expert_rows.h"
#include "moecore/kernels/cpu/gemm.h"
#include "moecore/kernels/cpu/gemm_lowp.h"
#include "moecore/kernels/cpu/grouped_mlp.h"
#include "moecore/kernels/cpu/input_jitter.h"
#include "moecore/kernels/cpu/loss.h"
#include "moecore/kernels/cpu/norm.h"
#include "moecore/kernels/cpu/normal_fill.h"
#include "moecore/kernels/cpu/permute.h"
#include "moecore/kernels/cpu/rope.h"
#include "moecore/kernels/cpu/routing.h"
#include "moecore/kernels/cpu/routing_padding.h"
#include "moecore/kernels/cpu/rows.h"
#include "moecore/kernels/cpu/vocab_parallel.h"
#include "moecore/ops/device.h"
#include "moecore/ops/staging.h"
#include "moecore/quant/quantized_gemm.h"
#include "moecore/tensor/tensor.h"

namespace moecore::ops::detail {

#define MOECORE_KERNEL_TABLE(Name, ns, device)       \
  struct Name {                                      \
    static constexpr Device kDevice = device;        \
    MOECORE_FORWARD(ns, gemm)                        \
    MOECORE_FORWARD(ns, linear_forward)              \
    MOECORE_FORWARD(ns, linear_backward)             \
    MOECORE_FORWARD(ns, rmsnorm_forward)             \
    MOECORE_FORWARD(ns, rmsnorm_backward)            \
    MOECORE_FORWARD(ns, layernorm_forward)           \
    MOECORE_FORWARD(ns, layernorm_backward)          \
    MOECORE_FORWARD(ns, rope_forward)                \
    MOECORE_FORWARD(ns, rope_backward)               \
    MOECORE_FORWARD(ns, attention_forward)           \
    MOECORE_FORWARD(ns, attention_backward)          \
    MOECORE_FORWARD(ns, attention_merge)             \
    MOECORE_FORWARD(ns, swiglu_forward)              \
    MOECORE_FORWARD(ns, swiglu_backward)             \
    MOECORE_FORWARD(ns, gelu_forward)                \
    MOECORE_FORWARD(ns, gelu_backward)               \
    MOECORE_FORWARD(ns, squared_relu_forward)        \
    MOECORE_FORWARD(ns, squared_relu_backward)       \
    MOECORE_FORWARD(ns, weighted_swiglu_forward)     \
    MOECORE_FORWARD(ns, weighted_swiglu_backward)    \
    MOECORE_FORWARD(ns, dropout_forward)             \
    MOECORE_FORWARD(ns, dropout_backward)            \
    MOECORE_FORWARD(ns, cross_entropy_forward)       \
    MOECORE_FORWARD(ns, cross_entropy_backward)      \
    MOECORE_FORWARD(ns, cross_entropy_fused)         \
    MOECORE_FORWARD(ns, cross_entropy_fused16)       \
    MOECORE_FORWARD(ns, vocab_embedding_forward)     \
    MOECORE_FORWARD(ns, vocab_embedding_backward)    \
    MOECORE_FORWARD(ns, vocab_ce_local_max)          \
    MOECORE_FORWARD(ns, vocab_ce_local_stats)        \
    MOECORE_FORWARD(ns, vocab_ce_finish)             \
    MOECORE_FORWARD(ns, vocab_ce_backward)           \
    MOECORE_FORWARD(ns, adamw_step)                  \
    MOECORE_FORWARD(ns, add_inplace)                 \
    MOECORE_FORWARD(ns, scale_inplace)               \
    MOECORE_FORWARD(ns, sum_squares)                 \
    MOECORE_FORWARD(ns, sum_squares_each)            \
    MOECORE_FORWARD(ns, all_finite)                  \
    MOECORE_FORWARD(ns, count_zeros)                 \
    MOECORE_FORWARD(ns, split_qkv)                   \
    MOECORE_FORWARD(ns, merge_qkv)                   \
    MOECORE_FORWARD(ns, copy_columns)                \
    MOECORE_FORWARD(ns, add_bias_rows)               \
    MOECORE_FORWARD(ns, bias_grad_rows)              \
    MOECORE_FORWARD(ns, scale_rows)                  \
    MOECORE_FORWARD(ns, scale_rows_backward)         \
    MOECORE_FORWARD(ns, add_outer)                   \
    MOECORE_FORWARD(ns, add_outer_backward)          \
    MOECORE_FORWARD(ns, row_dot)                     \
    MOECORE_FORWARD(ns, sigmoid_forward)             \
    MOECORE_FORWARD(ns, sigmoid_backward)            \
    MOECORE_FORWARD(ns, gather_rows)                 \
    MOECORE_FORWARD(ns, scatter_add_rows)            \
    MOECORE_FORWARD(ns, add_position_embedding)      \
    MOECORE_FORWARD(ns, position_embedding_backward) \
    MOECORE_FORWARD(ns, linear_forward_lowp)         \
    MOECORE_FORWARD(ns, linear_backward_lowp)        \
    MOECORE_FORWARD(ns, lowp_gemm_native)            \
    MOECORE_FORWARD(ns, gemm_library)                \
    MOECORE_FORWARD(ns, gemm_lowp_library)           \
    MOECORE_FORWARD(ns, encode_bf16)                 \
    MOECORE_FORWARD(ns, encode_fp16)                 \
    MOECORE_FORWARD(ns, decode_bf16)                 \
    MOECORE_FORWARD(ns, decode_fp16)                 \
    MOECORE_FORWARD(ns, round_bf16)                  \
    MOECORE_FORWARD(ns, round_fp16)                  \
    MOECORE_FORWARD(ns, abs_max)                     \
    MOECORE_QUANTIZED(quantized_fprop)               \
    MOECORE_QUANTIZED(quantized_dgrad)               \
    MOECORE_QUANTIZED(quantized_wgrad)               \
    MOECORE_QUANTIZED(quantize_wgrad_input)          \
    MOECORE_QUANTIZED(quantized_wgrad_saved)         \
    MOECORE_FORWARD(ns, topk_routing_forward)        \
    MOECORE_FORWARD(ns, topk_routing_backward)       \
    MOECORE_FORWARD(ns, sinkhorn)                    \
    MOECORE_FORWARD(ns, routing_map)                 \
    MOECORE_FORWARD(ns, aux_scores_forward)          \
    MOECORE_FORWARD(ns, aux_scores_backward)         \
    MOECORE_FORWARD(ns, aux_loss_sums)               \
    MOECORE_FORWARD(ns, switch_loss)                 \
    MOECORE_FORWARD(ns, switch_loss_backward)        \
    MOECORE_FORWARD(ns, z_loss_forward)              \
    MOECORE_FORWARD(ns, z_loss_backward)             \
    MOECORE_FORWARD(ns, expert_bias_update)          \
    MOECORE_FORWARD(ns, input_jitter_forward)        \
    MOECORE_FORWARD(ns, input_jitter_backward)       \
    MOECORE_FORWARD(ns, pad_routing_map)             \
    MOECORE_FORWARD(ns, expert_routed_counts)        \
    MOECORE_FORWARD(ns, expert_major_rows)           \
    MOECORE_FORWARD(ns, moe_unpermute)               \
    MOECORE_FORWARD(ns, moe_unpermute_backward)      \
    MOECORE_FORWARD(ns, sort_chunks)                 \
    MOECORE_FORWARD(ns, unsort_chunks)               \
    MOECORE_FORWARD(ns, grouped_mlp_forward)         \
    MOECORE_FORWARD(ns, grouped_mlp_backward)        \
    MOECORE_FORWARD(ns, normal_fill)                 \
  };
#define MOECORE_FORWARD(ns, name)                          \
  template <typename... Args>                              \
  static decltype(auto) name(Args&&... args) {             \
    return kernels::ns::name(std::forward<Args>(args)...); \
  }
// The quantized GEMMs (TransformerEngine's numerics, quant/) serve both host devices: they are their own reference,
// staging their quantized operands on the table's device.
#define MOECORE_QUANTIZED(name)                               \
  template <typename... Args>                                 \
  static decltype(auto) name(Args&&... args) {                \
    return quant::name(std::forward<Args>(args)..., kDevice); \
  }
MOECORE_KERNEL_TABLE(CpuKernels, cpu, Device::kCPU)
MOECORE_KERNEL_TABLE(RefKernels, ref, Device::kReference)
#undef MOECORE_QUANTIZED
#undef MOECORE_FORWARD
#undef MOECORE_KERNEL_TABLE

// Typed data pointers of required and optional (null) tensors. A bf16 / fp16 tensor read or written as float goes
// through the innermost Staging (staging.h): an exact fp32 copy, or fp32 scratch narrowed when the op ends.
template <typename T>
T* ptr(Tensor& t) {
  if constexpr (std::is_same_v<T, float>) {
    if (is_16bit(t.dtype())) return staged_out(t);
  }
  return t.data<T>();
}
template <typename T>
const T* ptr(const Tensor& t) {
  if constexpr (std::is_same_v<T, float>) {
    if (is_16bit(t.dtype())) return staged_in(t);
  }
  return t.data<T>();
}
template <typename T>
T* opt(Tensor* t) {
  return t == nullptr ? nullptr : ptr<T>(*t);
}
template <typename T>
const T* opt(const Tensor* t) {
  return t == nullptr ? nullptr : ptr<T>(*t);
}

[[noreturn]] void fail(const char* op, const std::string& what);
// Every tensor defined, on one device, of one dtype (fp32 or fp64; bf16 / fp16 activations count as fp32).
void check_tensors(const char* op, std::initializer_list<const Tensor*> tensors);
// t.numel() == expected.
void check_numel(const char* op, const char* name, const Tensor& t, int64_t expected);

// Calls fn(kernel table of `device`).
template <typename Fn>
void with_kernels(const char* op, const Device device, Fn&& fn) {
  switch (device) {
    case Device::kCPU: fn(CpuKernels{}); return;
    case Device::kReference: fn(RefKernels{}); return;
    case Device::kCUDA: break;
  }
  fail(op, "no kernels for device " + std::string(device_name(device)));
}

// Calls fn.template operator()<T>(kernel table) for the dtype of `like` (fp32 or fp64; float for bf16 / fp16
// activations, staged: staging.h) on the table of its device.
template <typename Fn>
void dispatch(const char* op, const Tensor& like, Fn&& fn) {
  with_kernels(op, like.device(), [&](auto kernels) {
    switch (like.dtype()) {
      case DType::kBF16:
      case DType::kF16:
        if (Staging::innermost() == nullptr) {
          const Staging staging;
          fn.template operator()<float>(kernels);
          return;
        }
        [[fallthrough]];
      case DType::kF32: fn.template operator()<float>(kernels); return;
      case DType::kF64: fn.template operator()<double>(kernels); return;
      default: fail(op, "unsupported dtype " + std::string(dtype_name(like.dtype())));
    }
  });
}

}  // namespace moecore::ops::detail
