#include "moecore/data/preprocess.h"

#include <exception>
#include <iostream>
#include <string>
#include <vector>

#include "moecore/cli/commands.h"

int run_preprocess(int argc, char** argv) {
  try {
    moecore::preprocess_main(std::vector<std::string>(argv + (argc > 0 ? 1 : 0), argv + argc));
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << std::endl;
    return 1;
  }
}
