// A timeline of a training step for Perfetto / chrome://tracing: complete events ("ph": "X") of the Trace Event
// Format (https://docs.google.com/document/d/1CvAClvFfyA5R-PhYUmn5OOQtYMH4h6I0nSsKchNAySU), one process per rank and
// one track per thread that records. Recording is off until start(); scopes and record() are no-ops then (one relaxed
// atomic load), so instrumented code costs nothing outside the profiled steps.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

namespace moecore::trace {

using Clock = std::chrono::steady_clock;

// Begins recording events of process `rank` (its "pid" in the trace); clears what was recorded before.
void start(int rank);
// Ends recording (events are kept for write()).
void stop();
bool enabled();
// Writes {"traceEvents": [...], "displayTimeUnit": "ms"} to `path` (atomically); throws std::runtime_error naming
// the path when it cannot.
void write(const std::string& path);
// Number of events recorded (tests).
size_t event_count();

// One event [begin, end) named `name` in category `category` on the calling thread's track. `name` is copied.
void record(const std::string& name, const char* category, Clock::time_point begin, Clock::time_point end);
// The same on the track named `track` (created at its first event) instead of the thread's: for work that is not
// a thread's own, such as a non-blocking collective in flight while the thread computes.
void record_on_track(const char* track, const std::string& name, const char* category, Clock::time_point begin,
                     Clock::time_point end);

// The time from construction to destruction as one event. When recording is off a scope costs one atomic load: no
// clock read, no allocation (the name is assembled only for events that are recorded).
class Scope {
 public:
  Scope(const char* name, const char* category);
  // The event is named prefix + index + suffix, e.g. ("layer ", 3, " forward").
  Scope(const char* prefix, int64_t index, const char* suffix, const char* category);
  Scope(std::string name, const char* category);
  ~Scope();
  Scope(const Scope&) = delete;
  Scope& operator=(const Scope&) = delete;

 private:
  const char* prefix_;
  int64_t index_ = -1;  // < 0: the name is prefix_ (or owned_) alone
  const char* suffix_ = "";
  std::string owned_;
  const char* category_;
  bool active_;
  Clock::time_point begin_;
};

}  // namespace moecore::trace
