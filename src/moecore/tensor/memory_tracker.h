// Counts live and peak bytes per category, so the trainer can report where memory goes; activations are also
// counted per model part (the ActivationOwnerScope active when they were allocated), with each part's share at the
// moment the activations peaked.
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string_view>

#include "moecore/tensor/device.h"

namespace moecore {

enum class MemCategory : uint8_t { kParams, kGrads, kOptimizer, kActivations, kComm, kOther, kCount };

std::string_view mem_category_name(MemCategory category);

enum class ActivationOwner : uint8_t { kEmbedding, kAttention, kMlp, kMoE, kOutputLoss, kOther, kCount };

std::string_view activation_owner_name(ActivationOwner owner);  // "attention", "output layer + loss", ...

class MemoryTracker {
 public:
  static constexpr size_t kOwners = static_cast<size_t>(ActivationOwner::kCount);

  // Each device has its own tracker: the bytes of one device never mix with another's.
  static MemoryTracker& instance(Device device = Device::kCPU);

  // Returns the owner the bytes are counted under (the current one); on_free takes it back.
  ActivationOwner on_alloc(MemCategory category, size_t bytes);
  void on_free(MemCategory category, ActivationOwner owner, size_t bytes);

  int64_t current(MemCategory category) const;
  int64_t peak(MemCategory category) const;
  int64_t current_total() const;
  int64_t peak_total() const;
  // Activation bytes per owner when the activations last reached peak(kActivations).
  std::array<int64_t, kOwners> activations_at_peak() const;
  void reset_peaks();  // peaks := current

  // The owner of activations allocated from now on, by any thread (the model runs one forward or backward at a
  // time; its OpenMP workers allocate on its behalf).
  ActivationOwner owner() const { return owner_.load(std::memory_order_relaxed); }
  void set_owner(ActivationOwner owner) { owner_.store(owner, std::memory_order_relaxed); }

 private:
  static constexpr size_t kNum = static_cast<size_t>(MemCategory::kCount);
  std::array<std::atomic<int64_t>, kNum> current_{};
  std::array<std::atomic<int64_t>, kNum> peak_{};
  std::atomic<int64_t> current_total_{0};
  std::atomic<int64_t> peak_total_{0};
  std::atomic<ActivationOwner> owner_{ActivationOwner::kOther};
  std::array<std::atomic<int64_t>, kOwners> activations_{};
  mutable std::mutex peak_mutex_;  // guards activations_at_peak_
  std::array<int64_t, kOwners> activations_at_peak_{};
};

// Activations allocated while this lives belong to `owner`; the previous owner is restored after.
class ActivationOwnerScope {
 public:
  explicit ActivationOwnerScope(const ActivationOwner owner) : previous_(MemoryTracker::instance().owner()) {
    MemoryTracker::instance().set_owner(owner);
  }
  ~ActivationOwnerScope() { MemoryTracker::instance().set_owner(previous_); }
  ActivationOwnerScope(const ActivationOwnerScope&) = delete;
  ActivationOwnerScope& operator=(const ActivationOwnerScope&) = delete;

 private:
  ActivationOwner previous_;
};

}  // namespace moecore
