// The dtype of a model's activations. Under --bf16 / --fp16 Megatron runs every module in 16 bits (Float16Module):
// each kernel reads 16-bit inputs, computes in fp32 (GEMMs accumulate in fp32, norms, softmax and attention keep
// fp32 statistics) and writes a 16-bit output. moecore's ops compute in fp32 and, while a ScopedActivationDType of
// bf16 or fp16 is live, round every activation they write, and every activation gradient, to that dtype (round to
// nearest even; fp16 overflows to Inf, which the loss scaler catches), so the values a layer hands to the next are
// exactly the 16-bit values Megatron's would be, up to summation order. What stays fp32, as in Megatron: weight and
// bias gradients (accumulated into fp32 main gradients), per-row statistics (norm rstd / mean, attention and
// cross-entropy log-sum-exps), losses, and everything outside the scope (the router with --moe-router-dtype, the
// optimizer). fp64 tensors (tests) are never rounded.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <vector>

#include "moecore/tensor/dtype.h"
#include "moecore/tensor/tensor.h"

namespace moecore::ops {

// kF32 (no rounding), kBF16 or kF16: the innermost live ScopedActivationDType of `device`, else kF32.
DType activation_dtype(Device device = Device::kCPU);

// Where the rounded activations live. k16Bit (Megatron's Float16Module): activations, saved tensors, activation
// gradients and communication buffers are bf16 / fp16 tensors, 2 bytes an element; ops read them into fp32 and narrow
// what they write (ops/staging.h). kF32: fp32 tensors that hold 16-bit values (the same numbers, twice the bytes;
// tests compare the two bit for bit).
enum class ActivationStorage : uint8_t { k16Bit, kF32 };

// fp32, bf16 or fp16: a dtype activations may be stored in.
inline bool activation_storage(const DType dtype) {
  return dtype == DType::kF32 || dtype == DType::kBF16 || dtype == DType::kF16;
}

// The dtype model code allocates activations in: activation_dtype(device) under k16Bit storage, else kF32.
DType activation_storage_dtype(Device device = Device::kCPU);

// A CPU activation of `shape` in activation_storage_dtype(), counted as MemCategory::kActivations: zero-filled, or
// uninitialized for the output of an op that overwrites every element.
Tensor activation_tensor(std::vector<int64_t> shape);
Tensor uninitialized_activation(std::vector<int64_t> shape);

// Sets the activation dtype of the ops on `device` until destroyed (for every thread, so OpenMP workers agree; nests
// and restores the previous one; create and destroy it on one thread, outside parallel regions).
// std::invalid_argument for other dtypes.
class ScopedActivationDType {
 public:
  explicit ScopedActivationDType(DType dtype, Device device = Device::kCPU,
                                 ActivationStorage storage = ActivationStorage::k16Bit);
  ~ScopedActivationDType();
  ScopedActivationDType(const ScopedActivationDType&) = delete;
  ScopedActivationDType& operator=(const ScopedActivationDType&) = delete;

 private:
  Device device_;
  int previous_;
};

// Rounds every element of an fp32 tensor to the nearest value of `dtype` (kBF16 / kF16; kF32: unchanged), in place.
void round_to_dtype_(Tensor& t, DType dtype);

namespace detail {
// Rounds the fp32 tensors among `tensors` (null entries skipped) to the activation dtype of their device.
void round_activations(std::initializer_list<Tensor*> tensors);
// The 16-bit activation dtype of `device` where its kernel table runs 16-bit GEMMs on the native path
// (kernels/cpu/gemm_lowp.h lowp_gemm_native), else nullopt: the one test the linear layers, the grouped experts and
// the output layer make.
std::optional<DType> native_gemm_dtype(Device device);
}  // namespace detail

}  // namespace moecore::ops
