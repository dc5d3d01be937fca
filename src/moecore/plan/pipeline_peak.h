// The activation peak of one pipeline rank under Megatron's schedules (pipeline/pipeline_schedule.h: no pipelining,
// 1F1B, interleaved), from closed forms over the schedule's order instead of its action list: the same answer as
// running make_schedule's actions, in O(VPP^2) work for any number of micro-batches (2^31 included).
//
// The order the closed forms use: the forwards run the schedule table (pipeline_schedule_table) in order, backward k
// runs entry k on chunk VPP - 1 - chunk, and backward k comes after forward min(k + W + 1, M x VPP) - 1, where W is
// the warm-up count (pipeline_warmup_microbatches). So the contexts alive on chunk v before backward k are
//   forwards of chunk v among the table's first min(k + W + 1, M x VPP) entries
//   - backwards of chunk v among its first k (entries of chunk VPP - 1 - v),
// and 1F1B's most live contexts, min(PP - r, M), is the case VPP = 1 of that.
#pragma once

#include <cstdint>
#include <vector>

namespace moecore::plan {

// One pipeline rank's schedule, in 64-bit sizes.
struct PipelineShape {
  int64_t pp = 1;
  int64_t rank = 0;
  int64_t vpp = 1;
  int64_t microbatches = 1;  // M, per chunk
  int64_t group = 0;         // N, micro-batches per group of the interleaved schedule (0: PP)
};

// Megatron's warm-up forwards (virtual micro-batches when interleaved), as pipeline_warmup_microbatches, in 64 bits.
int64_t warmup_microbatches(const PipelineShape& shape);

// Contexts alive on each chunk just before backward `k` (0 <= k < M x VPP) starts.
std::vector<int64_t> live_contexts_before_backward(const PipelineShape& shape, int64_t k);

// What one micro-batch leaves on a chunk until its backward (kept), and the extra bytes that backward needs while it
// runs (transient).
struct ChunkActivations {
  double kept = 0;
  double transient = 0;
};

struct PipelinePeak {
  bool found = false;         // false when no backward has a positive total
  double bytes = 0;           // kept contexts + the transient of the backward that reaches the peak
  int64_t backward = -1;      // that backward (virtual micro-batch index k), the first with the largest total
  int64_t chunk = -1;         // its chunk
  std::vector<int64_t> live;  // contexts alive per chunk as it starts
};

// The largest (kept contexts alive + backward transient) over the rank's backwards, the first backward reaching it;
// `chunks` has VPP entries. Throws ConfigError on sizes Megatron's schedule refuses (check_pipeline_schedule_sizes).
PipelinePeak pipeline_activation_peak(const PipelineShape& shape, const std::vector<ChunkActivations>& chunks);

}  // namespace moecore::plan
