// Wall time spent in communication, by kind, so logs can show what dominates a step. Call sites wrap each
// collective (or the wait of an asynchronous one) in a CommTimer of its kind. Process-wide, not thread-safe:
// collectives are issued from one thread at a time (the training thread, or one lane of the EP overlap).
#pragma once

#include <array>
#include <chrono>
#include <cstdint>

#include "moecore/util/trace.h"

namespace moecore::parallel {

enum class CommKind : uint8_t {
  kAllToAll,         // MoE token dispatch and combine (all-to-all, or the allgather dispatcher's gather / scatter)
  kTensorParallel,   // TP / SP activations: all-reduce, all-gather, reduce-scatter
  kGradReduce,       // data-parallel gradient all-reduce / reduce-scatter, TP sums of replicated gradients
  kParamGather,      // distributed optimizer's parameter all-gather
  kContextParallel,  // context parallel attention: keys / values around the ring, all-gathers, all-to-alls
  kPipelineP2P,      // pipeline send / recv: posting the transfers, the sends' completion
  kPipelineWait,     // pipeline: waiting for a neighbour stage's activation or gradient (the bubble, with the transfer)
  kOther,            // loss / statistics reductions, grad norm, logging
  kCount
};

const char* comm_kind_name(CommKind kind);

class CommStats {
 public:
  static CommStats& instance();
  void add(CommKind kind, double seconds) { seconds_[static_cast<size_t>(kind)] += seconds; }
  double seconds(CommKind kind) const { return seconds_[static_cast<size_t>(kind)]; }
  // Bytes this rank contributed to collectives of `kind` (the payload it sends into them: a bucket's elements x
  // element size for a gradient all-reduce or reduce-scatter, its shard for a parameter all-gather). Recorded where
  // the payload's dtype is chosen (the data-parallel buffers), so 16-bit communication shows as half the bytes.
  void add_bytes(CommKind kind, double bytes) { bytes_[static_cast<size_t>(kind)] += bytes; }
  double bytes(CommKind kind) const { return bytes_[static_cast<size_t>(kind)]; }
  // Of the token dispatchers' all-to-all bytes, the token rows sent to a rank on another host (shared_window.h:
  // host_id), towards the experts (dispatch, combine's backward) or back from them (combine, dispatch's backward).
  void add_inter_host_bytes(double bytes, bool to_experts) { inter_host_bytes_[to_experts ? 0 : 1] += bytes; }
  double inter_host_bytes(bool to_experts) const { return inter_host_bytes_[to_experts ? 0 : 1]; }
  void reset() {
    seconds_.fill(0.0);
    bytes_.fill(0.0);
    inter_host_bytes_.fill(0.0);
  }

 private:
  std::array<double, static_cast<size_t>(CommKind::kCount)> seconds_{};
  std::array<double, static_cast<size_t>(CommKind::kCount)> bytes_{};
  std::array<double, 2> inter_host_bytes_{};
};

class CommTimer {
 public:
  explicit CommTimer(CommKind kind) : kind_(kind), start_(std::chrono::steady_clock::now()) {}
  ~CommTimer() {
    const auto end = std::chrono::steady_clock::now();
    CommStats::instance().add(kind_, std::chrono::duration<double>(end - start_).count());
    if (trace::enabled()) trace::record(comm_kind_name(kind_), "comm", start_, end);  // the timeline's comm track
  }
  CommTimer(const CommTimer&) = delete;
  CommTimer& operator=(const CommTimer&) = delete;

 private:
  CommKind kind_;
  std::chrono::steady_clock::time_point start_;
};

}  // namespace moecore::parallel
