// The source folder of the tests' data (tests/unit/data, configs/, .deps/): MOECORE_SOURCE_DIR (set by CTest), else
// the checkout this file is in.
#pragma once

#include <cstdlib>
#include <filesystem>

namespace moecore::test {

inline std::filesystem::path source_dir() {
  if (const char* env = std::getenv("MOECORE_SOURCE_DIR"); env != nullptr && *env != '\0') return env;
  return std::filesystem::path(__FILE__).parent_path().parent_path().parent_path();
}

}  // namespace moecore::test
