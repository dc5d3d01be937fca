#include "moecore/ops/precision.h"

#include <atomic>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace moecore::ops {
namespace {

std::atomic<int> scoped_dtype{static_cast<int>(DType::kF32)};

template <uint16_t (*Encode)(float), float (*Decode)(uint16_t)>
void round_all(float* data, const int64_t n) {
#pragma omp parallel for schedule(static) if (n > (1 << 16))
  for (int64_t i = 0; i < n; ++i) data[i] = Decode(Encode(data[i]));
}

}  // namespace

DType activation_dtype() { return static_cast<DType>(scoped_dtype.load()); }

ScopedActivationDType::ScopedActivationDType(const DType dtype) {
  if (dtype != DType::kF32 && dtype != DType::kBF16 && dtype != DType::kF16) {
    throw std::invalid_argument("activation dtype must be float32, bfloat16 or float16, got " +
                                std::string(dtype_name(dtype)));
  }
  previous_ = scoped_dtype.exchange(static_cast<int>(dtype));
}

ScopedActivationDType::~ScopedActivationDType() { scoped_dtype = previous_; }

void round_to_dtype_(Tensor& t, const DType dtype) {
  if (dtype == DType::kF32) return;
  if (t.dtype() != DType::kF32) {
    throw std::invalid_argument("round_to_dtype_: expected a float32 tensor, got " +
                                std::string(dtype_name(t.dtype())));
  }
  if (dtype == DType::kBF16) return round_all<fp32_to_bf16, bf16_to_fp32>(t.data<float>(), t.numel());
  if (dtype == DType::kF16) return round_all<fp32_to_fp16, fp16_to_fp32>(t.data<float>(), t.numel());
  throw std::invalid_argument("round_to_dtype_: cannot round to " + std::string(dtype_name(dtype)));
}

namespace detail {

void round_activations(const std::initializer_list<Tensor*> tensors) {
  const DType dtype = activation_dtype();
  if (dtype == DType::kF32) return;
  for (Tensor* t : tensors) {
    if (t != nullptr && t->defined() && t->dtype() == DType::kF32) round_to_dtype_(*t, dtype);
  }
}

}  // namespace detail
}  // namespace moecore::ops
