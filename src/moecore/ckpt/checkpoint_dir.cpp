#include "moecore/ckpt/checkpoint_dir.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>

#include "moecore/ckpt/safetensors.h"

namespace moecore {

std::string iteration_dir_name(const int64_t iteration) {
  char name[32];
  std::snprintf(name, sizeof name, "iter_%07lld", static_cast<long long>(iteration));
  return name;
}

std::string iteration_dir(const std::string& root, const int64_t iteration) {
  return (std::filesystem::path(root) / iteration_dir_name(iteration)).string();
}

std::string tracker_path(const std::string& root) {
  return (std::filesystem::path(root) / "latest_checkpointed_iteration.txt").string();
}

std::optional<int64_t> read_tracker(const std::string& root) {
  const std::optional<TrackerEntry> entry = read_tracker_entry(root);
  if (!entry) return std::nullopt;
  return entry->iteration;
}

std::string checkpoint_dir(const std::string& root, const TrackerEntry& entry) {
  return entry.release ? (std::filesystem::path(root) / "release").string() : iteration_dir(root, entry.iteration);
}

std::optional<TrackerEntry> read_tracker_entry(const std::string& root) {
  const std::string path = tracker_path(root);
  std::ifstream in(path);
  if (!in) return std::nullopt;
  std::stringstream buffer;
  buffer << in.rdbuf();
  std::string text = buffer.str();
  while (!text.empty() && (text.back() == '\n' || text.back() == ' ' || text.back() == '\r')) text.pop_back();
  if (text == "release") return TrackerEntry{0, true};
  if (text.empty() || text.find_first_not_of("0123456789") != std::string::npos || text.size() > 18) {
    // The file's start, control bytes escaped, so the error stays one line.
    std::string shown;
    for (const char c : text.substr(0, 40)) {
      const auto byte = static_cast<unsigned char>(c);
      char escaped[8];
      std::snprintf(escaped, sizeof escaped, "\\x%02x", byte);
      shown += byte < 0x20 || byte == 0x7f ? std::string(escaped) : std::string(1, c);
    }
    if (text.size() > 40) shown += "...";
    throw std::runtime_error(path + ": expected an iteration number or 'release', found '" + shown + "'");
  }
  return TrackerEntry{std::stoll(text), false};
}

void write_tracker(const std::string& root, const int64_t iteration) {
  const std::string text = std::to_string(iteration);
  write_file_atomically(tracker_path(root), std::as_bytes(std::span(text.data(), text.size())));
  sync_directory(root);
}

void sync_directory(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) throw std::runtime_error(dir + ": cannot open the folder to sync it: " + std::strerror(errno));
  const int rc = ::fsync(fd);
  const int error = errno;
  ::close(fd);
  if (rc != 0) throw std::runtime_error(dir + ": fsync of the folder failed: " + std::strerror(error));
}

}  // namespace moecore
