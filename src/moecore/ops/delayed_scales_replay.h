// Recomputation under FP8 delayed scaling (TransformerEngine's te_checkpoint, which keeps the forward's fp8_meta for
// the recompute phase): a forward that a recompute will repeat logs the scales each linear layer quantized its input
// and weight with; the recompute quantizes with the same scales and records no amax, so the recomputed activations
// equal the original ones bit for bit and the amax histories see each forward once. Other recipes are stateless and
// need no log.
#pragma once

#include <deque>
#include <map>
#include <mutex>

#include "moecore/quant/delayed_linear_scaling.h"

namespace moecore::ops {

// The scales of one forward, per linear layer (its scaling state) in call order.
class DelayedScalesLog {
 public:
  void record(const quant::DelayedLinearScaling* layer, const quant::DelayedForwardScales& scales);
  // The next scales `layer` logged; std::logic_error when it logged none (a recompute that differs from its forward).
  quant::DelayedForwardScales take(const quant::DelayedLinearScaling* layer);
  bool empty() const { return entries_.empty(); }

 private:
  std::mutex mutex_;  // the experts' linear layers may run on several threads
  std::map<const quant::DelayedLinearScaling*, std::deque<quant::DelayedForwardScales>> entries_;
};

// While live, delayed-scaling linear forwards log into `log` (kRecord) or quantize with its scales (kReplay). Nests;
// null leaves the forwards as they are. Create and destroy it on one thread, outside parallel regions.
class ScopedDelayedScales {
 public:
  enum class Mode { kRecord, kReplay };
  ScopedDelayedScales(DelayedScalesLog* log, Mode mode);
  ~ScopedDelayedScales();
  ScopedDelayedScales(const ScopedDelayedScales&) = delete;
  ScopedDelayedScales& operator=(const ScopedDelayedScales&) = delete;

 private:
  DelayedScalesLog* previous_log_;
  Mode previous_mode_;
};

// The live scope's log and mode (null: none); used by the quantized linear forward.
DelayedScalesLog* delayed_scales_log(ScopedDelayedScales::Mode* mode);

}  // namespace moecore::ops
