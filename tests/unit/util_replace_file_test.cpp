// replace_file: a whole file replaced at once, or left as it was with the failure and the OS error named. (A full
// disk is tests/e2e/checkpoint_write_faults.sh's.)
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "moecore/util/replace_file.h"
#include "test_temp_dir.h"

namespace moecore {
namespace {

namespace fs = std::filesystem;

std::string contents(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream out;
  out << in.rdbuf();
  return out.str();
}

TEST(UtilReplaceFile, WritesAndReplacesWholeFiles) {
  const test::TempDir dir("replace");
  const std::string path = dir.path("a.json");
  EXPECT_EQ(replace_file(path, "first"), "");
  EXPECT_EQ(contents(path), "first");
  EXPECT_EQ(replace_file(path, "second, longer"), "");
  EXPECT_EQ(contents(path), "second, longer");
  EXPECT_EQ(std::distance(fs::directory_iterator(dir.path()), fs::directory_iterator()), 1) << "no temporary left";
}

TEST(UtilReplaceFile, FailuresNameTheOsErrorAndLeaveNothing) {
  const test::TempDir dir("replace");
  const std::string missing = replace_file(dir.path("absent/a.json"), "x");
  EXPECT_EQ(missing.rfind("cannot create " + dir.path("absent/a.json.tmp."), 0), 0u) << missing;
  EXPECT_NE(missing.find(": No such file or directory"), std::string::npos) << missing;
  // A folder in the way: the rename fails, and the temporary is removed.
  fs::create_directories(dir.path("taken/inside"));
  const std::string taken = replace_file(dir.path("taken"), "x");
  EXPECT_NE(taken.find("into place: Is a directory"), std::string::npos) << taken;
  EXPECT_EQ(std::distance(fs::directory_iterator(dir.path()), fs::directory_iterator()), 1) << "no temporary left";
}

}  // namespace
}  // namespace moecore
