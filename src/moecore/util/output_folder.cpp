#include "moecore/util/output_folder.h"

#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <vector>

namespace moecore {
namespace {

namespace fs = std::filesystem;

// "" when a file can be created in the existing folder `dir`, else why not.
std::string probe_write(const fs::path& dir) {
  std::string pattern = (dir / ".moecore_write_probe_XXXXXX").string();
  std::vector<char> name(pattern.begin(), pattern.end());
  name.push_back('\0');
  const int fd = ::mkstemp(name.data());
  if (fd < 0) return "cannot create a file in " + dir.string() + ": " + std::strerror(errno);
  ::close(fd);
  ::unlink(name.data());
  return "";
}

}  // namespace

std::string folder_write_problem(const std::string& dir) {
  if (dir.empty()) return "the folder name is empty";
  std::error_code ec;
  fs::path path = fs::absolute(fs::path(dir), ec).lexically_normal();
  if (ec) return "cannot resolve " + dir + ": " + ec.message();
  if (path.has_relative_path() && path.filename().empty()) path = path.parent_path();  // "a/b/" -> "a/b"
  // The nearest existing ancestor (the path itself when it exists).
  fs::path existing = path;
  while (!fs::exists(existing, ec)) {
    if (ec) return "cannot inspect " + existing.string() + ": " + ec.message();
    if (!existing.has_relative_path()) return "no part of " + dir + " exists";
    existing = existing.parent_path();
  }
  if (!fs::is_directory(existing, ec)) {
    return existing == path ? dir + " exists and is not a folder"
                            : dir + " cannot be created: " + existing.string() + " is not a folder";
  }
  const std::string problem = probe_write(existing);
  if (problem.empty() || existing == path) return problem;
  return dir + " cannot be created: " + problem;
}

}  // namespace moecore
