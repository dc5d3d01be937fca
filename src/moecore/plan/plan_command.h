// `moecore plan`: prints a training run's memory per GPU, FLOPs and estimated step time for one layout, or with
// --search every valid layout ranked by estimated throughput.
#pragma once

#include <ostream>
#include <string>
#include <vector>

namespace moecore::plan {

// Returns the exit status; throws ConfigError (one line) on bad input.
int plan_main(const std::vector<std::string>& args, std::ostream& out);

}  // namespace moecore::plan
