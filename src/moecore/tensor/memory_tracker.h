// Counts live and peak bytes per category, so the trainer can report where memory goes.
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string_view>

namespace moecore {

enum class MemCategory : uint8_t { kParams, kGrads, kOptimizer, kActivations, kComm, kOther, kCount };

std::string_view mem_category_name(MemCategory category);

class MemoryTracker {
 public:
  static MemoryTracker& instance();

  void on_alloc(MemCategory category, size_t bytes);
  void on_free(MemCategory category, size_t bytes);

  int64_t current(MemCategory category) const;
  int64_t peak(MemCategory category) const;
  int64_t current_total() const;
  int64_t peak_total() const;
  void reset_peaks();  // peaks := current

 private:
  static constexpr size_t kNum = static_cast<size_t>(MemCategory::kCount);
  std::array<std::atomic<int64_t>, kNum> current_{};
  std::array<std::atomic<int64_t>, kNum> peak_{};
  std::atomic<int64_t> current_total_{0};
  std::atomic<int64_t> peak_total_{0};
};

}  // namespace moecore
