// A save folder as Megatron lays it out (megatron/training/checkpointing.py): one `iter_%07d` folder per saved
// iteration and `latest_checkpointed_iteration.txt`, the tracker naming the newest complete one (an iteration
// number, or `release`, read as iteration 0).
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace moecore {

std::string iteration_dir_name(int64_t iteration);                      // "iter_0000010"
std::string iteration_dir(const std::string& root, int64_t iteration);  // root/iter_0000010
std::string tracker_path(const std::string& root);

// The tracker's iteration; nullopt when there is no tracker. Throws std::runtime_error naming the file when it holds
// anything but a non-negative integer or `release`.
std::optional<int64_t> read_tracker(const std::string& root);
// The tracker's entry: an iteration, or `release` (Megatron's read_metadata: iteration 0, folder DIR/release, whose
// weights are loaded without optimizer, scheduler or RNG state).
struct TrackerEntry {
  int64_t iteration = 0;
  bool release = false;
};
std::optional<TrackerEntry> read_tracker_entry(const std::string& root);
// root/release or root/iter_%07d.
std::string checkpoint_dir(const std::string& root, const TrackerEntry& entry);
// Writes the tracker atomically (temporary file, fsync, rename, fsync of the folder).
void write_tracker(const std::string& root, int64_t iteration);

// fsync of a folder (its entries: created or renamed files survive a crash).
void sync_directory(const std::string& dir);

}  // namespace moecore
