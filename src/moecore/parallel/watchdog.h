// The collective watchdog: a bound on every wait for a collective or point-to-point operation (moecore train's
// --distributed-timeout-minutes, Megatron's flag of the same name), and a flight recorder of each rank's last
// operations for the one-line report a rank prints when a wait passes it.
//
// This file holds the parts that need no MPI (the timeout setting, the polling loop, the recorder, the wording of
// the report); process_group.cpp starts every operation non-blocking and waits for it with poll_until, and
// arrival_board.h tells which ranks of a group reached an operation.
#pragma once

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>

namespace moecore::parallel {

using WatchdogClock = std::chrono::steady_clock;

// The longest a wait may last, in seconds; nullopt (the default outside `moecore train`): waits are unbounded.
// Throws std::invalid_argument unless positive and finite.
void set_collective_timeout(std::optional<double> seconds);
std::optional<double> collective_timeout();
// When a wait that starts now must end (nullopt: never).
std::optional<WatchdogClock::time_point> wait_deadline();

// Calls `complete` until it returns true (then returns true) or `deadline` passes (then false). Polls back to back
// at first, then yields the processor between polls, and once the wait is long sleeps briefly between them: a short
// wait costs no more than MPI_Wait, a long one leaves the cores to other ranks.
bool poll_until(const std::function<bool()>& complete, std::optional<WatchdogClock::time_point> deadline);

// This rank's last operations, newest last: kind, group, the group's sequence number (collectives) and size.
enum class OperationState : uint8_t { kStarted, kCompleted, kTimedOut };

struct OperationRecord {
  const char* op = "";   // static text: "all_reduce", "recv", ...
  std::string group;     // the process group's name
  int64_t sequence = 0;  // the group's collective count at this one (1 is the first); 0 for point-to-point
  int peer = -1;         // point-to-point: the other rank (group rank)
  int64_t elements = 0;  // elements this rank sends or reduces
  OperationState state = OperationState::kStarted;
};

class FlightRecorder {
 public:
  static constexpr size_t kCapacity = 16;

  // Records a started operation; returns its id for complete() / timed_out().
  uint64_t start(OperationRecord record);
  void complete(uint64_t id);
  void timed_out(uint64_t id);
  // The newest `count` records, oldest first, as "all_reduce on dp #12 (1024 elements) completed, ...".
  std::string summary(size_t count) const;

 private:
  OperationRecord* find(uint64_t id);

  std::array<OperationRecord, kCapacity> records_{};
  uint64_t next_id_ = 0;  // records_[id % kCapacity] holds id while id + kCapacity > next_id_
};

// This process's recorder (the training thread's operations).
FlightRecorder& flight_recorder();

// What the arrival board told of one rank of a group: how many collectives it had started and completed on the
// group, and whether it moved (polled MPI) while the report watched; nullopt where it could not be read in time.
struct PeerProgress {
  std::optional<int64_t> started;
  std::optional<int64_t> completed;
  bool progressing = true;
};

// Which ranks of a group reached collective number `sequence`, ranks named by `world_ranks[r]`: "ranks 1 did not
// arrive"; ranks that arrived but stood still ("arrived but made no progress": stopped, or busy outside MPI);
// ranks that could not be asked, with those known to have arrived.
std::string describe_arrivals(std::span<const int> world_ranks, int64_t sequence, std::span<const PeerProgress> peers);

// "0,1,3"
std::string join_ranks(std::span<const int> ranks);

// The minutes of the timeout as the report prints them ("0.1", "10").
std::string timeout_minutes_text(double seconds);

}  // namespace moecore::parallel
