#include <exception>
#include <iostream>
#include <string>
#include <vector>

#include "commands.h"
#include "moecore/train/arguments.h"
#include "moecore/train/trainer.h"

int run_train(int argc, char** argv) {
  try {
    const std::vector<std::string> args(argv + 1, argv + argc);
    const moecore::TrainingArgs parsed = moecore::parse_train_args(args);
    if (parsed.help_requested) {
      std::cout << "usage: moecore train [flags]\n\n" << moecore::train_flags_help();
      return 0;
    }
    moecore::run_training(parsed, std::cout);
    return 0;
  } catch (const std::exception& e) {
    std::cout.flush();
    std::cerr << "error: " << e.what() << '\n';
    return 1;
  }
}
