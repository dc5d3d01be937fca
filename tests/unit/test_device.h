// The device a hand-written op test creates its tensors on: each test loops over kDevices and opens a TestDevice;
// tensor_on and the tests' other helpers then allocate there, so one test body runs on every device.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "moecore/tensor/tensor.h"

namespace moecore::ops::test {

constexpr Device kDevices[] = {Device::kCPU, Device::kReference};

inline Device& test_device() {
  static Device device = Device::kCPU;
  return device;
}

class TestDevice {
 public:
  explicit TestDevice(const Device device) : previous_(test_device()) { test_device() = device; }
  ~TestDevice() { test_device() = previous_; }
  TestDevice(const TestDevice&) = delete;
  TestDevice& operator=(const TestDevice&) = delete;

 private:
  Device previous_;
};

inline Tensor tensor_on(std::vector<int64_t> shape, const DType dtype) {
  return Tensor(std::move(shape), dtype, MemCategory::kOther, test_device());
}

}  // namespace moecore::ops::test
