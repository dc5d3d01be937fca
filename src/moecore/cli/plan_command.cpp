#include "moecore/plan/plan_command.h"

#include <exception>
#include <iostream>
#include <string>
#include <vector>

#include "moecore/cli/commands.h"

int run_plan(int argc, char** argv) {
  try {
    return moecore::plan::plan_main(std::vector<std::string>(argv + 1, argv + argc), std::cout);
  } catch (const std::exception& e) {
    std::cout.flush();
    std::cerr << "error: " << e.what() << '\n';
    return 1;
  }
}
