#include "moecore/tensor/memory_tracker.h"

namespace moecore {
namespace {
void raise_to(std::atomic<int64_t>& peak, const int64_t value) {
  int64_t seen = peak.load(std::memory_order_relaxed);
  while (value > seen && !peak.compare_exchange_weak(seen, value, std::memory_order_relaxed)) {
  }
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

MemoryTracker& MemoryTracker::instance() {
  static MemoryTracker tracker;
  return tracker;
}

void MemoryTracker::on_alloc(const MemCategory category, const size_t bytes) {
  const auto i = static_cast<size_t>(category);
  const auto n = static_cast<int64_t>(bytes);
  raise_to(peak_[i], current_[i].fetch_add(n, std::memory_order_relaxed) + n);
  raise_to(peak_total_, current_total_.fetch_add(n, std::memory_order_relaxed) + n);
}

void MemoryTracker::on_free(const MemCategory category, const size_t bytes) {
  const auto n = static_cast<int64_t>(bytes);
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

void MemoryTracker::reset_peaks() {
  for (size_t i = 0; i < kNum; ++i) peak_[i].store(current_[i].load());
  peak_total_.store(current_total_.load());
}

}  // namespace moecore
