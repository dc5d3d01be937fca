// Where a tensor's storage lives. Each device has an allocator (tensor/allocator.h) and a kernel table
// (ops/device.h); ops dispatch on their tensors' device.
//   kCPU        the fast CPU kernels (OpenMP, oneDNN, run-time vector paths)
//   kReference  the naive reference kernels on host memory, every allocation fenced by guard bytes that are checked
//               when it is freed (and by the op-test harness after every op): proof that no kernel writes outside
//               its outputs
//   kCUDA       named for an accelerator backend; this build has no allocator or kernels for it
#pragma once

#include <cstdint>
#include <string_view>

namespace moecore {

enum class Device : uint8_t { kCPU, kReference, kCUDA };

constexpr std::string_view device_name(const Device device) {
  switch (device) {
    case Device::kCPU: return "cpu";
    case Device::kReference: return "reference";
    case Device::kCUDA: return "cuda";
  }
  return "unknown";
}

// Whether the host may read and write the device's memory directly (the CPU and the reference device).
constexpr bool host_accessible(const Device device) { return device != Device::kCUDA; }

}  // namespace moecore
