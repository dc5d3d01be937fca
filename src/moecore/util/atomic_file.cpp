#include "moecore/util/atomic_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <utility>

namespace moecore {

namespace {

std::string unique_temp_path(const std::string& path) {
  static std::atomic<uint64_t> counter{0};
  return path + ".tmp." + std::to_string(::getpid()) + "." + std::to_string(counter++);
}

}  // namespace

AtomicFile::AtomicFile(std::string path) : path_(std::move(path)), temp_(unique_temp_path(path_)) {
  fd_ = ::open(temp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd_ < 0) {
    const int error = errno;
    throw FileWriteError("cannot create " + temp_ + ": " + std::strerror(error));
  }
}

AtomicFile::~AtomicFile() { discard(); }

AtomicFile::AtomicFile(AtomicFile&& other) noexcept
    : path_(std::move(other.path_)), temp_(std::move(other.temp_)), fd_(std::exchange(other.fd_, -1)) {}

AtomicFile& AtomicFile::operator=(AtomicFile&& other) noexcept {
  if (this != &other) {
    discard();
    path_ = std::move(other.path_);
    temp_ = std::move(other.temp_);
    fd_ = std::exchange(other.fd_, -1);
  }
  return *this;
}

void AtomicFile::discard() noexcept {
  if (fd_ < 0) return;
  ::close(fd_);
  fd_ = -1;
  ::unlink(temp_.c_str());
}

void AtomicFile::fail(const std::string& what, const int error) {
  discard();
  throw FileWriteError(what + ": " + std::strerror(error));
}

void AtomicFile::write(const std::string_view bytes) {
  if (fd_ < 0) throw FileWriteError(path_ + " is already committed");
  size_t written = 0;
  while (written < bytes.size()) {
    const ssize_t n = ::write(fd_, bytes.data() + written, bytes.size() - written);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) fail("write failed", n == 0 ? ENOSPC : errno);  // no progress: the device takes no more bytes
    written += static_cast<size_t>(n);
  }
}

void AtomicFile::commit() {
  if (fd_ < 0) throw FileWriteError(path_ + " is already committed");
  if (::fsync(fd_) != 0) fail("fsync failed", errno);
  const int fd = std::exchange(fd_, -1);
  if (::close(fd) != 0) {
    const int error = errno;
    ::unlink(temp_.c_str());
    throw FileWriteError(std::string("close failed: ") + std::strerror(error));
  }
  if (std::rename(temp_.c_str(), path_.c_str()) != 0) {
    const int error = errno;
    ::unlink(temp_.c_str());
    throw FileWriteError("cannot rename " + temp_ + " into place: " + std::strerror(error));
  }
}

std::string replace_file(const std::string& path, const std::string_view bytes) {
  try {
    AtomicFile file(path);
    file.write(bytes);
    file.commit();
    return "";
  } catch (const FileWriteError& e) {
    return e.what();
  }
}

}  // namespace moecore
