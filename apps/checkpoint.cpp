#include <exception>
#include <iostream>
#include <string>
#include <vector>

#include "moecore/cli/commands.h"
#include "moecore/ckpt/inspect_command.h"
#include "moecore/train/checkpoint_contents.h"

int run_checkpoint(int argc, char** argv) {
  try {
    return moecore::checkpoint_inspect_main(std::vector<std::string>(argv + 1, argv + argc), std::cout,
                                            moecore::check_checkpoint_contents);
  } catch (const std::exception& e) {
    std::cout.flush();
    std::cerr << "error: " << e.what() << '\n';
    return 1;
  }
}
