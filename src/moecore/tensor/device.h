// Where a tensor's storage lives. Ops dispatch on it (src/moecore/ops/backend.h); this build allocates on the CPU
// only, and the enum leaves room for an accelerator backend.
#pragma once

#include <cstdint>
#include <string_view>

namespace moecore {

enum class Device : uint8_t { kCPU, kCUDA };

constexpr std::string_view device_name(const Device device) {
  switch (device) {
    case Device::kCPU: return "cpu";
    case Device::kCUDA: return "cuda";
  }
  return "unknown";
}

}  // namespace moecore
