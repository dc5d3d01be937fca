// folder_write_problem: what a run can find out at start-up about a folder it will write later.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "moecore/util/output_folder.h"
#include "test_temp_dir.h"

namespace moecore {
namespace {

namespace fs = std::filesystem;

TEST(UtilOutputFolder, UsableFoldersHaveNoProblem) {
  const test::TempDir dir("out");
  EXPECT_EQ(folder_write_problem(dir.path().string()), "");      // exists
  EXPECT_EQ(folder_write_problem(dir.path("new")), "");          // created later
  EXPECT_EQ(folder_write_problem(dir.path("new/deeper/")), "");  // several levels, trailing '/'
  EXPECT_TRUE(fs::is_empty(dir.path())) << "the probe leaves nothing behind and creates nothing";
}

TEST(UtilOutputFolder, FilesInTheWayAreNamed) {
  const test::TempDir dir("out");
  const std::string file = dir.path("file");
  std::ofstream(file) << "x";
  EXPECT_EQ(folder_write_problem(file), file + " exists and is not a folder");
  EXPECT_EQ(folder_write_problem(file + "/sub"), file + "/sub cannot be created: " + file + " is not a folder");
  EXPECT_EQ(folder_write_problem(""), "the folder name is empty");
}

TEST(UtilOutputFolder, UnwritableFolderIsFoundByTheProbe) {
  // /proc takes no new files, whoever runs the test (root included, which a chmod would not stop).
  const std::string problem = folder_write_problem("/proc/moecore_out");
  EXPECT_NE(problem.find("/proc/moecore_out cannot be created: cannot create a file in /proc"), std::string::npos)
      << problem;
}

}  // namespace
}  // namespace moecore
