#include "moecore/tensor/memory_tracker.h"

namespace moecore {
namespace {
// Raises peak to value; true when it did.
bool raise_to(std::atomic<int64_t>& peak, const int64_t value) {
  int64_t seen = peak.load(std::memory_order_relaxed);
  while (value > seen) {
    if (peak.compare_exchange_weak(seen, value, std::memory_order_relaxed)) return true;
  }
  return false;
}
}  // namespace

std::string_view mem_category_name(const MemCategory category) {
  switch (category) {
    case MemCategory::kParams: return "params";
    case MemCategory::kGrads: return "grads";
    case MemCategory::kOptimizer: return "optimizer";
    case MemCategory::kActivations: return "activations";
    case MemCategory::kComm: return "comm";
    case MemCategory::kOther: return "other";
    case MemCategory::kCount: break;
  }
  return "unknown";
}

std::string_view activation_owner_name(const ActivationOwner owner) {
  switch (owner) {
    case ActivationOwner::kEmbedding: return "embedding";
    case ActivationOwner::kAttention: return "attention";
    case ActivationOwner::kMlp: return "mlp";
    case ActivationOwner::kMoE: return "moe";
    case ActivationOwner::kOutputLoss: return "output layer + loss";
    case ActivationOwner::kOther: return "other";
    case ActivationOwner::kCount: break;
  }
  return "unknown";
}

MemoryTracker& MemoryTracker::instance(const Device device) {
  static std::array<MemoryTracker, 3> trackers;
  return trackers.at(static_cast<size_t>(device));
}

ActivationOwner MemoryTracker::on_alloc(const MemCategory category, const size_t bytes) {
  const auto i = static_cast<size_t>(category);
  const auto n = static_cast<int64_t>(bytes);
  const ActivationOwner owner = this->owner();
  if (category == MemCategory::kActivations) activations_[static_cast<size_t>(owner)].fetch_add(n);
  if (raise_to(peak_[i], current_[i].fetch_add(n, std::memory_order_relaxed) + n) &&
      category == MemCategory::kActivations) {
    const std::lock_guard lock(peak_mutex_);
    for (size_t o = 0; o < kOwners; ++o) activations_at_peak_[o] = activations_[o].load();
  }
  raise_to(peak_total_, current_total_.fetch_add(n, std::memory_order_relaxed) + n);
  return owner;
}

void MemoryTracker::on_free(const MemCategory category, const ActivationOwner owner, const size_t bytes) {
  const auto n = static_cast<int64_t>(bytes);
  if (category == MemCategory::kActivations) activations_[static_cast<size_t>(owner)].fetch_sub(n);
  current_[static_cast<size_t>(category)].fetch_sub(n, std::memory_order_relaxed);
  current_total_.fetch_sub(n, std::memory_order_relaxed);
}

int64_t MemoryTracker::current(const MemCategory category) const {
  return current_[static_cast<size_t>(category)].load(std::memory_order_relaxed);
}
int64_t MemoryTracker::peak(const MemCategory category) const {
  return peak_[static_cast<size_t>(category)].load(std::memory_order_relaxed);
}
int64_t MemoryTracker::current_total() const { return current_total_.load(std::memory_order_relaxed); }
int64_t MemoryTracker::peak_total() const { return peak_total_.load(std::memory_order_relaxed); }

std::array<int64_t, MemoryTracker::kOwners> MemoryTracker::activations_at_peak() const {
  const std::lock_guard lock(peak_mutex_);
  return activations_at_peak_;
}

void MemoryTracker::reset_peaks() {
  for (size_t i = 0; i < kNum; ++i) peak_[i].store(current_[i].load());
  peak_total_.store(current_total_.load());
  const std::lock_guard lock(peak_mutex_);
  for (size_t o = 0; o < kOwners; ++o) activations_at_peak_[o] = activations_[o].load();
}

}  // namespace moecore
