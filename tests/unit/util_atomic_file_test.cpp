// AtomicFile / replace_file: a whole file replaced at once, or left as it was with the failure and the OS error named.
// (A full disk is tests/e2e/checkpoint_write_faults.sh's.)
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "moecore/util/atomic_file.h"
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

TEST(UtilAtomicFile, WritesAndReplacesWholeFiles) {
  const test::TempDir dir("replace");
  const std::string path = dir.path("a.json");
  EXPECT_EQ(replace_file(path, "first"), "");
  EXPECT_EQ(contents(path), "first");
  EXPECT_EQ(replace_file(path, "second, longer"), "");
  EXPECT_EQ(contents(path), "second, longer");
  EXPECT_EQ(std::distance(fs::directory_iterator(dir.path()), fs::directory_iterator()), 1) << "no temporary left";
}

TEST(UtilAtomicFile, FailuresNameTheOsErrorAndLeaveNothing) {
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

size_t entries(const std::string& folder) {
  return static_cast<size_t>(std::distance(fs::directory_iterator(folder), fs::directory_iterator()));
}

TEST(UtilAtomicFile, PiecesAppearOnlyAtCommit) {
  const test::TempDir dir("atomic");
  const std::string path = dir.path("data.bin");
  ASSERT_EQ(replace_file(path, "old"), "");
  {
    AtomicFile file(path);
    file.write("new ");
    file.write("bytes");
    EXPECT_EQ(contents(path), "old") << "the target is untouched before commit";
    EXPECT_EQ(entries(dir.path()), 2u);
    file.commit();
    EXPECT_THROW(file.write("more"), FileWriteError);
  }
  EXPECT_EQ(contents(path), "new bytes");
  EXPECT_EQ(entries(dir.path()), 1u);
}

TEST(UtilAtomicFile, AWriterDroppedWithoutCommitRemovesItsTemporary) {
  const test::TempDir dir("atomic");
  const std::string path = dir.path("data.bin");
  ASSERT_EQ(replace_file(path, "old"), "");
  {
    AtomicFile file(path);
    file.write("half");
    AtomicFile moved = std::move(file);  // the temporary follows the move
    EXPECT_EQ(entries(dir.path()), 2u);
  }
  EXPECT_EQ(contents(path), "old");
  EXPECT_EQ(entries(dir.path()), 1u) << "no temporary left";
}

}  // namespace
}  // namespace moecore
