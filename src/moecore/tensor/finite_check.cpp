#include "moecore/tensor/finite_check.h"

#include <cmath>
#include <stdexcept>

namespace moecore {
namespace {

template <typename T, typename ToDouble>
std::optional<NonFiniteElement> scan(const Tensor& x, ToDouble to_double) {
  const T* data = x.data<T>();
  const int64_t n = x.numel();
  for (int64_t i = 0; i < n; ++i) {
    const double value = to_double(data[i]);
    if (!std::isfinite(value)) return NonFiniteElement{i, value};
  }
  return std::nullopt;
}

}  // namespace

std::optional<NonFiniteElement> first_nonfinite(const Tensor& x) {
  if (!x.defined()) return std::nullopt;
  switch (x.dtype()) {
    case DType::kF32: return scan<float>(x, [](const float v) { return static_cast<double>(v); });
    case DType::kF64: return scan<double>(x, [](const double v) { return v; });
    case DType::kBF16:
      return scan<uint16_t>(x, [](const uint16_t bits) { return static_cast<double>(bf16_to_fp32(bits)); });
    case DType::kF16:
      return scan<uint16_t>(x, [](const uint16_t bits) { return static_cast<double>(fp16_to_fp32(bits)); });
    default: return std::nullopt;
  }
}

std::string nonfinite_name(const double value) {
  if (std::isnan(value)) return "NaN";
  return value > 0 ? "Inf" : "-Inf";
}

void require_finite(const Tensor& x, const std::string& name) {
  if (const std::optional<NonFiniteElement> bad = first_nonfinite(x)) {
    throw std::runtime_error(name + " holds a non-finite value (" + nonfinite_name(bad->value) + ") at element " +
                             std::to_string(bad->index));
  }
}

}  // namespace moecore
