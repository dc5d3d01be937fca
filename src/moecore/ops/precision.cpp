#include "moecore/ops/precision.h"

#include <array>
#include <atomic>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>

#include "moecore/ops/dispatch.h"
#include "moecore/ops/scoped_state.h"
#include "moecore/ops/staging.h"

namespace moecore::ops {
namespace {

// Per device, so a second device's model can run in its own dtype.
std::array<std::atomic<int>, 3> scoped_dtype{static_cast<int>(DType::kF32), static_cast<int>(DType::kF32),
                                             static_cast<int>(DType::kF32)};

std::atomic<int>& scoped_dtype_of(const Device device) { return scoped_dtype.at(static_cast<size_t>(device)); }

}  // namespace

// The scoped state: the dtype, plus kFp32StorageBit under ActivationStorage::kF32.
constexpr int kFp32StorageBit = 1 << 8;

DType activation_dtype(const Device device) {
  return static_cast<DType>(scoped_dtype_of(device).load() & (kFp32StorageBit - 1));
}

DType activation_storage_dtype(const Device device) {
  const int state = scoped_dtype_of(device).load();
  return (state & kFp32StorageBit) != 0 ? DType::kF32 : static_cast<DType>(state & (kFp32StorageBit - 1));
}

Tensor activation_tensor(std::vector<int64_t> shape) {
  return Tensor(std::move(shape), activation_storage_dtype(), MemCategory::kActivations);
}

Tensor uninitialized_activation(std::vector<int64_t> shape) {
  return Tensor::uninitialized(std::move(shape), activation_storage_dtype(), MemCategory::kActivations);
}

ScopedActivationDType::ScopedActivationDType(const DType dtype, const Device device, const ActivationStorage storage)
    : device_(device) {
  if (dtype != DType::kF32 && dtype != DType::kBF16 && dtype != DType::kF16) {
    throw std::invalid_argument("activation dtype must be float32, bfloat16 or float16, got " +
                                std::string(dtype_name(dtype)));
  }
  previous_ = scoped_dtype_of(device_).exchange(static_cast<int>(dtype) +
                                                (storage == ActivationStorage::kF32 ? kFp32StorageBit : 0));
}

ScopedActivationDType::~ScopedActivationDType() { scoped_dtype_of(device_) = previous_; }

namespace detail {

std::array<int, 3> activation_dtype_state() {
  std::array<int, 3> state{};
  for (size_t d = 0; d < state.size(); ++d) state[d] = scoped_dtype[d].load();
  return state;
}

void restore_activation_dtype_state(const std::array<int, 3>& state) {
  for (size_t d = 0; d < state.size(); ++d) scoped_dtype[d] = state[d];
}

}  // namespace detail

void round_to_dtype_(Tensor& t, const DType dtype) {
  constexpr const char* op = "round_to_dtype_";
  if (dtype == DType::kF32) return;
  if (t.dtype() != DType::kF32) {
    throw std::invalid_argument(std::string(op) + ": expected a float32 tensor, got " +
                                std::string(dtype_name(t.dtype())));
  }
  if (dtype != DType::kBF16 && dtype != DType::kF16) {
    throw std::invalid_argument(std::string(op) + ": cannot round to " + std::string(dtype_name(dtype)));
  }
  detail::with_kernels(op, t.device(), [&](auto k) {
    dtype == DType::kBF16 ? k.round_bf16(t.data<float>(), t.numel()) : k.round_fp16(t.data<float>(), t.numel());
  });
}

namespace detail {

void round_activations(const std::initializer_list<Tensor*> tensors) {
  for (Tensor* t : tensors) {
    if (t == nullptr || !t->defined() || t->dtype() != DType::kF32) continue;
    const DType dtype = activation_dtype(t->device());
    if (const Staging* staging = Staging::innermost(); staging != nullptr && staging->narrows(*t, dtype)) continue;
    if (dtype != DType::kF32) round_to_dtype_(*t, dtype);
  }
}

std::optional<DType> native_gemm_dtype(const Device device) {
  const DType act = activation_dtype(device);
  if (act != DType::kBF16 && act != DType::kF16) return std::nullopt;
  const auto type = act == DType::kBF16 ? kernels::LowpType::kBF16 : kernels::LowpType::kF16;
  bool native = false;
  with_kernels("native_gemm_dtype", device, [&](auto k) { native = k.lowp_gemm_native(type); });
  return native ? std::optional(act) : std::nullopt;
}

}  // namespace detail
}  // namespace moecore::ops
