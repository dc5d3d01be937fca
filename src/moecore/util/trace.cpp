#include "moecore/util/trace.h"

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "moecore/util/atomic_file.h"
#include "moecore/util/json_string.h"

namespace moecore::trace {
namespace {

struct Event {
  std::string name;
  const char* category;
  int64_t begin_us;
  int64_t duration_us;
  int tid;
};

struct Recorder {
  std::atomic<bool> on{false};
  std::mutex mutex;
  std::vector<Event> events;
  int rank = 0;
  Clock::time_point origin{};
  std::vector<std::string> track_names;  // by track number: the first thread to record is "training"
  std::vector<bool> track_is_named;      // named tracks' events may overlap; a thread's nest
  int thread_tracks = 0;
};

Recorder& recorder() {
  static Recorder r;
  return r;
}

// A small track number per thread, in the order threads first record.
int thread_track() {
  thread_local int tid = -1;
  if (tid < 0) {
    Recorder& r = recorder();
    const std::lock_guard<std::mutex> lock(r.mutex);
    tid = static_cast<int>(r.track_names.size());
    r.track_names.push_back(r.thread_tracks == 0 ? std::string("training")
                                                 : "thread " + std::to_string(r.thread_tracks));
    r.track_is_named.push_back(false);
    ++r.thread_tracks;
  }
  return tid;
}

// The track named `name`, created on first use. Caller holds the mutex.
int named_track(Recorder& r, const char* name) {
  for (size_t tid = 0; tid < r.track_names.size(); ++tid) {
    if (r.track_names[tid] == name) return static_cast<int>(tid);
  }
  r.track_names.emplace_back(name);
  r.track_is_named.push_back(true);
  return static_cast<int>(r.track_names.size()) - 1;
}

// Events of a named track may overlap (two collectives in flight at once), which Perfetto's importer does not
// accept on one track: each goes to the first lane of its track that is free at its start, extra lanes becoming
// tracks "<name> (2)", "(3)"... Returns the events with their lanes' track numbers, and extends `names`.
std::vector<Event> place_in_lanes(const std::vector<Event>& events, const std::vector<bool>& is_named,
                                  std::vector<std::string>& names) {
  std::vector<Event> placed = events;
  for (size_t track = 0; track < is_named.size(); ++track) {
    if (!is_named[track]) continue;
    std::vector<size_t> order;
    for (size_t i = 0; i < placed.size(); ++i) {
      if (placed[i].tid == static_cast<int>(track)) order.push_back(i);
    }
    std::stable_sort(order.begin(), order.end(),
                     [&](const size_t a, const size_t b) { return placed[a].begin_us < placed[b].begin_us; });
    std::vector<std::pair<int, int64_t>> lanes;  // track number, end of its last event
    for (const size_t i : order) {
      Event& e = placed[i];
      auto lane = std::find_if(lanes.begin(), lanes.end(), [&](const auto& l) { return l.second <= e.begin_us; });
      if (lane == lanes.end()) {
        const int tid = lanes.empty() ? static_cast<int>(track) : static_cast<int>(names.size());
        if (!lanes.empty()) names.push_back(names[track] + " (" + std::to_string(lanes.size() + 1) + ")");
        lanes.emplace_back(tid, 0);
        lane = lanes.end() - 1;
      }
      e.tid = lane->first;
      lane->second = e.begin_us + e.duration_us;
    }
  }
  return placed;
}

void append_event(Recorder& r, const std::string& name, const char* category, const Clock::time_point begin,
                  const Clock::time_point end, const int tid) {
  const auto us = [&](const Clock::time_point t) {
    return std::chrono::duration_cast<std::chrono::microseconds>(t - r.origin).count();
  };
  r.events.push_back(Event{name, category, us(begin), std::max<int64_t>(us(end) - us(begin), 0), tid});
}

}  // namespace

void start(const int rank) {
  Recorder& r = recorder();
  {
    const std::lock_guard<std::mutex> lock(r.mutex);
    r.events.clear();
    r.rank = rank;
    r.origin = Clock::time_point{};  // the monotonic clock's epoch: the ranks of one host share a time axis
  }
  r.on.store(true, std::memory_order_release);
}

void stop() { recorder().on.store(false, std::memory_order_release); }

bool enabled() { return recorder().on.load(std::memory_order_relaxed); }

size_t event_count() {
  Recorder& r = recorder();
  const std::lock_guard<std::mutex> lock(r.mutex);
  return r.events.size();
}

void record(const std::string& name, const char* category, const Clock::time_point begin, const Clock::time_point end) {
  if (!enabled()) return;
  Recorder& r = recorder();
  const int tid = thread_track();
  const std::lock_guard<std::mutex> lock(r.mutex);
  append_event(r, name, category, begin, end, tid);
}

void record_on_track(const char* track, const std::string& name, const char* category, const Clock::time_point begin,
                     const Clock::time_point end) {
  if (!enabled()) return;
  Recorder& r = recorder();
  const std::lock_guard<std::mutex> lock(r.mutex);
  append_event(r, name, category, begin, end, named_track(r, track));
}

Scope::Scope(const char* name, const char* category) : prefix_(name), category_(category), active_(enabled()) {
  if (active_) begin_ = Clock::now();
}

Scope::Scope(const char* prefix, const int64_t index, const char* suffix, const char* category)
    : prefix_(prefix), index_(index), suffix_(suffix), category_(category), active_(enabled()) {
  if (active_) begin_ = Clock::now();
}

Scope::Scope(std::string name, const char* category)
    : prefix_(nullptr), owned_(std::move(name)), category_(category), active_(enabled()) {
  if (active_) begin_ = Clock::now();
}

Scope::~Scope() {
  if (!active_) return;
  const auto end = Clock::now();
  std::string name = prefix_ != nullptr ? std::string(prefix_) : owned_;
  if (index_ >= 0) name += std::to_string(index_) + suffix_;
  record(name, category_, begin_, end);
}

void write(const std::string& path) {
  Recorder& r = recorder();
  std::string out = "{\"displayTimeUnit\": \"ms\", \"traceEvents\": [\n";
  {
    const std::lock_guard<std::mutex> lock(r.mutex);
    const std::string pid = std::to_string(r.rank);
    std::vector<std::string> track_names = r.track_names;
    const std::vector<Event> events = place_in_lanes(r.events, r.track_is_named, track_names);
    out += "{\"name\": \"process_name\", \"ph\": \"M\", \"pid\": " + pid +
           ", \"tid\": 0, \"args\": {\"name\": \"rank " + pid + "\"}}";
    for (size_t tid = 0; tid < track_names.size(); ++tid) {
      out += ",\n{\"name\": \"thread_name\", \"ph\": \"M\", \"pid\": " + pid + ", \"tid\": " + std::to_string(tid) +
             ", \"args\": {\"name\": ";
      out += json_string(track_names[tid]);
      out += "}}";
    }
    for (const Event& e : events) {
      out += ",\n{\"name\": ";
      out += json_string(e.name);
      out += ", \"cat\": \"" + std::string(e.category) + "\", \"ph\": \"X\", \"ts\": " + std::to_string(e.begin_us) +
             ", \"dur\": " + std::to_string(e.duration_us) + ", \"pid\": " + pid +
             ", \"tid\": " + std::to_string(e.tid) + "}";
    }
  }
  out += "\n]}\n";
  if (const std::string problem = replace_file(path, out); !problem.empty()) {
    throw std::runtime_error(path + ": cannot write the trace (" + problem + ")");
  }
}

}  // namespace moecore::trace
