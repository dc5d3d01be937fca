#include "moecore/tensor/allocator.h"

#include <malloc.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <new>
#include <stdexcept>

namespace moecore {
namespace {

size_t round_up_64(const size_t bytes) { return (bytes + 63) / 64 * 64; }

class CpuAllocator final : public Allocator {
 public:
  CpuAllocator() {
    // Training allocates and frees the same large activation buffers every step. glibc serves blocks above its mmap
    // threshold with fresh mappings, which page-fault on every first touch; keeping them in the heap lets each step
    // reuse the previous step's pages.
    mallopt(M_MMAP_THRESHOLD, 1 << 30);
    mallopt(M_TRIM_THRESHOLD, 1 << 30);
  }
  std::byte* allocate(const size_t bytes) override {
    const size_t rounded = round_up_64(bytes == 0 ? 1 : bytes);
    auto* data = static_cast<std::byte*>(std::aligned_alloc(64, rounded));
    if (data == nullptr) throw std::bad_alloc();
    std::memset(data, 0, rounded);
    return data;
  }
  std::byte* allocate_uninitialized(const size_t bytes) override {
    auto* data = static_cast<std::byte*>(std::aligned_alloc(64, round_up_64(bytes == 0 ? 1 : bytes)));
    if (data == nullptr) throw std::bad_alloc();
    return data;
  }
  void deallocate(std::byte* data, size_t) noexcept override { std::free(data); }
  std::string outside_writes(const std::byte*, size_t) const override { return ""; }
};

// Every allocation sits between two guards of known bytes, as ggml's test-backend-ops fences its buffers: the front
// guard keeps the data 64-byte aligned, the back guard starts at the allocation's last byte + 1 (no rounding slack
// where a one-element overrun could hide).
class GuardedAllocator final : public Allocator {
 public:
  static constexpr size_t kGuardBytes = 64;
  static constexpr auto kGuardByte = std::byte{0xA5};

  std::byte* allocate(const size_t bytes) override {
    const size_t total = round_up_64(kGuardBytes + bytes + kGuardBytes);
    auto* block = static_cast<std::byte*>(std::aligned_alloc(64, total));
    if (block == nullptr) throw std::bad_alloc();
    std::memset(block, static_cast<int>(kGuardByte), total);
    std::byte* data = block + kGuardBytes;
    std::memset(data, 0, bytes);
    return data;
  }
  // All bits set: NaN in every float format, so a kernel that reads memory it was to overwrite shows in its result.
  std::byte* allocate_uninitialized(const size_t bytes) override {
    std::byte* data = allocate(bytes);
    std::memset(data, 0xFF, bytes);
    return data;
  }
  void deallocate(std::byte* data, const size_t bytes) noexcept override {
    if (const std::string problem = outside_writes(data, bytes); !problem.empty()) {
      std::fprintf(stderr, "error: reference device: %s\n", problem.c_str());
      std::abort();
    }
    std::free(data - kGuardBytes);
  }
  std::string outside_writes(const std::byte* data, const size_t bytes) const override {
    const std::byte* front = data - kGuardBytes;
    for (size_t i = 0; i < kGuardBytes; ++i) {
      if (front[i] != kGuardByte) {
        return "a kernel wrote " + std::to_string(kGuardBytes - i) + " bytes before the start of a " +
               std::to_string(bytes) + "-byte allocation";
      }
    }
    const std::byte* back = data + bytes;
    const size_t back_bytes = round_up_64(kGuardBytes + bytes + kGuardBytes) - kGuardBytes - bytes;
    for (size_t i = back_bytes; i-- > 0;) {
      if (back[i] != kGuardByte) {
        return "a kernel wrote " + std::to_string(i + 1) + " bytes past the end of a " + std::to_string(bytes) +
               "-byte allocation";
      }
    }
    return "";
  }
};

}  // namespace

Allocator& allocator_for(const Device device) {
  switch (device) {
    case Device::kCPU: {
      static CpuAllocator cpu;
      return cpu;
    }
    case Device::kReference: {
      static GuardedAllocator reference;
      return reference;
    }
    case Device::kCUDA: break;
  }
  throw std::runtime_error("cannot allocate a tensor on " + std::string(device_name(device)) +
                           ": this build of moecore has no allocator for it");
}

}  // namespace moecore
