// pipeline_activation_peak (closed forms over the schedule's order) against running make_schedule's action list, the
// way the planner measured the peak before: for every small shape Megatron accepts (PP, VPP, rank, M, and N with
// uneven last groups), the same contexts alive before every backward, the same first peak and the same bytes.
// Per-chunk sizes are whole numbers, so both sums are exact and ties resolve the same way.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "moecore/model/config.h"
#include "moecore/pipeline/pipeline_schedule.h"
#include "moecore/plan/pipeline_peak.h"

namespace moecore::plan {
namespace {

// The simulation: walk the compute actions, contexts alive from forward to backward.
PipelinePeak simulated_peak(const PipelineSchedule& schedule, const std::vector<ChunkActivations>& chunks,
                            std::vector<std::vector<int64_t>>& live_per_backward) {
  PipelinePeak peak;
  peak.live.assign(chunks.size(), 0);
  std::vector<int64_t> live(chunks.size(), 0);
  double live_bytes = 0;
  int64_t k = 0;
  for (const PipelineAction& action : schedule.actions) {
    if (!action.is_compute()) continue;
    const auto chunk = static_cast<size_t>(action.chunk);
    if (action.op == PipelineOp::kForward) {
      live_bytes += chunks[chunk].kept;
      ++live[chunk];
      continue;
    }
    live_per_backward.push_back(live);
    if (live_bytes + chunks[chunk].transient > peak.bytes) {
      peak.found = true;
      peak.bytes = live_bytes + chunks[chunk].transient;
      peak.backward = k;
      peak.chunk = action.chunk;
      peak.live = live;
    }
    live_bytes -= chunks[chunk].kept;
    --live[chunk];
    ++k;
  }
  return peak;
}

std::string describe(const PipelineShape& s) {
  return "PP " + std::to_string(s.pp) + " rank " + std::to_string(s.rank) + " VPP " + std::to_string(s.vpp) + " M " +
         std::to_string(s.microbatches) + " N " + std::to_string(s.group);
}

TEST(PlanPipelinePeak, MatchesTheSimulatedScheduleForSmallShapes) {
  std::mt19937 random(1234);
  int64_t shapes = 0, uneven = 0;
  for (int64_t pp = 1; pp <= 5; ++pp) {
    for (int64_t vpp = 1; vpp <= (pp == 1 ? 1 : 4); ++vpp) {
      for (int64_t m = 1; m <= 18; ++m) {
        std::vector<int64_t> groups{0};
        if (vpp > 1) {
          for (int64_t n = pp; n <= m; ++n) groups.push_back(n);
        }
        for (const int64_t n : groups) {
          for (int64_t rank = 0; rank < pp; ++rank) {
            const PipelineShape shape{.pp = pp, .rank = rank, .vpp = vpp, .microbatches = m, .group = n};
            PipelineSchedule schedule;
            try {
              schedule = make_schedule(static_cast<int>(pp), static_cast<int>(rank), static_cast<int>(vpp),
                                       static_cast<int>(m), static_cast<int>(n));
            } catch (const ConfigError&) {
              EXPECT_THROW(pipeline_activation_peak(shape, std::vector<ChunkActivations>(static_cast<size_t>(vpp))),
                           ConfigError)
                  << describe(shape);
              continue;
            }
            ++shapes;
            if (vpp > 1 && m % (n > 0 ? n : pp) != 0) ++uneven;
            EXPECT_EQ(warmup_microbatches(shape), schedule.num_warmup) << describe(shape);
            // Equal chunks (ties everywhere), then whole-number sizes drawn at random, some of them 0.
            for (int trial = 0; trial < 4; ++trial) {
              std::vector<ChunkActivations> chunks(static_cast<size_t>(vpp), ChunkActivations{10, 3});
              if (trial > 0) {
                for (ChunkActivations& c : chunks) {
                  c.kept = static_cast<double>(random() % 8);
                  c.transient = static_cast<double>(random() % 24);
                }
              }
              std::vector<std::vector<int64_t>> live_per_backward;
              const PipelinePeak expected = simulated_peak(schedule, chunks, live_per_backward);
              const PipelinePeak peak = pipeline_activation_peak(shape, chunks);
              ASSERT_EQ(peak.found, expected.found) << describe(shape);
              EXPECT_EQ(peak.bytes, expected.bytes) << describe(shape) << " trial " << trial;
              EXPECT_EQ(peak.backward, expected.backward) << describe(shape) << " trial " << trial;
              EXPECT_EQ(peak.chunk, expected.chunk) << describe(shape) << " trial " << trial;
              EXPECT_EQ(peak.live, expected.live) << describe(shape) << " trial " << trial;
              if (trial > 0) continue;
              ASSERT_EQ(static_cast<int64_t>(live_per_backward.size()), m * vpp) << describe(shape);
              int64_t most_live = 0;
              for (int64_t k = 0; k < m * vpp; ++k) {
                const std::vector<int64_t> live = live_contexts_before_backward(shape, k);
                EXPECT_EQ(live, live_per_backward[static_cast<size_t>(k)]) << describe(shape) << " backward " << k;
                int64_t alive = 0;
                for (const int64_t n_live : live) alive += n_live;
                most_live = std::max(most_live, alive);
              }
              EXPECT_EQ(most_live, schedule.max_live_contexts) << describe(shape);
              if (vpp == 1) {
                EXPECT_EQ(most_live, std::min(pp - rank, m)) << describe(shape);  // 1F1B's closed form
              }
            }
          }
        }
      }
    }
  }
  EXPECT_GT(shapes, 3000);
  EXPECT_GT(uneven, 300);
}

// 2^31 micro-batches: the same contexts alive at the peak as a small M with the same last group (the schedule
// repeats every group), where building the action list would need tens of GiB.
TEST(PlanPipelinePeak, AnyNumberOfMicrobatches) {
  const std::vector<ChunkActivations> chunks{{7, 30}, {5, 2}, {9, 11}, {4, 40}};
  for (const int64_t rank : {0, 3, 7}) {
    for (const int64_t group : {0, 12}) {
      const int64_t huge = int64_t{1} << 31;
      const int64_t small = group == 0 ? 64 : 48 + huge % group;  // 2^31 mod 12 = 8, a valid last group for PP 8
      const PipelinePeak big = pipeline_activation_peak({8, rank, 4, huge, group}, chunks);
      const PipelinePeak reference = pipeline_activation_peak({8, rank, 4, small, group}, chunks);
      EXPECT_EQ(big.live, reference.live) << "rank " << rank << " N " << group;
      EXPECT_EQ(big.bytes, reference.bytes) << "rank " << rank << " N " << group;
    }
    EXPECT_EQ(pipeline_activation_peak({8, rank, 1, int64_t{1} << 31, 0}, {{1, 0}}).live[0], 8 - rank);
  }
  // Megatron's checks see the real M: 2^31 mod 3 = 2 is a valid last group for PP 2 (2^31 - 1 mod 3 = 1 is not).
  EXPECT_NO_THROW(pipeline_activation_peak({2, 0, 2, int64_t{1} << 31, 3}, {{1, 0}, {1, 0}}));
}

}  // namespace
}  // namespace moecore::plan
