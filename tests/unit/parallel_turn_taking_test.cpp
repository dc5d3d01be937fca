#include <gtest/gtest.h>
#include <omp.h>

#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "moecore/parallel/turn_taking.h"

namespace moecore::parallel {
namespace {

// The lanes alternate at each pass_turn, the first lane starting, and each runs alone in between.
TEST(TurnTaking, LanesAlternateAtEachPass) {
  std::vector<std::string> events;
  int running = 0, most_running = 0;
  const auto step = [&](const std::string& what) {
    most_running = std::max(most_running, ++running);
    events.push_back(what);
    --running;
  };
  const std::thread::id caller = std::this_thread::get_id();
  std::thread::id first_thread, second_thread;
  run_taking_turns(
      [&] {
        first_thread = std::this_thread::get_id();
        EXPECT_TRUE(taking_turns());
        step("a1");
        pass_turn();
        step("a2");
        pass_turn();
        step("a3");
      },
      [&] {
        second_thread = std::this_thread::get_id();
        step("b1");
        pass_turn();
        step("b2");
        pass_turn();
        step("b3");
        pass_turn();  // the first lane has returned: no one to hand over to
        step("b4");
      });
  EXPECT_EQ(events, (std::vector<std::string>{"a1", "b1", "a2", "b2", "a3", "b3", "b4"}));
  EXPECT_EQ(most_running, 1);
  EXPECT_EQ(first_thread, caller);
  EXPECT_NE(second_thread, caller);
  EXPECT_FALSE(taking_turns());
}

TEST(TurnTaking, PassOutsideDoesNothingAndRunsRepeat) {
  pass_turn();
  for (int round = 0; round < 3; ++round) {
    std::vector<int> order;
    run_taking_turns([&] { order.push_back(1); }, [&] { order.push_back(2); });
    EXPECT_EQ(order, (std::vector<int>{1, 2}));
  }
}

// The helper lane runs OpenMP regions with the caller's thread count.
TEST(TurnTaking, HelperUsesTheCallersThreadCount) {
  const int before = omp_get_max_threads();
  omp_set_num_threads(1);
  int helper_threads = 0;
  run_taking_turns([] {}, [&] { helper_threads = omp_get_max_threads(); });
  EXPECT_EQ(helper_threads, 1);
  omp_set_num_threads(2);
  run_taking_turns([] {}, [&] { helper_threads = omp_get_max_threads(); });
  EXPECT_EQ(helper_threads, 2);
  omp_set_num_threads(before);
}

TEST(TurnTaking, ErrorsReachTheCallerAfterBothStop) {
  bool second_finished = false;
  try {
    run_taking_turns([] { throw std::runtime_error("first failed"); },
                     [&] {
                       pass_turn();
                       second_finished = true;
                     });
    ADD_FAILURE() << "no exception";
  } catch (const std::runtime_error& e) {
    EXPECT_EQ(std::string(e.what()), "first failed");
  }
  EXPECT_TRUE(second_finished);
  EXPECT_THROW(run_taking_turns([] {}, [] { throw std::invalid_argument("second failed"); }), std::invalid_argument);
  EXPECT_THROW(run_taking_turns([] { run_taking_turns([] {}, [] {}); }, [] {}), std::logic_error);
}

}  // namespace
}  // namespace moecore::parallel
