// `moecore checkpoint DIR`: prints and verifies a checkpoint (ckpt/checkpoint_inspect.h) with the training layer's
// checks of the state a load reads.
#include <exception>
#include <iostream>
#include <string>
#include <vector>

#include "moecore/ckpt/checkpoint_inspect.h"
#include "moecore/cli/commands.h"
#include "moecore/model/config.h"
#include "moecore/train/checkpoint_contents.h"
#include "moecore/util/flag_parser.h"

namespace moecore {
namespace {

constexpr std::string_view kCheckpointUsage =
    "usage: moecore checkpoint DIR   (a --save folder or one of its iter_NNNNNNN folders)\n";

struct CheckpointFlags {};

const std::vector<FlagSpec<CheckpointFlags>>& checkpoint_flag_table() {
  static const std::vector<FlagSpec<CheckpointFlags>> table = {};  // DIR only
  return table;
}

int checkpoint_main(const std::vector<std::string>& args, std::ostream& out) {
  CheckpointFlags flags;
  FlagParserOptions options;
  options.positionals = true;
  ParsedFlags parsed;
  try {
    parsed = parse_flags(checkpoint_flag_table(), args, flags, options);
  } catch (const FlagError& error) {
    throw ConfigError(error.what());
  }
  if (parsed.help_requested) {
    out << kCheckpointUsage;
    return 0;
  }
  if (parsed.positional.size() != 1) throw ConfigError("usage: moecore checkpoint DIR (one folder)");
  return inspect_checkpoint(parsed.positional.front(), out, check_checkpoint_contents);
}

}  // namespace
}  // namespace moecore

int run_checkpoint(int argc, char** argv) {
  try {
    return moecore::checkpoint_main(std::vector<std::string>(argv + 1, argv + argc), std::cout);
  } catch (const std::exception& e) {
    std::cout.flush();
    std::cerr << "error: " << e.what() << '\n';
    return 1;
  }
}
