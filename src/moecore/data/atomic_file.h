// Whole-file writes that never leave a half-written file under the final name (util/replace_file.h).
#pragma once

#include <string>
#include <string_view>

namespace moecore {

// Throws DataError naming the path and the OS error on any failure.
void write_file_atomic(const std::string& path, std::string_view bytes);

// Whole file as bytes; throws DataError when it cannot be read.
std::string read_file_bytes(const std::string& path);

}  // namespace moecore
