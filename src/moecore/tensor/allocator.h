// The allocator of each device. Tensors get their storage here; a backend for a new device brings one.
#pragma once

#include <cstddef>
#include <string>

#include "moecore/tensor/device.h"

namespace moecore {

class Allocator {
 public:
  virtual ~Allocator() = default;
  // `bytes` (at least 1) 64-byte aligned, zero-initialised; std::bad_alloc when memory is short.
  virtual std::byte* allocate(size_t bytes) = 0;
  // The same, for memory its user overwrites before reading: not zeroed (a debugging allocator may fill it with a
  // pattern that shows reads of it).
  virtual std::byte* allocate_uninitialized(size_t bytes) { return allocate(bytes); }
  virtual void deallocate(std::byte* data, size_t bytes) noexcept = 0;
  // "" when the allocation is intact; otherwise what was written outside it (reference device only).
  virtual std::string outside_writes(const std::byte* data, size_t bytes) const = 0;
};

// The allocator of `device`; std::runtime_error naming the device when this build has none.
Allocator& allocator_for(Device device);

}  // namespace moecore
