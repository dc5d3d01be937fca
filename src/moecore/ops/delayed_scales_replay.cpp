#include "moecore/ops/delayed_scales_replay.h"

#include <stdexcept>

#include "moecore/ops/scoped_state.h"

namespace moecore::ops {
namespace {

DelayedScalesLog* live_log = nullptr;
ScopedDelayedScales::Mode live_mode = ScopedDelayedScales::Mode::kRecord;

}  // namespace

void DelayedScalesLog::record(const quant::DelayedLinearScaling* layer, const quant::DelayedForwardScales& scales) {
  const std::lock_guard<std::mutex> lock(mutex_);
  entries_[layer].push_back(scales);
}

quant::DelayedForwardScales DelayedScalesLog::take(const quant::DelayedLinearScaling* layer) {
  const std::lock_guard<std::mutex> lock(mutex_);
  const auto it = entries_.find(layer);
  if (it == entries_.end() || it->second.empty()) {
    throw std::logic_error("recompute: a linear layer's forward logged no FP8 delayed scales to replay");
  }
  const quant::DelayedForwardScales scales = it->second.front();
  it->second.pop_front();
  if (it->second.empty()) entries_.erase(it);
  return scales;
}

ScopedDelayedScales::ScopedDelayedScales(DelayedScalesLog* log, const Mode mode)
    : previous_log_(live_log), previous_mode_(live_mode) {
  if (log == nullptr) return;
  live_log = log;
  live_mode = mode;
}

ScopedDelayedScales::~ScopedDelayedScales() {
  live_log = previous_log_;
  live_mode = previous_mode_;
}

DelayedScalesLog* delayed_scales_log(ScopedDelayedScales::Mode* mode) {
  *mode = live_mode;
  return live_log;
}

void detail::restore_delayed_scales_state(DelayedScalesLog* log, const ScopedDelayedScales::Mode mode) {
  live_log = log;
  live_mode = mode;
}

}  // namespace moecore::ops
