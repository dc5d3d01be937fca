// Files written so that a failure (a full disk, an I/O error, a kill) never leaves a partial file under its name: the
// bytes go to a temporary beside it (unique per process and writer, so the final rename stays on one filesystem),
// are fsynced, then renamed over it. Every writer of a whole file in moecore goes through here.
#pragma once

#include <stdexcept>
#include <string>
#include <string_view>

namespace moecore {

// What failed and the OS error ("write failed: No space left on device"); the temporary is already removed.
class FileWriteError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A file written in pieces and then put in place at once. Until commit() the target is as it was; a writer
// destroyed without commit() removes its temporary. Methods throw FileWriteError.
class AtomicFile {
 public:
  explicit AtomicFile(std::string path);
  ~AtomicFile();
  AtomicFile(AtomicFile&& other) noexcept;
  AtomicFile& operator=(AtomicFile&& other) noexcept;
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;

  void write(std::string_view bytes);
  // fsync, close and rename over the target; afterwards the writer holds nothing.
  void commit();

  const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::string temp_;
  int fd_ = -1;

  [[noreturn]] void fail(const std::string& what, int error);
  void discard() noexcept;
};

// "" once `path` holds `bytes`; otherwise FileWriteError's text, with `path` as it was.
std::string replace_file(const std::string& path, std::string_view bytes);

}  // namespace moecore
