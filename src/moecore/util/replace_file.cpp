#include "moecore/util/replace_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>

namespace moecore {

std::string replace_file(const std::string& path, const std::string_view bytes) {
  static std::atomic<uint64_t> counter{0};
  const std::string temp = path + ".tmp." + std::to_string(::getpid()) + "." + std::to_string(counter++);
  const auto failed = [&](const std::string& what, const int error) {
    ::unlink(temp.c_str());
    return what + ": " + std::strerror(error);
  };
  const int fd = ::open(temp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return failed("cannot create " + temp, errno);
  size_t written = 0;
  while (written < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + written, bytes.size() - written);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int error = n == 0 ? ENOSPC : errno;  // no progress: the device takes no more bytes
      ::close(fd);
      return failed("write failed", error);
    }
    written += static_cast<size_t>(n);
  }
  if (::fsync(fd) != 0) {
    const int error = errno;
    ::close(fd);
    return failed("fsync failed", error);
  }
  if (::close(fd) != 0) return failed("close failed", errno);
  if (std::rename(temp.c_str(), path.c_str()) != 0) return failed("cannot rename " + temp + " into place", errno);
  return "";
}

}  // namespace moecore
