// The flags of a named recipe, configs/NAME.args (one flag and its value per line, # comments), for the tests that
// build a model as `moecore train` would. The source folder comes from MOECORE_SOURCE_DIR (set by CTest).
#pragma once

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace moecore::test {

inline std::vector<std::string> recipe_flags(const std::string& name) {
  const char* source = std::getenv("MOECORE_SOURCE_DIR");
  if (source == nullptr) throw std::runtime_error("MOECORE_SOURCE_DIR is not set (run the test through ctest)");
  const std::string path = std::string(source) + "/configs/" + name + ".args";
  std::ifstream in(path);
  if (!in) throw std::runtime_error("cannot read the recipe " + path);
  std::vector<std::string> flags;
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty() || line.front() == '#') continue;
    std::istringstream words(line);
    std::string word;
    while (words >> word) flags.push_back(word);
  }
  return flags;
}

// The recipe's flags followed by EXTRA: what a test adds (data, tokenizer, batch, schedule) or varies (a later flag
// wins, as in `moecore train`).
inline std::vector<std::string> recipe_flags(const std::string& name, const std::vector<std::string>& extra) {
  std::vector<std::string> flags = recipe_flags(name);
  flags.insert(flags.end(), extra.begin(), extra.end());
  return flags;
}

}  // namespace moecore::test
