// Runs every pp rank's schedule (pipeline_schedule.h) together, as the executor will: forward and backward steps take
// fixed times, point-to-point calls post their transfers and wait for their receives. Proves a set of schedules
// deadlock-free with every transfer matched, checks the data flow, and measures the pipeline bubble.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "moecore/pipeline/pipeline_schedule.h"

namespace moecore {

struct PipelineCosts {
  double forward = 1.0;      // one model chunk's forward of one micro-batch
  double backward = 2.0;     // one model chunk's backward of one micro-batch
  double p2p_latency = 0.0;  // from the moment both ends have posted a transfer to its completion
};

// When a p2p call's sends let the caller go on.
enum class SendCompletion {
  kEager,       // at once (non-blocking sends; the executor's semantics): a call waits only for its receives
  kRendezvous,  // when the peer has posted the matching receive: a call waits for all its transfers, as Megatron's
                // p2p_communication.py:_communicate waits on every request it posted
};

struct PipelineActionTiming {
  double start = 0.0;  // when the rank reached the action (a p2p call posts its transfers then)
  double end = 0.0;    // when it finished (a p2p call: when what it waits for has completed)
};

struct PipelineSimulation {
  bool completed = false;        // every rank ran its whole list, every send matched one receive of the same tensor
  std::string error;             // otherwise why: the deadlock (each stuck rank and its call) or the first broken rule
  double makespan = 0.0;         // the latest rank's finish
  std::vector<double> busy;      // per rank: time in forward and backward steps
  std::vector<double> finish;    // per rank: when its last action ended
  double bubble_fraction = 0.0;  // idle / total = sum over ranks (makespan - busy) / (PP * makespan)
  int64_t transfers = 0;         // matched send / receive pairs
  std::vector<std::vector<PipelineActionTiming>> timings;  // [pp rank][action index]
};

// Simulates `schedules` (one per pp rank, index = pp rank, as make_all_schedules builds them). Sends and receives
// match in order per (sender, receiver, activation or gradient). Checked besides deadlock: each transfer's peer is
// the neighbour its slot names, a received tensor is the one the peer sent (same micro-batch, the chunk of the next
// virtual stage for an activation, the previous one for a gradient), a forward has its input and a backward its
// output gradient and forward, nothing is sent before it was computed, every micro-batch is forwarded (and, unless
// forward-only, backwarded) exactly once per chunk, no transfer is left unmatched. Never loops: it stops when no
// rank can move.
PipelineSimulation simulate_pipeline(const std::vector<PipelineSchedule>& schedules, const PipelineCosts& costs = {},
                                     SendCompletion sends = SendCompletion::kEager);

// The bubble fraction of an ideal pipeline with equal stages (Narayanan et al. 2021, "Efficient large-scale language
// model training on GPU clusters using Megatron-LM", section 2.2): idle / total = (PP - 1) / (VPP * M + PP - 1).
double analytic_bubble_fraction(int pp_size, int vpp_size, int num_microbatches);

}  // namespace moecore
