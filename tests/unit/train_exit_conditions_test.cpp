// Megatron's checkpoint_and_decide_exit: --exit-duration-in-mins counts from the start of the process (Megatron's
// _TRAIN_START_TIME, taken before anything else runs), so the time spent before training (data, model, checkpoint
// load) counts too.
#include <gtest/gtest.h>

#include <chrono>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "moecore/config/arguments.h"
#include "moecore/train/checkpointing.h"
#include "moecore/train/training_setup.h"
#include "moecore/util/process_start.h"
#include "test_recipe.h"

namespace moecore {
namespace {

TrainingArgs recipe_args(const std::string& exit_minutes) {
  std::vector<std::string> flags = test::recipe_flags("mixtral-tiny");
  flags.insert(flags.end(), {"--eval-iters", "0", "--exit-duration-in-mins", exit_minutes});
  const TrainingArgs args = parse_train_args(flags);
  return with_padded_vocabulary(args, build_vocabulary(args));
}

double seconds_since_process_start() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count() -
         process_start_seconds();
}

bool exits_after_first_iteration(const TrainingArgs& args, std::ostringstream& log) {
  const parallel::ParallelState parallel = parallel::ParallelState::single_process();
  ModelAndOptimizer mo = build_model_and_optimizer(args, parallel);
  LRSchedule schedule(lr_schedule_config(args));
  const CheckpointTarget target{*mo.model, *mo.ddp, *mo.optimizer, schedule, args.model.vocab_size};
  Checkpointer checkpointer(args, parallel, log);
  TrainingProgress progress;
  progress.iteration = 1;
  return checkpointer.after_iteration(target, progress);
}

TEST(ExitConditions, DurationCountsFromTheProcessStart) {
  // 0.01 minutes = 0.6 s: once the process is older than that, the first check exits, however recently training
  // (the Checkpointer) began.
  while (seconds_since_process_start() < 0.7) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  std::ostringstream log;
  EXPECT_TRUE(exits_after_first_iteration(recipe_args("0.01"), log));
  EXPECT_NE(log.str().find("exiting program after"), std::string::npos) << log.str();
  std::ostringstream not_yet;
  EXPECT_FALSE(exits_after_first_iteration(recipe_args("10"), not_yet)) << not_yet.str();
}

}  // namespace
}  // namespace moecore
