// Shared test helpers: a per-test temporary directory and "throws E with this text" checks.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <string>
#include <string_view>

namespace moecore::test {

// A fresh directory named after the running test, removed with everything in it at scope exit.
class TempDir {
 public:
  explicit TempDir(const std::string_view prefix) {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    path_ = std::filesystem::temp_directory_path() / ("moecore_" + std::string(prefix) + "_" + info->test_suite_name() +
                                                      "_" + info->name() + "_" + std::to_string(::getpid()));
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~TempDir() { std::filesystem::remove_all(path_); }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  std::string path(const std::string& name) const { return (path_ / name).string(); }
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

// Runs `action` and expects an exception of type E whose message contains `needle`.
template <typename E, typename F>
void expect_error_containing(F&& action, const std::string& needle) {
  try {
    action();
    ADD_FAILURE() << "expected an exception containing \"" << needle << "\"";
  } catch (const E& error) {
    EXPECT_NE(std::string(error.what()).find(needle), std::string::npos) << error.what();
  }
}

}  // namespace moecore::test
