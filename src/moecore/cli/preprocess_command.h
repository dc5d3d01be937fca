// `moecore preprocess`: the command line of Megatron's tools/preprocess_data.py (data/preprocess.h converts).
#pragma once

#include <string>
#include <vector>

#include "moecore/data/preprocess.h"

namespace moecore {

// Parses preprocess_data.py's flags through the common flag parser with argparse's allow_abbrev, as that plain
// argparse parser has it: --flag value or --flag=value, unambiguous prefixes. Megatron's flags that moecore's
// preprocess does not implement are refused by name. Throws std::invalid_argument with one line for an unknown,
// malformed, missing or unsupported flag.
PreprocessOptions parse_preprocess_args(const std::vector<std::string>& args);

// parse_preprocess_args + preprocess: the body of `moecore preprocess ARGS...` (--help prints the usage).
void preprocess_main(const std::vector<std::string>& args);

}  // namespace moecore
