#include "moecore/ops/precision.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "moecore/kernels/cpu/convert.h"

namespace moecore::ops {
namespace {

std::atomic<int> scoped_dtype{static_cast<int>(DType::kF32)};

// Rounds in chunks through the vectorised conversions of kernels/cpu/convert.h (bit for bit the scalar functions of
// dtype.h): narrow a chunk to 16-bit bits, widen it back.
template <void (*Encode)(uint16_t*, const float*, int64_t, kernels::cpu::ConvertIsa),
          void (*Decode)(float*, const uint16_t*, int64_t, kernels::cpu::ConvertIsa)>
void round_all(float* data, const int64_t n) {
  constexpr int64_t kChunk = 2048;
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  const kernels::cpu::ConvertIsa isa = kernels::cpu::best_convert_isa();
#pragma omp parallel for schedule(static) if (n > (1 << 16))
  for (int64_t c = 0; c < chunks; ++c) {
    uint16_t bits[kChunk];
    const int64_t begin = c * kChunk, len = std::min(kChunk, n - begin);
    Encode(bits, data + begin, len, isa);
    Decode(data + begin, bits, len, isa);
  }
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
  using kernels::cpu::decode_bf16, kernels::cpu::decode_fp16, kernels::cpu::encode_bf16, kernels::cpu::encode_fp16;
  if (dtype == DType::kBF16) return round_all<encode_bf16, decode_bf16>(t.data<float>(), t.numel());
  if (dtype == DType::kF16) return round_all<encode_fp16, decode_fp16>(t.data<float>(), t.numel());
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
