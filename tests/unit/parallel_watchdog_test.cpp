// The collective watchdog's MPI-free parts: the wait with a deadline, the timeout setting, the flight recorder and
// the wording of which ranks arrived.
#include <gtest/gtest.h>

#include <chrono>
#include <optional>
#include <stdexcept>
#include <vector>

#include "moecore/parallel/watchdog.h"

namespace moecore::parallel {
namespace {

using std::chrono::milliseconds;

TEST(Watchdog, PollUntilReturnsOnceComplete) {
  int polls = 0;
  EXPECT_TRUE(poll_until([&] { return ++polls == 3; }, WatchdogClock::now() + std::chrono::hours(1)));
  EXPECT_EQ(polls, 3);
}

TEST(Watchdog, PollUntilWithoutDeadlineWaitsForCompletion) {
  int polls = 0;
  EXPECT_TRUE(poll_until([&] { return ++polls == 1000; }, std::nullopt));
  EXPECT_EQ(polls, 1000);
}

TEST(Watchdog, PollUntilGivesUpAtTheDeadline) {
  int polls = 0;
  const auto deadline = WatchdogClock::now() + milliseconds(20);
  EXPECT_FALSE(poll_until([&] { return ++polls < 0; }, deadline));
  EXPECT_GE(WatchdogClock::now(), deadline);
  EXPECT_GT(polls, 1);
}

TEST(Watchdog, CompletionSeenAtTheDeadlineCounts) {
  // A deadline already past: the operation is still tested once more before the wait gives up.
  int polls = 0;
  EXPECT_TRUE(poll_until([&] { return ++polls == 2; }, WatchdogClock::now() - milliseconds(1)));
}

TEST(Watchdog, TimeoutSetting) {
  set_collective_timeout(std::nullopt);
  EXPECT_FALSE(collective_timeout());
  EXPECT_FALSE(wait_deadline());
  set_collective_timeout(6.0);
  EXPECT_EQ(collective_timeout(), 6.0);
  ASSERT_TRUE(wait_deadline());
  EXPECT_GT(*wait_deadline(), WatchdogClock::now() + std::chrono::seconds(5));
  EXPECT_THROW(set_collective_timeout(0.0), std::invalid_argument);
  EXPECT_THROW(set_collective_timeout(-1.0), std::invalid_argument);
  set_collective_timeout(std::nullopt);
  EXPECT_EQ(timeout_minutes_text(6.0), "0.1");
  EXPECT_EQ(timeout_minutes_text(600.0), "10");
}

TEST(Watchdog, FlightRecorderKeepsTheNewestOperations) {
  FlightRecorder recorder;
  EXPECT_EQ(recorder.summary(4), "none");
  const uint64_t first = recorder.start({.op = "all_reduce", .group = "dp", .sequence = 1, .elements = 8});
  recorder.complete(first);
  const uint64_t second = recorder.start({.op = "recv", .group = "pp", .peer = 1, .elements = 4});
  EXPECT_EQ(recorder.summary(4),
            "all_reduce on dp #1 (8 elements) completed, recv from rank 1 on pp (4 elements) waiting");
  recorder.timed_out(second);
  EXPECT_EQ(recorder.summary(1), "recv from rank 1 on pp (4 elements) timed out");
  for (int64_t i = 0; i < 40; ++i) recorder.start({.op = "broadcast", .group = "world", .sequence = 2 + i});
  recorder.complete(first);  // long overwritten: ignored
  EXPECT_EQ(recorder.summary(2),
            "broadcast on world #40 (0 elements) waiting, broadcast on world #41 (0 elements) waiting");
}

TEST(Watchdog, DescribesWhichRanksArrived) {
  const std::vector<int> ranks{0, 1, 2, 3};
  const PeerProgress unknown{};
  const auto at = [](int64_t started, int64_t completed, bool progressing = true) {
    return PeerProgress{started, completed, progressing};
  };
  using Peers = std::vector<PeerProgress>;
  EXPECT_EQ(describe_arrivals(ranks, 5, Peers{at(5, 4), at(4, 4), at(6, 5), at(4, 4)}), "ranks 1,3 did not arrive");
  // Rank 1 started the collective, then stood still (a stopped process); rank 2 completed it and moved on.
  EXPECT_EQ(describe_arrivals(ranks, 5, Peers{at(5, 4), at(5, 4, false), at(6, 5, false), at(5, 4)}),
            "ranks 1 arrived but made no progress (stopped, or busy outside MPI)");
  EXPECT_EQ(describe_arrivals(ranks, 5, Peers{at(5, 4), unknown, at(5, 4), at(4, 4)}),
            "ranks 3 did not arrive; ranks 1 could not be asked; ranks 0,2 arrived");
  EXPECT_EQ(describe_arrivals(std::vector<int>{4, 6}, 2, Peers{at(2, 1), unknown}),
            "ranks 6 could not be asked; ranks 4 arrived");
  EXPECT_EQ(describe_arrivals(std::vector<int>{4, 6}, 2, Peers{unknown, unknown}),
            "ranks 4,6 could not be asked; no rank is known to have arrived");
  EXPECT_EQ(describe_arrivals(std::vector<int>{0, 1}, 3, Peers{at(3, 2), at(3, 2)}),
            "every rank arrived (ranks 0,1), the operation stalled inside MPI");
}

}  // namespace
}  // namespace moecore::parallel
