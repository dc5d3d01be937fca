#include <exception>
#include <iostream>
#include <string>
#include <vector>

#include "commands.h"
#include "moecore/pipeline/layout_command.h"

int run_layout(int argc, char** argv) {
  try {
    return moecore::layout_main(std::vector<std::string>(argv + 1, argv + argc), std::cout);
  } catch (const std::exception& e) {
    std::cout.flush();
    std::cerr << "error: " << e.what() << '\n';
    return 1;
  }
}
