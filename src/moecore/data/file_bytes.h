// Whole files as bytes for the data layer: written through util/atomic_file.h, errors as DataError.
#pragma once

#include <string>
#include <string_view>

namespace moecore {

// Throws DataError naming the path and the OS error on any failure.
void write_file_atomic(const std::string& path, std::string_view bytes);

// Whole file as bytes; throws DataError when it cannot be read.
std::string read_file_bytes(const std::string& path);

}  // namespace moecore
