// replace_directory: a finished temporary folder put in place of a target folder, the previous copy kept under the
// target's name until the new one is there; failures name both paths and leave the target as it was.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "moecore/util/atomic_directory.h"
#include "test_temp_dir.h"

namespace moecore {
namespace {

namespace fs = std::filesystem;

void write_text(const std::string& path, const std::string& text) { std::ofstream(path, std::ios::binary) << text; }

std::string contents(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream out;
  out << in.rdbuf();
  return out.str();
}

// A folder holding one file, `name`, with `text`.
void make_folder(const std::string& folder, const std::string& name, const std::string& text) {
  fs::create_directories(folder);
  write_text(folder + "/" + name, text);
}

size_t entries(const fs::path& folder) {
  return static_cast<size_t>(std::distance(fs::directory_iterator(folder), fs::directory_iterator()));
}

TEST(UtilAtomicDirectory, MovesTheFolderInPlaceWhereNoneWas) {
  const test::TempDir dir("atomic_dir");
  make_folder(dir.path("ckpt.tmp"), "a", "new");
  replace_directory(dir.path("ckpt.tmp"), dir.path("ckpt"));
  EXPECT_EQ(contents(dir.path("ckpt/a")), "new");
  EXPECT_EQ(entries(dir.path()), 1u) << "no temporary left";
}

TEST(UtilAtomicDirectory, ReplacesAnExistingFolderAndDropsTheOldCopy) {
  const test::TempDir dir("atomic_dir");
  make_folder(dir.path("ckpt"), "old_only", "old");
  make_folder(dir.path("ckpt.tmp"), "a", "new");
  replace_directory(dir.path("ckpt.tmp"), dir.path("ckpt"));
  EXPECT_EQ(contents(dir.path("ckpt/a")), "new");
  EXPECT_FALSE(fs::exists(dir.path("ckpt/old_only"))) << "the new folder replaces the old one whole";
  EXPECT_EQ(entries(dir.path()), 1u) << "neither the temporary nor the old copy is left";
}

TEST(UtilAtomicDirectory, TheFallbackByRenamesReplacesToo) {
  const test::TempDir dir("atomic_dir");
  make_folder(dir.path("ckpt"), "a", "old");
  make_folder(dir.path("ckpt.old"), "stale", "left by an interrupted swap");
  make_folder(dir.path("ckpt.tmp"), "a", "new");
  detail::replace_directory_by_renames(dir.path("ckpt.tmp"), dir.path("ckpt"));
  EXPECT_EQ(contents(dir.path("ckpt/a")), "new");
  EXPECT_EQ(entries(dir.path()), 1u);
}

TEST(UtilAtomicDirectory, AFailedSecondRenamePutsTheOldCopyBack) {
  const test::TempDir dir("atomic_dir");
  make_folder(dir.path("ckpt"), "a", "old");
  test::expect_error_containing<FileWriteError>(
      [&] { detail::replace_directory_by_renames(dir.path("missing.tmp"), dir.path("ckpt")); },
      "cannot move " + dir.path("missing.tmp") + " to " + dir.path("ckpt") + ": No such file or directory");
  EXPECT_EQ(contents(dir.path("ckpt/a")), "old");
  EXPECT_EQ(entries(dir.path()), 1u) << "no .old left";
}

TEST(UtilAtomicDirectory, AMissingTemporaryIsAnErrorAndTheTargetStays) {
  const test::TempDir dir("atomic_dir");
  make_folder(dir.path("ckpt"), "a", "old");
  test::expect_error_containing<FileWriteError>(
      [&] { replace_directory(dir.path("missing.tmp"), dir.path("ckpt")); },
      "cannot replace " + dir.path("ckpt") + " with " + dir.path("missing.tmp") + ": No such file or directory");
  EXPECT_EQ(contents(dir.path("ckpt/a")), "old");
}

TEST(UtilAtomicDirectory, ATargetThatIsAFileIsNotReplaced) {
  const test::TempDir dir("atomic_dir");
  write_text(dir.path("ckpt"), "a file");
  make_folder(dir.path("ckpt.tmp"), "a", "new");
  test::expect_error_containing<FileWriteError>(
      [&] { replace_directory(dir.path("ckpt.tmp"), dir.path("ckpt")); },
      "cannot replace " + dir.path("ckpt") + ": it exists and is not a folder");
  EXPECT_EQ(contents(dir.path("ckpt")), "a file");
  EXPECT_EQ(contents(dir.path("ckpt.tmp/a")), "new");
}

TEST(UtilAtomicDirectory, AFailedRenameNamesBothPaths) {
  const test::TempDir dir("atomic_dir");
  make_folder(dir.path("ckpt.tmp"), "a", "new");
  const std::string target = dir.path("absent/ckpt");  // its parent does not exist
  test::expect_error_containing<FileWriteError>(
      [&] { replace_directory(dir.path("ckpt.tmp"), target); },
      "cannot move " + dir.path("ckpt.tmp") + " to " + target + ": No such file or directory");
  EXPECT_EQ(contents(dir.path("ckpt.tmp/a")), "new") << "the new copy is kept for the caller to drop";
}

}  // namespace
}  // namespace moecore
