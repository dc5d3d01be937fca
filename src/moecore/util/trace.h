// A timeline of a training step for Perfetto / chrome://tracing: complete events ("ph": "X") of the Trace Event
// Format (https://docs.google.com/document/d/1CvAClvFfyA5R-PhYUmn5OOQtYMH4h6I0nSsKchNAySU), one process per rank and
// one track per thread that records. Recording is off until start(); scopes and record() are no-ops then (one relaxed
// atomic load), so instrumented code costs nothing outside the profiled steps.
#pragma once

#include <chrono>
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

// The time from construction to destruction as one event.
class Scope {
 public:
  Scope(const char* name, const char* category) : Scope(std::string(name), category) {}
  Scope(std::string name, const char* category);
  ~Scope();
  Scope(const Scope&) = delete;
  Scope& operator=(const Scope&) = delete;

 private:
  std::string name_;
  const char* category_;
  Clock::time_point begin_;
  bool active_;
};

}  // namespace moecore::trace
