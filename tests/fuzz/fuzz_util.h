// Shared pieces of the fuzz harnesses (tests/fuzz/fuzz_*.cpp): a per-process scratch folder, files written from
// the fuzzer's bytes, the split of one input into two files, and the rule every harness applies to the errors a
// parser throws.
#pragma once

#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>
#include <vector>

namespace moecore::fuzz {

// A fresh folder under the system temp folder, removed with everything in it when the process exits normally.
class ScratchDir {
 public:
  explicit ScratchDir(const std::string& name) {
    path_ = std::filesystem::temp_directory_path() / ("moecore_fuzz_" + name + "_" + std::to_string(::getpid()));
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~ScratchDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;

  const std::filesystem::path& path() const { return path_; }
  std::string file(const std::string& name) const { return (path_ / name).string(); }

 private:
  std::filesystem::path path_;
};

inline void write_bytes(const std::string& path, std::string_view bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!out) {
    std::fprintf(stderr, "fuzz harness: cannot write %s\n", path.c_str());
    std::abort();
  }
}

// Two files in one input: a little-endian uint32 length N, N bytes of the first file, the rest the second. A
// length past the end gives the first file everything after the length and an empty second.
struct TwoFiles {
  std::string_view first;
  std::string_view second;
};
inline TwoFiles split_two_files(const uint8_t* data, size_t size) {
  const std::string_view all(reinterpret_cast<const char*>(data), size);
  if (size < 4) return {all, {}};
  const size_t length = static_cast<size_t>(data[0]) | static_cast<size_t>(data[1]) << 8 |
                        static_cast<size_t>(data[2]) << 16 | static_cast<size_t>(data[3]) << 24;
  const std::string_view rest = all.substr(4);
  if (length >= rest.size()) return {rest, {}};
  return {rest.substr(0, length), rest.substr(length)};
}
inline std::string join_two_files(std::string_view first, std::string_view second) {
  std::string out(4, '\0');
  for (int i = 0; i < 4; ++i) out[static_cast<size_t>(i)] = static_cast<char>((first.size() >> (8 * i)) & 0xffu);
  out.append(first);
  out.append(second);
  return out;
}

// An expected error: a std::exception with a message. An empty message is a finding (the user learns nothing).
// MOECORE_FUZZ_VERBOSE=1 prints each one (to see how far the seeds get).
inline void expected_error(const std::exception& error) {
  static const bool verbose = std::getenv("MOECORE_FUZZ_VERBOSE") != nullptr;
  if (verbose) std::fprintf(stderr, "expected error: %s\n", error.what());
  if (std::string_view(error.what()).empty()) {
    std::fprintf(stderr, "fuzz harness: a parser threw an exception with an empty message\n");
    std::abort();
  }
}

// As expected_error, for parsers whose messages name the file and field: a raw "[json.exception...]" text (nlohmann's
// own, naming neither) is a finding too.
inline void expected_named_error(const std::exception& error) {
  expected_error(error);
  if (std::string_view(error.what()).find("json.exception") != std::string_view::npos) {
    std::fprintf(stderr, "fuzz harness: raw JSON exception text: %s\n", error.what());
    std::abort();
  }
}

// A property of valid input that does not hold: a finding.
[[noreturn]] inline void property_failed(const std::string& what) {
  std::fprintf(stderr, "fuzz harness: property failed: %s\n", what.c_str());
  std::abort();
}

// The repository's root (corpus, configs/ and the GPT-2 vocabulary in .deps), compiled in by tests/fuzz/CMakeLists.
inline std::filesystem::path source_dir() {
  if (const char* env = std::getenv("MOECORE_SOURCE_DIR"); env != nullptr && *env != '\0') return env;
  return MOECORE_FUZZ_SOURCE_DIR;
}

}  // namespace moecore::fuzz
