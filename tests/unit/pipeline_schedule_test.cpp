// Megatron's pipeline schedules as action lists (pipeline_schedule.h) and the simulator that runs them together
// (pipeline_simulator.h): Megatron's own examples, the warm-up counts, a grid of sizes that must all complete with
// every transfer matched and the data flow respected, the bubble against Narayanan et al. 2021, and the errors.
#include "moecore/pipeline/pipeline_schedule.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "moecore/model/config.h"
#include "moecore/pipeline/pipeline_simulator.h"

namespace moecore {
namespace {

// The forward / backward order of a rank in the encoding of Megatron's cuda_graphs.py:
// convert_schedule_table_to_order: chunk + 1 for a forward, -(chunk + 1) for a backward.
std::vector<int> compute_order(const PipelineSchedule& schedule) {
  std::vector<int> order;
  for (const PipelineAction& action : schedule.actions) {
    if (action.op == PipelineOp::kForward) order.push_back(action.chunk + 1);
    if (action.op == PipelineOp::kBackward) order.push_back(-(action.chunk + 1));
  }
  return order;
}

std::vector<std::string> descriptions(const PipelineSchedule& schedule) {
  std::vector<std::string> lines;
  for (const PipelineAction& action : schedule.actions) lines.push_back(describe(action));
  return lines;
}

std::string message_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "(no ConfigError)";
}

TEST(PipelineSchedule, ScheduleTableIsMegatronsExample) {
  // schedules.py, forward_backward_pipelining_with_interleaving's comment: PP2 N3 M5 VPP2.
  const std::vector<VirtualMicrobatch> table = pipeline_schedule_table(5, 2, 3);
  std::vector<int> microbatches, chunks;
  for (const VirtualMicrobatch& entry : table) {
    microbatches.push_back(entry.microbatch);
    chunks.push_back(entry.chunk);
  }
  EXPECT_EQ(microbatches, (std::vector<int>{0, 1, 2, 0, 1, 2, 3, 4, 3, 4}));
  EXPECT_EQ(chunks, (std::vector<int>{0, 0, 0, 1, 1, 1, 0, 0, 1, 1}));
  // model_parallel_config.py's microbatch_group_size_per_vp_stage docstring: PP2 VPP2 N2 M4 runs 0 1 0 1 2 3 2 3.
  std::vector<int> four;
  for (const VirtualMicrobatch& entry : pipeline_schedule_table(4, 2, 2)) four.push_back(entry.microbatch);
  EXPECT_EQ(four, (std::vector<int>{0, 1, 0, 1, 2, 3, 2, 3}));
}

TEST(PipelineSchedule, InterleavedComputeOrderIsMegatronsExample) {
  // cuda_graphs.py:convert_schedule_table_to_order's docstring, PP2 N3 M5 VPP2 with 5 warm-up micro-batches, which
  // is pp rank 0's count: (2 - 0 - 1) * 2 + (2 - 1) * 3.
  const PipelineSchedule rank0 = make_schedule(2, 0, 2, 5, 3);
  EXPECT_EQ(rank0.kind, PipelineScheduleKind::kInterleaved);
  EXPECT_EQ(rank0.num_warmup, 5);
  EXPECT_EQ(compute_order(rank0),
            (std::vector<int>{1, 1, 1, 2, 2, 2, -2, 1, -2, 1, -2, 2, -1, 2, -1, -1, -2, -2, -1, -1}));
  // Rank 1 warms up with 3: the same tables, the 1F1B pairs start earlier.
  const PipelineSchedule rank1 = make_schedule(2, 1, 2, 5, 3);
  EXPECT_EQ(rank1.num_warmup, 3);
  EXPECT_EQ(compute_order(rank1),
            (std::vector<int>{1, 1, 1, 2, -2, 2, -2, 2, -2, 1, -1, 1, -1, 2, -1, 2, -2, -2, -1, -1}));
}

TEST(PipelineSchedule, OneFOneBActionsFollowMegatron) {
  // forward_backward_pipelining_without_interleaving by hand for PP2 M3. Rank 0 warms up with one forward, rank 1
  // with none; the first stage's receive / send of activation gradients and the last stage's send of its output are
  // no-ops in Megatron and are left out.
  EXPECT_EQ(descriptions(make_schedule(2, 0, 1, 3)),
            (std::vector<std::string>{
                "forward mb 0 chunk 0",
                "send_forward(send activation mb 0 chunk 0 to 1)",
                "forward mb 1 chunk 0",
                "send_forward_recv_backward(send activation mb 1 chunk 0 to 1, recv gradient mb 0 chunk 0 from 1)",
                "backward mb 0 chunk 0",
                "forward mb 2 chunk 0",
                "send_forward_recv_backward(send activation mb 2 chunk 0 to 1, recv gradient mb 1 chunk 0 from 1)",
                "backward mb 1 chunk 0",
                "recv_backward(recv gradient mb 2 chunk 0 from 1)",
                "backward mb 2 chunk 0 (last of chunk)",
            }));
  EXPECT_EQ(descriptions(make_schedule(2, 1, 1, 3)),
            (std::vector<std::string>{
                "recv_forward(recv activation mb 0 chunk 0 from 0)",
                "forward mb 0 chunk 0",
                "backward mb 0 chunk 0",
                "send_backward_recv_forward(recv activation mb 1 chunk 0 from 0, send gradient mb 0 chunk 0 to 0)",
                "forward mb 1 chunk 0",
                "backward mb 1 chunk 0",
                "send_backward_recv_forward(recv activation mb 2 chunk 0 from 0, send gradient mb 1 chunk 0 to 0)",
                "forward mb 2 chunk 0",
                "backward mb 2 chunk 0 (last of chunk)",
                "send_backward(send gradient mb 2 chunk 0 to 0)",
            }));
  // No pipelining: forward and backward per micro-batch; gradient sync with the last backward only.
  EXPECT_EQ(descriptions(make_schedule(1, 0, 1, 2)),
            (std::vector<std::string>{"forward mb 0 chunk 0", "backward mb 0 chunk 0", "forward mb 1 chunk 0",
                                      "backward mb 1 chunk 0 (last of chunk)"}));
}

// combined_1f1b_schedule_for_no_pipelining: the first forward alone, each next forward with the previous backward,
// the last backward alone; 1F1B without virtual stages is refused with Megatron's text.
TEST(PipelineSchedule, CombinedOneFOneBFollowsMegatron) {
  EXPECT_EQ(descriptions(make_schedule(1, 0, 1, 3, 0, false, true)),
            (std::vector<std::string>{"forward mb 0 chunk 0", "forward mb 1 chunk 0 (combined with the next backward)",
                                      "backward mb 0 chunk 0", "forward mb 2 chunk 0 (combined with the next backward)",
                                      "backward mb 1 chunk 0", "backward mb 2 chunk 0 (last of chunk)"}));
  EXPECT_EQ(descriptions(make_schedule(1, 0, 1, 2, 0, true, true)),
            (std::vector<std::string>{"forward mb 0 chunk 0", "forward mb 1 chunk 0"}));
  EXPECT_EQ(message_of([] { make_schedule(2, 0, 1, 4, 0, false, true); }),
            "If enabling EP A2A overlap, virtual_pipeline_model_parallel_size must be specified when "
            "pipeline_model_parallel_size > 1");
  EXPECT_EQ(pipeline_warmup_microbatches(4, 1, 2, 8, 4, false, true), 9);
}

TEST(PipelineSchedule, WarmupCountsFollowMegatronsFormulas) {
  const auto warmups = [](const int pp, const int vpp, const int m, const int n, const bool forward_only) {
    std::vector<int> counts;
    for (int r = 0; r < pp; ++r) counts.push_back(make_schedule(pp, r, vpp, m, n, forward_only).num_warmup);
    return counts;
  };
  // 1F1B: min(PP - r - 1, M).
  EXPECT_EQ(warmups(4, 1, 8, 0, false), (std::vector<int>{3, 2, 1, 0}));
  EXPECT_EQ(warmups(4, 1, 2, 0, false), (std::vector<int>{2, 2, 1, 0}));
  EXPECT_EQ(warmups(4, 1, 8, 0, true), (std::vector<int>{3, 2, 1, 0}));  // 1F1B keeps it when forward-only
  // Interleaved: (PP - r - 1) * 2 + (VPP - 1) * N, capped at M * VPP.
  EXPECT_EQ(warmups(4, 2, 8, 0, false), (std::vector<int>{10, 8, 6, 4}));    // N = PP = 4
  EXPECT_EQ(warmups(4, 2, 8, 8, false), (std::vector<int>{14, 12, 10, 8}));  // N = 8
  EXPECT_EQ(warmups(4, 3, 4, 0, false), (std::vector<int>{12, 12, 10, 8}));  // 6 + 8 = 14 capped at 12
  EXPECT_EQ(warmups(2, 2, 5, 3, false), (std::vector<int>{5, 3}));
  EXPECT_EQ(warmups(4, 2, 8, 0, true), (std::vector<int>{16, 16, 16, 16}));  // forward-only: everything
  EXPECT_EQ(warmups(1, 1, 5, 0, false), (std::vector<int>{0}));
  EXPECT_EQ(pipeline_warmup_microbatches(4, 1, 2, 8, 4, false), 8);
}

TEST(PipelineSchedule, RejectsWhatMegatronRejects) {
  // schedules.py:forward_backward_pipelining_with_interleaving: PP <= N <= M.
  EXPECT_EQ(message_of([] { make_schedule(4, 0, 2, 8, 3); }),
            "The number of contiguous micro-batches in a virtual pipeline stage should range in [PP=4 , M=8]");
  EXPECT_EQ(message_of([] { make_schedule(4, 0, 2, 8, 9); }),
            "The number of contiguous micro-batches in a virtual pipeline stage should range in [PP=4 , M=8]");
  EXPECT_EQ(message_of([] { make_schedule(4, 0, 2, 3); }),  // N = PP = 4 > M = 3
            "The number of contiguous micro-batches in a virtual pipeline stage should range in [PP=4 , M=3]");
  // M % N must be 0 or >= PP.
  EXPECT_EQ(message_of([] { make_schedule(4, 2, 2, 6); }),
            "The remainder of M (the total micro-batches) divided by N (number of contiguous micro-batches in a "
            "virtual pipeline stage) should be 0, or larger than or equal to the pipeline-parallel size, but it is "
            "2. Otherwise, it introduces dependency bubbles in the pipeline and reduces throughput.");
  EXPECT_NO_THROW(make_schedule(2, 0, 2, 5, 3));  // remainder 2 >= PP 2
  EXPECT_NO_THROW(make_schedule(4, 0, 2, 9, 5));  // remainder 4 >= PP 4
  EXPECT_NO_THROW(make_schedule(4, 0, 1, 2, 1));  // N only matters to the interleaved schedule
  // forward_backward_no_pipelining takes one model chunk.
  EXPECT_EQ(message_of([] { make_schedule(1, 0, 2, 4); }),
            "non-pipeline-parallel schedule does not support model chunking");
  EXPECT_THROW(make_schedule(4, 4, 1, 4), ConfigError);
  EXPECT_THROW(make_schedule(4, -1, 1, 4), ConfigError);
  EXPECT_THROW(make_schedule(0, 0, 1, 4), ConfigError);
  EXPECT_THROW(make_schedule(2, 0, 0, 4), ConfigError);
  EXPECT_THROW(make_schedule(2, 0, 1, 0), ConfigError);
  EXPECT_THROW(make_schedule(2, 0, 2, 4, -1), ConfigError);
  EXPECT_THROW(make_all_schedules(4, 2, 6), ConfigError);
}

// The start / end of (microbatch, chunk)'s forward or backward on each rank, from a simulation.
struct StepTimes {
  std::vector<std::vector<std::vector<PipelineActionTiming>>> forward, backward;  // [rank][chunk][microbatch]
};

StepTimes step_times(const std::vector<PipelineSchedule>& schedules, const PipelineSimulation& sim) {
  StepTimes times;
  for (size_t r = 0; r < schedules.size(); ++r) {
    const PipelineSchedule& s = schedules[r];
    const auto empty = std::vector<std::vector<PipelineActionTiming>>(
        static_cast<size_t>(s.vpp_size), std::vector<PipelineActionTiming>(static_cast<size_t>(s.num_microbatches)));
    times.forward.push_back(empty);
    times.backward.push_back(empty);
    for (size_t i = 0; i < s.actions.size(); ++i) {
      const PipelineAction& a = s.actions[i];
      if (!a.is_compute()) continue;
      auto& table = a.op == PipelineOp::kForward ? times.forward : times.backward;
      table[r][static_cast<size_t>(a.chunk)][static_cast<size_t>(a.microbatch)] = sim.timings[r][i];
    }
  }
  return times;
}

// Everything a correct set of schedules satisfies, counted from the action lists and the simulated times.
void check_schedules(const int pp, const int vpp, const int m, const int n, const bool forward_only,
                     const bool combined = false) {
  const std::string where = "PP " + std::to_string(pp) + " VPP " + std::to_string(vpp) + " M " + std::to_string(m) +
                            " N " + std::to_string(n) + (forward_only ? " forward-only" : "") +
                            (combined ? " combined 1F1B" : "");
  SCOPED_TRACE(where);
  const std::vector<PipelineSchedule> schedules = make_all_schedules(pp, vpp, m, n, forward_only, combined);
  const int total = m * vpp;
  for (const PipelineSchedule& s : schedules) {
    const int r = s.pp_rank;
    EXPECT_EQ(s.combined_1f1b, combined && !forward_only);
    // The warm-up count from Megatron's formulas (one more forward for the combined 1F1B when interleaved).
    int warmup = 0;
    if (pp > 1 && vpp == 1) warmup = std::min(pp - r - 1, m);
    if (pp > 1 && vpp > 1) {
      warmup = forward_only ? total : std::min((pp - r - 1) * 2 + (vpp - 1) * n + (combined ? 1 : 0), total);
    }
    EXPECT_EQ(s.num_warmup, warmup) << "rank " << r;
    // A combined step's forward never feeds its backward: the backward of (mb, chunk c) needs the forwards of mb on
    // every chunk from c on.
    // Every steady-state step is combined (Megatron: all of them but the first forward and the last backward when
    // not pipelined).
    int combined_steps = 0;
    for (size_t i = 0; i < s.actions.size(); ++i) {
      const PipelineAction& f = s.actions[i];
      if (!f.combined_with_next) continue;
      ++combined_steps;
      ASSERT_TRUE(s.combined_1f1b && f.op == PipelineOp::kForward && i + 1 < s.actions.size() &&
                  s.actions[i + 1].op == PipelineOp::kBackward)
          << describe(f);
      const PipelineAction& b = s.actions[i + 1];
      EXPECT_FALSE(f.microbatch == b.microbatch && f.chunk >= b.chunk)
          << "rank " << r << " pairs " << describe(f) << " with " << describe(b);
    }
    if (s.combined_1f1b) {
      EXPECT_EQ(combined_steps, pp == 1 ? m - 1 : total - warmup) << "rank " << r;
    }

    std::vector<std::vector<int>> forward_at(static_cast<size_t>(vpp), std::vector<int>(static_cast<size_t>(m), -1));
    std::vector<std::vector<int>> backward_at = forward_at;
    std::vector<int> last_backward_of(static_cast<size_t>(vpp), -1), flagged(static_cast<size_t>(vpp), -1);
    int forwards_before_first_backward = 0;
    bool seen_backward = false;
    for (size_t i = 0; i < s.actions.size(); ++i) {
      const PipelineAction& a = s.actions[i];
      if (!a.is_compute()) continue;
      ASSERT_TRUE(a.chunk >= 0 && a.chunk < vpp && a.microbatch >= 0 && a.microbatch < m) << describe(a);
      auto& at =
          (a.op == PipelineOp::kForward ? forward_at
                                        : backward_at)[static_cast<size_t>(a.chunk)][static_cast<size_t>(a.microbatch)];
      EXPECT_EQ(at, -1) << "rank " << r << " runs twice: " << describe(a);
      at = static_cast<int>(i);
      if (a.op == PipelineOp::kForward) {
        if (!seen_backward) ++forwards_before_first_backward;
      } else {
        seen_backward = true;
        last_backward_of[static_cast<size_t>(a.chunk)] = static_cast<int>(i);
        if (a.last_backward_of_chunk) {
          EXPECT_EQ(flagged[static_cast<size_t>(a.chunk)], -1) << "rank " << r << " flags two backwards";
          flagged[static_cast<size_t>(a.chunk)] = static_cast<int>(i);
        }
      }
    }
    for (int c = 0; c < vpp; ++c) {
      for (int mb = 0; mb < m; ++mb) {
        const int f = forward_at[static_cast<size_t>(c)][static_cast<size_t>(mb)];
        const int b = backward_at[static_cast<size_t>(c)][static_cast<size_t>(mb)];
        EXPECT_GE(f, 0) << "rank " << r << " never forwards mb " << mb << " chunk " << c;
        if (forward_only) {
          EXPECT_EQ(b, -1);
        } else {
          EXPECT_GT(b, f) << "rank " << r << " backward of mb " << mb << " chunk " << c << " not after its forward";
        }
      }
      // The flag marks the chunk's last backward (micro-batch M - 1, by FIFO order).
      EXPECT_EQ(flagged[static_cast<size_t>(c)], last_backward_of[static_cast<size_t>(c)]) << "rank " << r;
    }
    // Megatron keeps num_warmup + 1 contexts at most (its max_outstanding_backprops); forward-only keeps none; the
    // combined 1F1B without pipelining keeps two (a forward runs ahead of each backward).
    const int expected_live = forward_only ? 0 : std::min(s.num_warmup + 1 + (combined && pp == 1 ? 1 : 0), total);
    EXPECT_EQ(s.max_live_contexts, expected_live) << "rank " << r;
    if (!forward_only) {
      EXPECT_EQ(forwards_before_first_backward, expected_live) << "rank " << r;
    }
    int per_chunk_max = 0;
    for (const int live : s.max_live_contexts_per_chunk) per_chunk_max = std::max(per_chunk_max, live);
    EXPECT_LE(per_chunk_max, s.max_live_contexts);
    if (!forward_only) {
      EXPECT_GE(per_chunk_max * vpp, s.max_live_contexts);
    }
  }

  // Both send semantics complete: eager (the executor's) and rendezvous (Megatron's _communicate waits on sends).
  const PipelineCosts costs{1.0, 2.0, 0.0};
  for (const SendCompletion sends : {SendCompletion::kEager, SendCompletion::kRendezvous}) {
    const PipelineSimulation sim = simulate_pipeline(schedules, costs, sends);
    ASSERT_TRUE(sim.completed) << sim.error;
    // Every boundary between consecutive virtual stages carries each micro-batch's activation, and its gradient back.
    EXPECT_EQ(sim.transfers, static_cast<int64_t>(m) * (pp * vpp - 1) * (forward_only ? 1 : 2));
    // Virtual stage s = chunk * PP + rank runs after stage s - 1 (forward) and s + 1 (backward) for a micro-batch.
    const StepTimes times = step_times(schedules, sim);
    for (int stage = 0; stage < pp * vpp; ++stage) {
      const auto r = static_cast<size_t>(stage % pp);
      const auto c = static_cast<size_t>(stage / pp);
      for (size_t mb = 0; mb < static_cast<size_t>(m); ++mb) {
        if (stage > 0) {
          const auto pr = static_cast<size_t>((stage - 1) % pp), pc = static_cast<size_t>((stage - 1) / pp);
          EXPECT_GE(times.forward[r][c][mb].start, times.forward[pr][pc][mb].end) << "stage " << stage << " mb " << mb;
        }
        if (!forward_only && stage < pp * vpp - 1) {
          const auto nr = static_cast<size_t>((stage + 1) % pp), nc = static_cast<size_t>((stage + 1) / pp);
          EXPECT_GE(times.backward[r][c][mb].start, times.backward[nr][nc][mb].end)
              << "stage " << stage << " mb " << mb;
        }
        if (!forward_only) {
          EXPECT_GE(times.backward[r][c][mb].start, times.forward[r][c][mb].end);
        }
      }
    }
  }
}

TEST(PipelineSchedule, EveryValidSizeCompletesWithItsDataFlow) {
  int checked = 0;
  for (int pp = 1; pp <= 4; ++pp) {
    for (int vpp = 1; vpp <= 3; ++vpp) {
      if (pp == 1 && vpp > 1) continue;  // rejected above
      for (int m = 1; m <= 12; ++m) {
        std::vector<int> groups{0};  // N: only the interleaved schedule has one; 0 = default PP
        if (vpp > 1) {
          groups.clear();
          for (int n = pp; n <= m; ++n) {
            if (m % n == 0 || m % n >= pp) groups.push_back(n);
          }
        }
        for (const int n : groups) {
          for (const bool forward_only : {false, true}) {
            check_schedules(pp, vpp, m, n > 0 ? n : pp, forward_only);
            ++checked;
            if (pp == 1 || vpp > 1) {  // Megatron's combined 1F1B needs virtual stages when pipelined
              check_schedules(pp, vpp, m, n > 0 ? n : pp, forward_only, true);
              ++checked;
            }
          }
        }
      }
    }
  }
  EXPECT_GT(checked, 300);
}

// Why the simulated bubble equals (PP - 1) / (VPP * M + PP - 1) exactly here (f, b: one chunk's forward and
// backward of one micro-batch; zero p2p latency; every stage equal):
//  * Lower bound, any schedule of these shapes: the last rank cannot start before (PP - 1) f (micro-batch 0 must
//    pass the other ranks first); its last step is the backward of micro-batch M - 1 on chunk 0, after which ranks
//    PP-2 .. 0 each still run that backward, (PP - 1) b. In between the last rank has VPP * M (f + b) of work. So the
//    makespan T >= (VPP * M + PP - 1)(f + b), and idle / total = 1 - VPP * M (f + b) / T >= the formula.
//  * Equality holds iff the last rank never waits once started and that tail is tight. For 1F1B with M >= PP the
//    timeline is explicit: backward i on rank r ends at E_r(i) = (PP-1) f + (i+1)(f+b) + (PP-1-r) b, since each
//    dependency is met exactly on time (rank r+1's backward i ends at E_r(i) - b, just as rank r's forward before it
//    ends; rank r-1's forward i+w, w = PP-r-1, ends at E_r(i-1) just as rank r's backward i-1 does), for every f and
//    b, not only b = 2f. For the interleaved schedule the test checks that Megatron's warm-up, (PP-r-1)*2 +
//    (VPP-1)*N, keeps the last rank fed, for several b / f, for every valid N (a larger N costs memory, not time).
TEST(PipelineSchedule, OneFOneBTimelineIsTheClosedForm) {
  for (const double b : {2.0, 1.0, 0.5}) {
    const double f = 1.0;
    for (int pp = 2; pp <= 4; ++pp) {
      for (int m = pp; m <= 12; ++m) {
        const std::vector<PipelineSchedule> schedules = make_all_schedules(pp, 1, m);
        const PipelineSimulation sim = simulate_pipeline(schedules, {f, b, 0.0});
        ASSERT_TRUE(sim.completed) << sim.error;
        const StepTimes times = step_times(schedules, sim);
        for (int r = 0; r < pp; ++r) {
          for (int i = 0; i < m; ++i) {
            const double expected = (pp - 1) * f + (i + 1) * (f + b) + (pp - 1 - r) * b;
            EXPECT_DOUBLE_EQ(times.backward[static_cast<size_t>(r)][0][static_cast<size_t>(i)].end, expected)
                << "PP " << pp << " M " << m << " rank " << r << " backward " << i << " b " << b;
          }
        }
        EXPECT_DOUBLE_EQ(sim.makespan, (m + pp - 1) * (f + b));
      }
    }
  }
}

TEST(PipelineSchedule, BubbleIsNarayanansFormula) {
  for (const double b_over_f : {2.0, 1.0, 3.0, 0.5}) {
    for (int pp = 1; pp <= 4; ++pp) {
      for (int vpp = 1; vpp <= 3; ++vpp) {
        if (pp == 1 && vpp > 1) continue;
        for (int m = 1; m <= 12; ++m) {
          for (int n = pp; n <= (vpp > 1 ? m : pp); ++n) {
            if (vpp > 1 && m % n != 0 && m % n < pp) continue;
            // Costs per chunk: a rank's stage split in VPP chunks, so f = 1 / VPP per chunk.
            const PipelineCosts costs{1.0 / vpp, b_over_f / vpp, 0.0};
            const PipelineSimulation sim = simulate_pipeline(make_all_schedules(pp, vpp, m, n), costs);
            ASSERT_TRUE(sim.completed) << sim.error;
            const double expected = static_cast<double>(pp - 1) / (vpp * m + pp - 1);
            EXPECT_NEAR(sim.bubble_fraction, expected, 1e-12)
                << "PP " << pp << " VPP " << vpp << " M " << m << " N " << n << " b/f " << b_over_f;
            EXPECT_NEAR(analytic_bubble_fraction(pp, vpp, m), expected, 1e-15);
            const double busy = vpp * m * (costs.forward + costs.backward);
            for (const double rank_busy : sim.busy) EXPECT_NEAR(rank_busy, busy, 1e-9);
          }
        }
      }
    }
  }
  // The interleaved schedule's point: PP 4, M 8, one stage split in 2 chunks halves the bubble's time.
  EXPECT_NEAR(analytic_bubble_fraction(4, 1, 8), 3.0 / 11.0, 1e-15);
  EXPECT_NEAR(analytic_bubble_fraction(4, 2, 8), 3.0 / 19.0, 1e-15);
}

TEST(PipelineSchedule, LatencyOnlyAddsBubble) {
  for (const int vpp : {1, 2}) {
    const std::vector<PipelineSchedule> schedules = make_all_schedules(4, vpp, 8);
    const PipelineSimulation ideal = simulate_pipeline(schedules, {1.0 / vpp, 2.0 / vpp, 0.0});
    const PipelineSimulation slow = simulate_pipeline(schedules, {1.0 / vpp, 2.0 / vpp, 0.1});
    ASSERT_TRUE(slow.completed) << slow.error;
    EXPECT_GT(slow.bubble_fraction, ideal.bubble_fraction);
    // The critical path crosses at least 2 (PP - 1) transfers: micro-batch 0's forward and the last backward.
    EXPECT_GE(slow.makespan, ideal.makespan + 2 * 3 * 0.1 - 1e-12);
  }
}

// A two-rank, one-chunk "schedule" written by hand.
PipelineSchedule hand_schedule(const int rank, const int num_microbatches, std::vector<PipelineAction> actions) {
  PipelineSchedule s;
  s.kind = PipelineScheduleKind::kOneFOneB;
  s.pp_size = 2;
  s.pp_rank = rank;
  s.num_microbatches = num_microbatches;
  s.actions = std::move(actions);
  return s;
}
PipelineAction compute(const PipelineOp op, const int mb) {
  PipelineAction a;
  a.op = op;
  a.microbatch = mb;
  a.chunk = 0;
  return a;
}
PipelineAction p2p(const PipelineOp op, const int rank, const bool send_next, const bool recv_prev,
                   const bool send_prev, const bool recv_next, const int mb) {
  PipelineAction a;
  a.op = op;
  const int peer = 1 - rank;
  if (send_next) a.send_next = {peer, mb, 0};
  if (recv_prev) a.recv_prev = {peer, mb, 0};
  if (send_prev) a.send_prev = {peer, mb, 0};
  if (recv_next) a.recv_next = {peer, mb, 0};
  return a;
}

TEST(PipelineSimulator, DetectsDeadlock) {
  // Both ranks first wait for the other.
  const PipelineSimulation sim =
      simulate_pipeline({hand_schedule(0, 1, {p2p(PipelineOp::kRecvBackward, 0, false, false, false, true, 0)}),
                         hand_schedule(1, 1, {p2p(PipelineOp::kRecvForward, 1, false, true, false, false, 0)})});
  EXPECT_FALSE(sim.completed);
  EXPECT_NE(sim.error.find("deadlock"), std::string::npos) << sim.error;
  EXPECT_NE(sim.error.find("rank 0 waits in action 0 recv_backward"), std::string::npos) << sim.error;
}

TEST(PipelineSimulator, SeparateSendsDeadlockOnlyWhenSendsBlock) {
  // PP 2, M 2 with the sends and receives in separate calls: rank 0 sends activation 1 before it receives gradient 0,
  // rank 1 sends gradient 0 before it receives activation 1. Non-blocking sends get through; sends that wait for
  // their receiver (Megatron's _communicate) deadlock, which is why Megatron combines them
  // (send_forward_recv_backward, send_backward_recv_forward).
  using Op = PipelineOp;
  const std::vector<PipelineSchedule> schedules{
      hand_schedule(0, 2,
                    {compute(Op::kForward, 0), p2p(Op::kSendForward, 0, true, false, false, false, 0),
                     compute(Op::kForward, 1), p2p(Op::kSendForward, 0, true, false, false, false, 1),
                     p2p(Op::kRecvBackward, 0, false, false, false, true, 0), compute(Op::kBackward, 0),
                     p2p(Op::kRecvBackward, 0, false, false, false, true, 1), compute(Op::kBackward, 1)}),
      hand_schedule(1, 2,
                    {p2p(Op::kRecvForward, 1, false, true, false, false, 0), compute(Op::kForward, 0),
                     compute(Op::kBackward, 0), p2p(Op::kSendBackward, 1, false, false, true, false, 0),
                     p2p(Op::kRecvForward, 1, false, true, false, false, 1), compute(Op::kForward, 1),
                     compute(Op::kBackward, 1), p2p(Op::kSendBackward, 1, false, false, true, false, 1)})};
  const PipelineSimulation eager = simulate_pipeline(schedules, {}, SendCompletion::kEager);
  EXPECT_TRUE(eager.completed) << eager.error;
  EXPECT_EQ(eager.transfers, 4);
  const PipelineSimulation rendezvous = simulate_pipeline(schedules, {}, SendCompletion::kRendezvous);
  EXPECT_FALSE(rendezvous.completed);
  EXPECT_NE(rendezvous.error.find("deadlock"), std::string::npos) << rendezvous.error;
}

TEST(PipelineSimulator, CatchesBrokenSchedules) {
  const std::vector<PipelineSchedule> good = make_all_schedules(2, 1, 3);
  ASSERT_TRUE(simulate_pipeline(good).completed);
  {  // Rank 1 expects micro-batch 1 where rank 0 sends micro-batch 0.
    std::vector<PipelineSchedule> bad = good;
    bad[1].actions[0].recv_prev.microbatch = 1;
    const PipelineSimulation sim = simulate_pipeline(bad);
    EXPECT_FALSE(sim.completed);
    EXPECT_NE(sim.error.find("the received tensor is not the one sent"), std::string::npos) << sim.error;
  }
  {  // Rank 1 forgets its first receive: its forward has no input.
    std::vector<PipelineSchedule> bad = good;
    bad[1].actions.erase(bad[1].actions.begin());
    const PipelineSimulation sim = simulate_pipeline(bad);
    EXPECT_FALSE(sim.completed);
    EXPECT_NE(sim.error.find("its input activation has not been received"), std::string::npos) << sim.error;
  }
  {  // Rank 1 drops its last send: rank 0 then waits forever for that gradient.
    std::vector<PipelineSchedule> bad = good;
    bad[1].actions.pop_back();
    const PipelineSimulation sim = simulate_pipeline(bad);
    EXPECT_FALSE(sim.completed);
    EXPECT_NE(sim.error.find("deadlock"), std::string::npos) << sim.error;
  }
  {  // Rank 0 drops its last receive and backward: one gradient stays unmatched and one backward never runs.
    std::vector<PipelineSchedule> bad = good;
    bad[0].actions.resize(bad[0].actions.size() - 2);
    const PipelineSimulation sim = simulate_pipeline(bad);
    EXPECT_FALSE(sim.completed);
    EXPECT_NE(sim.error.find("gradients from rank 1 to rank 0: 3 sent, 2 received"), std::string::npos) << sim.error;
  }
  {  // A send to the wrong neighbour.
    std::vector<PipelineSchedule> bad = make_all_schedules(3, 1, 3);
    for (PipelineAction& a : bad[0].actions) {
      if (a.send_next.present()) a.send_next.peer = 2;
    }
    const PipelineSimulation sim = simulate_pipeline(bad);
    EXPECT_FALSE(sim.completed);
    EXPECT_NE(sim.error.find("send_next names peer 2, expected 1"), std::string::npos) << sim.error;
  }
}

TEST(PipelineSchedule, ForwardOnlyRunsOnlyForwards) {
  for (const int vpp : {1, 2}) {
    for (const PipelineSchedule& s : make_all_schedules(4, vpp, 8, 0, true)) {
      int forwards = 0;
      for (const PipelineAction& a : s.actions) {
        EXPECT_NE(a.op, PipelineOp::kBackward);
        EXPECT_FALSE(a.send_prev.present() || a.recv_next.present()) << describe(a);
        forwards += a.op == PipelineOp::kForward;
      }
      EXPECT_EQ(forwards, 8 * vpp);
      EXPECT_EQ(s.max_live_contexts, 0);
    }
  }
}

TEST(PipelineSchedule, LiveContextsPerChunk) {
  // PP2 VPP2 M5 N3, rank 0 (by hand from the order above): chunks 0 0 0 1 1 1 forwarded before the first backward
  // (6 alive: 3 + 3); then micro-batches 3 and 4 go forward on chunk 0 while chunk 1's backwards free its contexts,
  // so chunk 0 reaches 5 (0 1 2 3 4 before its first backward) and chunk 1 stays at 3; together never above 6.
  const PipelineSchedule rank0 = make_schedule(2, 0, 2, 5, 3);
  EXPECT_EQ(rank0.max_live_contexts, 6);
  EXPECT_EQ(rank0.max_live_contexts_per_chunk, (std::vector<int>{5, 3}));
}

}  // namespace
}  // namespace moecore
