#include "moecore/data/file_bytes.h"

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "moecore/data/indexed_dataset.h"
#include "moecore/util/atomic_file.h"

namespace moecore {

void write_file_atomic(const std::string& path, std::string_view bytes) {
  if (const std::string problem = replace_file(path, bytes); !problem.empty()) throw DataError(path + ": " + problem);
}

std::string read_file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw DataError(path + ": cannot open: " + std::strerror(errno));
  std::ostringstream content;
  content << in.rdbuf();
  if (in.bad()) throw DataError(path + ": read failed");
  return content.str();
}

}  // namespace moecore
