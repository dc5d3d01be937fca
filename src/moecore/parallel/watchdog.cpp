#include "moecore/parallel/watchdog.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <stdexcept>
#include <string_view>
#include <thread>
#include <vector>

namespace moecore::parallel {
namespace {

std::optional<double>& timeout_seconds() {
  static std::optional<double> seconds;
  return seconds;
}

const char* state_name(const OperationState state) {
  switch (state) {
    case OperationState::kStarted: return "waiting";
    case OperationState::kCompleted: return "completed";
    case OperationState::kTimedOut: return "timed out";
  }
  return "";
}

}  // namespace

void set_collective_timeout(const std::optional<double> seconds) {
  if (seconds && !(std::isfinite(*seconds) && *seconds > 0.0)) {
    throw std::invalid_argument("the collective timeout must be a positive number of seconds");
  }
  timeout_seconds() = seconds;
}

std::optional<double> collective_timeout() { return timeout_seconds(); }

std::optional<WatchdogClock::time_point> wait_deadline() {
  const std::optional<double> seconds = timeout_seconds();
  if (!seconds) return std::nullopt;
  return WatchdogClock::now() +
         std::chrono::duration_cast<WatchdogClock::duration>(std::chrono::duration<double>(*seconds));
}

bool poll_until(const std::function<bool()>& complete, const std::optional<WatchdogClock::time_point> deadline) {
  using std::chrono::microseconds;
  // Back-to-back polls for about as long as a small collective takes, then yields (other ranks may share the
  // cores), then short sleeps: a sleep adds at most its length to a wait already hundreds of times longer.
  constexpr auto kSpin = microseconds(50);
  constexpr auto kYield = microseconds(5000);
  constexpr auto kSleep = microseconds(100);
  const WatchdogClock::time_point began = WatchdogClock::now();
  while (true) {
    if (complete()) return true;
    const WatchdogClock::time_point now = WatchdogClock::now();
    if (deadline && now >= *deadline) return complete();
    const auto waited = now - began;
    if (waited < kSpin) continue;
    if (waited < kYield) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(kSleep);
    }
  }
}

uint64_t FlightRecorder::start(OperationRecord record) {
  const uint64_t id = next_id_++;
  records_[id % kCapacity] = std::move(record);
  return id;
}

OperationRecord* FlightRecorder::find(const uint64_t id) {
  if (id >= next_id_ || next_id_ - id > kCapacity) return nullptr;  // not started, or overwritten since
  return &records_[id % kCapacity];
}

void FlightRecorder::complete(const uint64_t id) {
  if (OperationRecord* record = find(id)) record->state = OperationState::kCompleted;
}

void FlightRecorder::timed_out(const uint64_t id) {
  if (OperationRecord* record = find(id)) record->state = OperationState::kTimedOut;
}

std::string FlightRecorder::summary(const size_t count) const {
  const uint64_t shown = std::min<uint64_t>({count, kCapacity, next_id_});
  std::string text;
  for (uint64_t id = next_id_ - shown; id < next_id_; ++id) {
    const OperationRecord& record = records_[id % kCapacity];
    if (!text.empty()) text.append(", ");
    text.append(record.op);
    if (record.peer >= 0) {
      text.append(std::string_view(record.op) == "send" ? " to rank " : " from rank ");
      text.append(std::to_string(record.peer));
    }
    text.append(" on ").append(record.group);
    if (record.sequence > 0) text.append(" #").append(std::to_string(record.sequence));
    text.append(" (").append(std::to_string(record.elements)).append(" elements) ").append(state_name(record.state));
  }
  return text.empty() ? "none" : text;
}

FlightRecorder& flight_recorder() {
  static FlightRecorder recorder;
  return recorder;
}

std::string join_ranks(const std::span<const int> ranks) {
  std::string text;
  for (const int rank : ranks) {
    if (!text.empty()) text += ',';
    text += std::to_string(rank);
  }
  return text;
}

std::string describe_arrivals(const std::span<const int> world_ranks, const int64_t sequence,
                              const std::span<const PeerProgress> peers) {
  std::vector<int> arrived, missing, stalled, unknown;
  for (size_t r = 0; r < world_ranks.size() && r < peers.size(); ++r) {
    const PeerProgress& peer = peers[r];
    if (!peer.started) {
      unknown.push_back(world_ranks[r]);
    } else if (*peer.started < sequence) {
      missing.push_back(world_ranks[r]);
    } else if (!peer.progressing && peer.completed.value_or(0) < sequence) {
      stalled.push_back(world_ranks[r]);
    } else {
      arrived.push_back(world_ranks[r]);
    }
  }
  std::vector<std::string> parts;
  if (!missing.empty()) parts.push_back("ranks " + join_ranks(missing) + " did not arrive");
  if (!stalled.empty()) {
    parts.push_back("ranks " + join_ranks(stalled) + " arrived but made no progress (stopped, or busy outside MPI)");
  }
  if (!unknown.empty()) parts.push_back("ranks " + join_ranks(unknown) + " could not be asked");
  if (parts.empty()) return "every rank arrived (ranks " + join_ranks(arrived) + "), the operation stalled inside MPI";
  if (!unknown.empty()) {
    parts.push_back(arrived.empty() ? "no rank is known to have arrived" : "ranks " + join_ranks(arrived) + " arrived");
  }
  std::string text;
  for (const std::string& part : parts) text.append(text.empty() ? "" : "; ").append(part);
  return text;
}

std::string timeout_minutes_text(const double seconds) {
  char text[32];
  std::snprintf(text, sizeof(text), "%g", seconds / 60.0);
  return text;
}

}  // namespace moecore::parallel
