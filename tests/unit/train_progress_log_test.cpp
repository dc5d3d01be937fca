// progress.txt as Megatron's get_start_time_from_progress_log reads it: the earliest "Starting job" of the latest run
// of jobs with this world size, and the FLOPs of the last checkpoint committed before it (async saves count once
// "Saved async checkpoint" follows their "Saving async checkpoint").
#include <gtest/gtest.h>

#include <ctime>
#include <string>

#include "moecore/train/progress_log.h"

namespace moecore {
namespace {

std::string line(const std::string& time, const int world, const std::string& event) {
  return time + "\tJob ID: 42\t# GPUs: " + std::to_string(world) + "\t" + event + "\n";
}
std::string saved(const char* kind, const int iteration, const double flops) {
  return std::string(kind) + "\tIteration: " + std::to_string(iteration) +
         "\tJob throughput: 1.0 TFLOP/s/GPU\tCumulative throughput: 1.0 TFLOP/s/GPU\tFloating-point operations: " +
         std::to_string(flops) + "\tTokens (in billions): 0.01";
}
double local_seconds(const char* text) {
  std::tm local{};
  strptime(text, "%Y-%m-%d %H:%M:%S", &local);
  local.tm_isdst = -1;
  return static_cast<double>(std::mktime(&local));
}

TEST(ProgressLog, StartOfTheLatestRunOfJobsWithThisWorldSize) {
  const std::string text = line("2026-12-01 10:00:00", 4, "Starting job") +
                           line("2026-12-01 10:10:00", 4, saved("Saved checkpoint", 100, 1e15)) +
                           line("2026-12-01 11:00:00", 4, "Starting job") +  // not the earliest: kept as it was
                           line("2026-12-01 11:10:00", 4, saved("Saved checkpoint", 200, 2e15));
  const std::optional<ProgressStart> start = progress_start(text, 4);
  ASSERT_TRUE(start);
  EXPECT_DOUBLE_EQ(start->seconds, local_seconds("2026-12-01 10:00:00"));
  EXPECT_DOUBLE_EQ(start->floating_point_operations, 0.0);
  EXPECT_FALSE(progress_start(text, 8));  // no job of 8 processes
}

TEST(ProgressLog, AnotherWorldSizeStartsTheSearchAgain) {
  const std::string text = line("2026-12-01 10:00:00", 4, "Starting job") +
                           line("2026-12-01 10:10:00", 4, saved("Saved checkpoint", 100, 1e15)) +
                           line("2026-12-01 11:00:00", 8, "Starting job") +
                           line("2026-12-01 11:10:00", 8, saved("Saved checkpoint", 150, 1.5e15)) +
                           line("2026-12-01 12:00:00", 4, "Starting job");
  const std::optional<ProgressStart> start = progress_start(text, 4);
  ASSERT_TRUE(start);
  EXPECT_DOUBLE_EQ(start->seconds, local_seconds("2026-12-01 12:00:00"));
  EXPECT_DOUBLE_EQ(start->floating_point_operations, 1.5e15);  // the 8-process job's last save
}

TEST(ProgressLog, AnAsyncSaveCountsOnceCommitted) {
  const std::string scheduled = line("2026-12-01 10:00:00", 2, "Starting job") +
                                line("2026-12-01 10:10:00", 2, saved("Saving async checkpoint", 100, 3e14));
  const std::string restarted_before = scheduled + line("2026-12-01 10:20:00", 1, "Starting job");
  EXPECT_DOUBLE_EQ(progress_start(restarted_before, 1)->floating_point_operations, 0.0);
  const std::string committed = scheduled + line("2026-12-01 10:11:00", 2, "Saved async checkpoint\tIteration: 100") +
                                line("2026-12-01 10:20:00", 1, "Starting job");
  EXPECT_DOUBLE_EQ(progress_start(committed, 1)->floating_point_operations, 3e14);
}

TEST(ProgressLog, LinesItDidNotWriteAreSkipped) {
  const std::string text = "garbage\n" + line("2026-12-01 10:00:00", 2, "Starting job") + "a\tb\tc\td\n";
  ASSERT_TRUE(progress_start(text, 2));
  EXPECT_FALSE(progress_start("", 2));
}

}  // namespace
}  // namespace moecore
