#include "moecore/parallel/turn_taking.h"

#include <omp.h>

#include <array>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <stdexcept>
#include <thread>

#include "moecore/tensor/memory_tracker.h"
#include "moecore/util/trace.h"

namespace moecore::parallel {
namespace {

class TurnTaking {
 public:
  ~TurnTaking() {
    {
      const std::lock_guard lock(mutex_);
      stop_ = true;
    }
    changed_.notify_all();
    if (helper_.joinable()) helper_.join();
  }

  void run(const std::function<void()>& first, const std::function<void()>& second, const LaneState& state) {
    if (lane_ >= 0) throw std::logic_error("run_taking_turns inside run_taking_turns");
    const Settings initial = take_settings(state);
    {
      const std::lock_guard lock(mutex_);
      state_ = &state;
      settings_ = {initial, initial};
      second_ = &second;
      threads_ = omp_get_max_threads();
      turn_ = 0;
      done_ = {false, false};
      errors_ = {nullptr, nullptr};
      ++generation_;
      if (!helper_.joinable()) helper_ = std::thread([this] { helper_loop(); });
    }
    changed_.notify_all();
    run_lane(0, first);
    std::unique_lock lock(mutex_);
    changed_.wait(lock, [&] { return done_[1]; });
    second_ = nullptr;
    state_ = nullptr;
    put_back(initial, state);
    if (errors_[0]) std::rethrow_exception(errors_[0]);
    if (errors_[1]) std::rethrow_exception(errors_[1]);
  }

  void pass_turn() {
    if (lane_ < 0) return;
    const int other = 1 - lane_;
    std::unique_lock lock(mutex_);
    if (done_[static_cast<size_t>(other)]) return;
    Settings& mine = settings_[static_cast<size_t>(lane_)];
    mine = take_settings(*state_);
    turn_ = other;
    changed_.notify_all();
    {
      const trace::Scope scope("the other micro-batch's turn", "overlap");
      changed_.wait(lock, [&] { return turn_ == lane_; });
    }
    put_back(mine, *state_);
  }

  static bool in_lane() { return lane_ >= 0; }

 private:
  void helper_loop() {
    uint64_t seen = 0;
    for (;;) {
      const std::function<void()>* work = nullptr;
      {
        std::unique_lock lock(mutex_);
        changed_.wait(lock, [&] { return stop_ || (generation_ != seen && turn_ == 1); });
        if (stop_) return;
        seen = generation_;
        work = second_;
        omp_set_num_threads(threads_);
      }
      run_lane(1, *work);
    }
  }

  // What a lane keeps while the other one runs.
  struct Settings {
    std::any scoped;
    ActivationOwner owner = ActivationOwner::kOther;
  };
  static Settings take_settings(const LaneState& state) {
    Settings settings;
    if (state.save) settings.scoped = state.save();
    settings.owner = MemoryTracker::instance().owner();
    return settings;
  }
  static void put_back(const Settings& settings, const LaneState& state) {
    if (state.restore) state.restore(settings.scoped);
    MemoryTracker::instance().set_owner(settings.owner);
  }

  // Runs `work` as lane `lane` once it is that lane's turn (from the caller's settings); then hands the turn over for
  // good.
  void run_lane(const int lane, const std::function<void()>& work) {
    {
      std::unique_lock lock(mutex_);
      changed_.wait(lock, [&] { return turn_ == lane; });
      put_back(settings_[static_cast<size_t>(lane)], *state_);
    }
    lane_ = lane;
    std::exception_ptr error;
    try {
      work();
    } catch (...) {
      error = std::current_exception();
    }
    lane_ = -1;
    {
      const std::lock_guard lock(mutex_);
      errors_[static_cast<size_t>(lane)] = error;
      done_[static_cast<size_t>(lane)] = true;
      turn_ = 1 - lane;
    }
    changed_.notify_all();
  }

  std::mutex mutex_;
  std::condition_variable changed_;
  std::thread helper_;
  const std::function<void()>* second_ = nullptr;
  const LaneState* state_ = nullptr;
  std::array<Settings, 2> settings_;
  int threads_ = 1;
  int turn_ = 0;
  uint64_t generation_ = 0;
  bool stop_ = false;
  std::array<bool, 2> done_{true, true};
  std::array<std::exception_ptr, 2> errors_;
  static thread_local int lane_;
};

thread_local int TurnTaking::lane_ = -1;

TurnTaking& turn_taking() {
  static TurnTaking instance;
  return instance;
}

}  // namespace

void run_taking_turns(const std::function<void()>& first, const std::function<void()>& second, const LaneState& state) {
  turn_taking().run(first, second, state);
}

void pass_turn() {
  if (TurnTaking::in_lane()) turn_taking().pass_turn();
}

bool taking_turns() { return TurnTaking::in_lane(); }

}  // namespace moecore::parallel
