// Internal to the argument parser: derived defaults and cross-flag validation, run after every flag was applied.
#pragma once

#include <set>
#include <string>

#include "moecore/config/arguments.h"

namespace moecore::detail {

// `given` holds the name of every flag that appeared on the command line. Throws ConfigError (one line).
void finalize_train_args(TrainingArgs& args, const std::set<std::string>& given);

}  // namespace moecore::detail
