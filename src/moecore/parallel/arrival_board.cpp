#include "moecore/parallel/arrival_board.h"

#include <atomic>
#include <chrono>
#include <thread>

namespace moecore::parallel::arrival_board {
namespace {

// The window holds, per rank: the beat, then (started, completed) for each of kSlots groups.
constexpr int kSlots = 1024;
constexpr int kEntries = 1 + 2 * kSlots;
constexpr MPI_Aint kBeat = 0;
MPI_Aint started_index(const int slot) { return 1 + 2 * static_cast<MPI_Aint>(slot); }

struct Board {
  MPI_Win window = MPI_WIN_NULL;
  int64_t* entries = nullptr;  // this rank's kEntries counters, inside the window
  int world_rank = 0;
  int next_free = 0;  // slots below are claimed on this rank
  int64_t beats = 0;
};

Board& board() {
  static Board state;
  return state;
}

void store(const MPI_Aint index, const int64_t value) {
  std::atomic_ref<int64_t>(board().entries[index]).store(value, std::memory_order_relaxed);
}

int64_t load(const MPI_Aint index) {
  return std::atomic_ref<int64_t>(board().entries[index]).load(std::memory_order_relaxed);
}

// Runs first in MPI_Finalize (an attribute of MPI_COMM_SELF): the window must be freed while MPI still runs.
int close_board(MPI_Comm, int, void*, void*) {
  Board& state = board();
  if (state.window != MPI_WIN_NULL) {
    state.entries = nullptr;
    MPI_Win_unlock_all(state.window);
    MPI_Win_free(&state.window);
  }
  return MPI_SUCCESS;
}

// One-sided reads of `count` entries at `index` of rank `target` into `out` (nullopt on failure), bounded by
// `deadline`; returns per read whether it completed.
struct Read {
  int target = 0;
  MPI_Aint index = 0;
  int count = 1;
  int64_t values[2] = {0, 0};
  MPI_Request request = MPI_REQUEST_NULL;
  bool done = false;
};

void run_reads(std::vector<Read>& reads, const WatchdogClock::time_point deadline) {
  const Board& state = board();
  for (Read& read : reads) {
    if (MPI_Rget(read.values, read.count, MPI_INT64_T, read.target, read.index, read.count, MPI_INT64_T, state.window,
                 &read.request) != MPI_SUCCESS) {
      read.request = MPI_REQUEST_NULL;
    }
  }
  poll_until(
      [&reads] {
        bool all = true;
        for (Read& read : reads) {
          if (read.done || read.request == MPI_REQUEST_NULL) continue;
          int flag = 0;
          if (MPI_Test(&read.request, &flag, MPI_STATUS_IGNORE) != MPI_SUCCESS) {
            read.request = MPI_REQUEST_NULL;
          } else if (flag) {
            read.done = true;
          } else {
            all = false;
          }
        }
        return all;
      },
      deadline);
}

WatchdogClock::time_point after(const double seconds) {
  return WatchdogClock::now() +
         std::chrono::duration_cast<WatchdogClock::duration>(std::chrono::duration<double>(seconds));
}

}  // namespace

void open() {
  Board& state = board();
  if (state.window != MPI_WIN_NULL) return;
  void* base = nullptr;
  if (MPI_Win_allocate(static_cast<MPI_Aint>(kEntries * sizeof(int64_t)), sizeof(int64_t), MPI_INFO_NULL,
                       MPI_COMM_WORLD, &base, &state.window) != MPI_SUCCESS) {
    state.window = MPI_WIN_NULL;  // no board: reports name the ranks as unknown
    return;
  }
  MPI_Win_set_errhandler(state.window, MPI_ERRORS_RETURN);
  state.entries = static_cast<int64_t*>(base);
  for (int i = 0; i < kEntries; ++i) state.entries[i] = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &state.world_rank);
  MPI_Win_lock_all(MPI_MODE_NOCHECK, state.window);
  int keyval = MPI_KEYVAL_INVALID;
  MPI_Comm_create_keyval(MPI_COMM_NULL_COPY_FN, close_board, &keyval, nullptr);
  MPI_Comm_set_attr(MPI_COMM_SELF, keyval, nullptr);
}

int claim_slot(MPI_Comm group) {
  Board& state = board();
  if (state.window == MPI_WIN_NULL) return -1;
  int slot = state.next_free;
  if (MPI_Allreduce(MPI_IN_PLACE, &slot, 1, MPI_INT, MPI_MAX, group) != MPI_SUCCESS || slot >= kSlots) return -1;
  state.next_free = slot + 1;
  return slot;
}

void publish_started(const int slot, const int64_t started) {
  if (slot >= 0 && board().entries != nullptr) store(started_index(slot), started);
}

void publish_completed(const int slot, const int64_t completed) {
  if (slot >= 0 && board().entries != nullptr) store(started_index(slot) + 1, completed);
}

void beat() {
  Board& state = board();
  if (state.entries != nullptr) store(kBeat, ++state.beats);
}

std::vector<PeerProgress> read(const int slot, const std::span<const int> world_ranks, const double watch_seconds,
                               const double seconds) {
  const Board& state = board();
  std::vector<PeerProgress> peers(world_ranks.size());
  if (slot < 0 || state.entries == nullptr) {
    for (PeerProgress& peer : peers) peer.started.reset();
    return peers;
  }
  // The beats, then after the watch the beats again with the counts.
  std::vector<Read> first, second;
  for (const int rank : world_ranks) {
    if (rank == state.world_rank) continue;
    first.push_back({.target = rank, .index = kBeat});
    second.push_back({.target = rank, .index = kBeat});
    second.push_back({.target = rank, .index = started_index(slot), .count = 2});
  }
  run_reads(first, after(seconds));
  std::this_thread::sleep_for(std::chrono::duration<double>(watch_seconds));
  run_reads(second, after(seconds));
  size_t next = 0;
  for (size_t i = 0; i < world_ranks.size(); ++i) {
    PeerProgress& peer = peers[i];
    if (world_ranks[i] == state.world_rank) {
      peer.started = load(started_index(slot));
      peer.completed = load(started_index(slot) + 1);
      continue;
    }
    const Read& beat_before = first[next / 2];
    const Read& beat_after = second[next];
    const Read& counts = second[next + 1];
    next += 2;
    if (counts.done) {
      peer.started = counts.values[0];
      peer.completed = counts.values[1];
    }
    if (beat_before.done && beat_after.done) peer.progressing = beat_before.values[0] != beat_after.values[0];
  }
  return peers;
}

}  // namespace moecore::parallel::arrival_board
