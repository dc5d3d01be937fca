// The flag tests' view of `moecore train`'s parser: the one-line error a command line gets, or "<no error>".
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "moecore/config/arguments.h"

namespace moecore::test {

inline std::string error_of(const std::vector<std::string>& args, const int64_t world_size = 1) {
  try {
    parse_train_args(args, world_size);
  } catch (const ConfigError& error) {
    return error.what();
  }
  return "<no error>";
}

}  // namespace moecore::test
