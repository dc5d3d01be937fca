#include "moecore/util/atomic_directory.h"

#include <fcntl.h>
#include <stdio.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <system_error>

namespace moecore {

namespace fs = std::filesystem;

namespace {

[[noreturn]] void fail(const std::string& what, const int error) {
  throw FileWriteError(what + ": " + std::strerror(error));
}

// What is left of the previous copy; a folder that cannot be removed now is harmless (the next save replaces it).
void remove_leftover(const std::string& path) {
  std::error_code ignored;
  fs::remove_all(path, ignored);
}

}  // namespace

namespace detail {

void replace_directory_by_renames(const std::string& tmp, const std::string& target) {
  const std::string old = target + ".old";
  remove_leftover(old);  // a swap interrupted after its first rename
  if (::rename(target.c_str(), old.c_str()) != 0) fail("cannot move " + target + " aside to " + old, errno);
  if (::rename(tmp.c_str(), target.c_str()) != 0) {
    const int error = errno;
    ::rename(old.c_str(), target.c_str());  // the previous copy back under its name
    fail("cannot move " + tmp + " to " + target, error);
  }
  remove_leftover(old);
}

}  // namespace detail

void replace_directory(const std::string& tmp, const std::string& target) {
  std::error_code ec;
  if (!fs::is_directory(tmp, ec)) {
    throw FileWriteError("cannot replace " + target + " with " + tmp + ": " + (ec ? ec.message() : "not a folder"));
  }
  const fs::file_status status = fs::status(target, ec);
  if (!fs::exists(status)) {
    if (::rename(tmp.c_str(), target.c_str()) != 0) fail("cannot move " + tmp + " to " + target, errno);
    return;
  }
  if (!fs::is_directory(status)) throw FileWriteError("cannot replace " + target + ": it exists and is not a folder");
  if (::renameat2(AT_FDCWD, tmp.c_str(), AT_FDCWD, target.c_str(), RENAME_EXCHANGE) == 0) {
    remove_leftover(tmp);  // now holds the previous copy
    return;
  }
  const int error = errno;
  if (error != EINVAL && error != ENOSYS && error != EOPNOTSUPP && error != ENOTSUP) {
    fail("cannot swap " + tmp + " with " + target, error);
  }
  detail::replace_directory_by_renames(tmp, target);  // a filesystem without the atomic exchange
}

}  // namespace moecore
