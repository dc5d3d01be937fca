#include "moecore/util/trace.h"

#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <fstream>
#include <mutex>
#include <stdexcept>
#include <vector>

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
  int next_tid = 0;
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
    tid = r.next_tid++;
  }
  return tid;
}

void append_json_string(std::string& out, const std::string& text) {
  out += '"';
  for (const char c : text) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char escaped[8];
      std::snprintf(escaped, sizeof escaped, "\\u%04x", c);
      out += escaped;
    } else {
      out += c;
    }
  }
  out += '"';
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
  const auto us = [&](const Clock::time_point t) {
    return std::chrono::duration_cast<std::chrono::microseconds>(t - r.origin).count();
  };
  r.events.push_back(Event{name, category, us(begin), std::max<int64_t>(us(end) - us(begin), 0), tid});
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
    out += "{\"name\": \"process_name\", \"ph\": \"M\", \"pid\": " + pid +
           ", \"tid\": 0, \"args\": {\"name\": \"rank " + pid + "\"}}";
    for (int tid = 0; tid < r.next_tid; ++tid) {
      out += ",\n{\"name\": \"thread_name\", \"ph\": \"M\", \"pid\": " + pid + ", \"tid\": " + std::to_string(tid) +
             ", \"args\": {\"name\": \"" + (tid == 0 ? std::string("training") : "thread " + std::to_string(tid)) +
             "\"}}";
    }
    for (const Event& e : r.events) {
      out += ",\n{\"name\": ";
      append_json_string(out, e.name);
      out += ", \"cat\": \"" + std::string(e.category) + "\", \"ph\": \"X\", \"ts\": " + std::to_string(e.begin_us) +
             ", \"dur\": " + std::to_string(e.duration_us) + ", \"pid\": " + pid +
             ", \"tid\": " + std::to_string(e.tid) + "}";
    }
  }
  out += "\n]}\n";
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  {
    std::ofstream file(tmp, std::ios::binary | std::ios::trunc);
    if (!file || !file.write(out.data(), static_cast<std::streamsize>(out.size())) || !file.flush()) {
      throw std::runtime_error(path + ": cannot write the trace");
    }
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) throw std::runtime_error(path + ": cannot write the trace");
}

}  // namespace moecore::trace
