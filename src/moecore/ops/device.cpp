#include "moecore/ops/device.h"

#include <stdexcept>
#include <string>

namespace moecore::ops {

bool supports(const std::string_view op, const DType dtype, const Device device) {
  if (device != Device::kCPU && device != Device::kReference) return false;
  switch (dtype) {
    case DType::kF32:
    case DType::kF64: return true;
    case DType::kBF16:
    case DType::kF16:
      return op == "linear_forward" || op == "linear_backward" || op == "convert" || op == "round_to_dtype_";
    default: return false;
  }
}

void synchronize(const Device device) {
  if (device == Device::kCUDA) {
    throw std::runtime_error("cannot synchronize " + std::string(device_name(device)) + ": no kernels for it");
  }
}

}  // namespace moecore::ops
