// A seeded mutation driver for the libFuzzer-style harnesses (tests/fuzz/fuzz_*.cpp) when they are not built with
// -fsanitize=fuzzer: every build links each harness with this main() so the bounded runs are ordinary CTest tests.
//
//   fuzz_NAME [--runs N] [--seed S] [--max-len L] [--dict FILE]... [--timeout SECONDS] [--artifacts DIR] CORPUS_DIR...
//
// First every file under the corpus folders (seeds and the regression corpus) is replayed, then N inputs are made
// from them by a deterministic RNG seeded with S: bit flips, bytes set to 0 / 0xff / 0x7f / 0x80, little-endian
// boundary integers written in place, chunks inserted, erased or duplicated, two inputs spliced, dictionary tokens
// (libFuzzer's dict format; --dict may repeat) and boundary numbers inserted as text. A harness that crashes or trips a
// sanitizer ends the process (the input is saved first); one input running past --timeout seconds is a hang, reported
// and saved the same way. Success prints "fuzz NAME: N inputs, 0 crashes".
#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#define MOECORE_FUZZ_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define MOECORE_FUZZ_ASAN 1
#endif
#endif
#if defined(MOECORE_FUZZ_ASAN)
#include <sanitizer/lsan_interface.h>
#else
#include <sys/resource.h>
#endif

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

#if defined(MOECORE_FUZZ_ASAN)
// An allocation above 2 GiB from an input of a few kilobytes is a finding (libFuzzer's -malloc_limit_mb does the
// same). A sanitizer report ends in abort(), whose handler below saves the input. ASAN_OPTIONS / UBSAN_OPTIONS given
// by the caller still override these defaults.
extern "C" const char* __asan_default_options() {
  return "max_allocation_size_mb=2048:allocator_may_return_null=0:abort_on_error=1";
}
extern "C" const char* __ubsan_default_options() { return "abort_on_error=1:print_stacktrace=1"; }
#endif

namespace {

namespace fs = std::filesystem;
using Bytes = std::vector<uint8_t>;

// What the signal handlers and the sanitizer's death callback need: plain globals, written with write(2) only.
std::string g_name = "fuzz";
std::string g_artifact_prefix;  // DIR/NAME-
const Bytes* g_current = nullptr;
std::string g_current_label;
unsigned g_timeout_s = 10;

void write_all(int fd, const void* data, size_t size) {
  const char* p = static_cast<const char*>(data);
  while (size > 0) {
    const ssize_t n = ::write(fd, p, size);
    if (n <= 0) return;
    p += n;
    size -= static_cast<size_t>(n);
  }
}

void write_str(int fd, const char* text) { write_all(fd, text, std::strlen(text)); }

// Saves the input being run to DIR/NAME-KIND (async-signal-safe) and names the file on stderr.
void save_current(const char* kind) {
  if (g_current == nullptr) return;
  char path[4096];
  std::snprintf(path, sizeof(path), "%s%s", g_artifact_prefix.c_str(), kind);
  const int fd = ::open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd >= 0) {
    write_all(fd, g_current->data(), g_current->size());
    ::close(fd);
  }
  write_str(2, "fuzz ");
  write_str(2, g_name.c_str());
  write_str(2, ": ");
  write_str(2, kind);
  write_str(2, " on ");
  write_str(2, g_current_label.c_str());
  write_str(2, "; input saved to ");
  write_str(2, path);
  write_str(2, "\n");
}

void on_alarm(int) {
  char line[128];
  std::snprintf(line, sizeof(line), "fuzz: an input ran longer than %u s\n", g_timeout_s);
  write_str(2, line);
  save_current("hang");
  ::_exit(1);
}

void on_fatal_signal(int sig) {
  save_current("crash");
  ::signal(sig, SIG_DFL);
  ::raise(sig);
}

void on_terminate() {
  save_current("crash");
  write_str(2, "fuzz: the harness let an exception escape (std::terminate)\n");
  std::abort();
}

void install_handlers() {
  ::signal(SIGALRM, on_alarm);
  std::set_terminate(on_terminate);
  ::signal(SIGABRT, on_fatal_signal);
#if !defined(MOECORE_FUZZ_ASAN)
  // Under ASan its own handlers report these signals (with the stack) and then abort(): SIGABRT saves the input.
  for (const int sig : {SIGSEGV, SIGBUS, SIGFPE, SIGILL}) ::signal(sig, on_fatal_signal);
  // Without ASan an input that asks for a huge allocation would be served lazily and then touched: cap the address
  // space so it fails as std::bad_alloc instead of exhausting the machine.
  const rlimit limit{rlim_t{16} << 30, rlim_t{16} << 30};
  ::setrlimit(RLIMIT_AS, &limit);
#endif
}

// Runs one input under the time limit. The harness catches the errors it expects; anything escaping is a finding.
void run_one(const Bytes& input, const std::string& label) {
  g_current = &input;
  g_current_label = label;
  ::alarm(g_timeout_s);
  try {
    LLVMFuzzerTestOneInput(input.data(), input.size());
  } catch (...) {
    ::alarm(0);
    save_current("crash");
    std::fprintf(stderr, "fuzz %s: an exception escaped the harness on %s\n", g_name.c_str(), label.c_str());
    std::exit(1);
  }
  ::alarm(0);
  g_current = nullptr;
}

Bytes read_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return Bytes(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// libFuzzer's dictionary format: one token per line as "..." with \\, \" and \xNN escapes; # comments.
std::vector<Bytes> read_dict(const std::string& path) {
  std::vector<Bytes> tokens;
  std::ifstream in(path);
  if (!in) {
    std::fprintf(stderr, "fuzz: cannot read --dict %s\n", path.c_str());
    std::exit(2);
  }
  std::string line;
  while (std::getline(in, line)) {
    const size_t open = line.find('"');
    const size_t close = line.rfind('"');
    if (line.empty() || line[0] == '#' || open == std::string::npos || close <= open) continue;
    Bytes token;
    for (size_t i = open + 1; i < close; ++i) {
      if (line[i] == '\\' && i + 1 < close) {
        if (line[i + 1] == 'x' && i + 3 < close) {
          token.push_back(static_cast<uint8_t>(std::stoi(line.substr(i + 2, 2), nullptr, 16)));
          i += 3;
        } else {
          token.push_back(static_cast<uint8_t>(line[i + 1]));
          ++i;
        }
      } else {
        token.push_back(static_cast<uint8_t>(line[i]));
      }
    }
    tokens.push_back(token);
  }
  return tokens;
}

// Numbers at the edges of the parsers' ranges, inserted as text.
const char* const kNumberTokens[] = {"0",
                                     "-1",
                                     "1",
                                     "2.5",
                                     "-0",
                                     "1e308",
                                     "1e-320",
                                     "nan",
                                     "inf",
                                     "-inf",
                                     "127",
                                     "255",
                                     "65535",
                                     "2147483647",
                                     "2147483648",
                                     "-2147483649",
                                     "4294967296",
                                     "288230376151711744",
                                     "4611686018427387904",
                                     "9223372036854775807",
                                     "9223372036854775808",
                                     "-9223372036854775808",
                                     "18446744073709551615",
                                     "18446744073709551616",
                                     "1180591620717411303424"};

// Little-endian integers at type boundaries, written over the input's bytes.
const uint64_t kBoundaryIntegers[] = {0,
                                      1,
                                      0x7f,
                                      0x80,
                                      0xff,
                                      0x7fff,
                                      0xffff,
                                      0x7fffffff,
                                      0x80000000,
                                      0xffffffff,
                                      uint64_t{1} << 32,
                                      uint64_t{1} << 56,
                                      0x7fffffffffffffff,
                                      0x8000000000000000,
                                      0xffffffffffffffff};

class Mutator {
 public:
  Mutator(uint64_t seed, const std::vector<Bytes>& corpus, const std::vector<Bytes>& dict, size_t max_len)
      : rng_(seed), corpus_(corpus), dict_(dict), max_len_(max_len) {}

  Bytes next() {
    Bytes data = corpus_.empty() ? Bytes{} : corpus_[below(corpus_.size())];
    const size_t steps = 1 + below(6);
    for (size_t s = 0; s < steps; ++s) mutate(data);
    if (data.size() > max_len_) data.resize(max_len_);
    return data;
  }

 private:
  // Uniform in [0, n) from the raw 64-bit stream (the same sequence on every platform).
  size_t below(size_t n) { return n == 0 ? 0 : static_cast<size_t>(rng_() % n); }

  void insert(Bytes& data, const Bytes& piece) {
    const size_t at = below(data.size() + 1);
    data.insert(data.begin() + static_cast<std::ptrdiff_t>(at), piece.begin(), piece.end());
  }

  void mutate(Bytes& data) {
    switch (below(10)) {
      case 0:  // flip a bit
        if (!data.empty()) data[below(data.size())] ^= static_cast<uint8_t>(1u << below(8));
        break;
      case 1: {  // a byte set to an interesting value
        static constexpr uint8_t kValues[] = {0x00, 0xff, 0x7f, 0x80, 0x01, '0', '9', '-', '"', ','};
        if (!data.empty()) data[below(data.size())] = kValues[below(sizeof(kValues))];
        break;
      }
      case 2: {  // a boundary integer written in place, 1, 2, 4 or 8 bytes
        const size_t width = size_t{1} << below(4);
        if (data.size() < width) break;
        const uint64_t value = kBoundaryIntegers[below(std::size(kBoundaryIntegers))];
        const size_t at = below(data.size() - width + 1);
        for (size_t i = 0; i < width; ++i) data[at + i] = static_cast<uint8_t>(value >> (8 * i));
        break;
      }
      case 3: {  // insert random bytes
        Bytes piece(1 + below(8));
        for (uint8_t& b : piece) b = static_cast<uint8_t>(rng_());
        insert(data, piece);
        break;
      }
      case 4: {  // erase a chunk
        if (data.empty()) break;
        const size_t at = below(data.size());
        const size_t length = 1 + below(std::min<size_t>(data.size() - at, 16));
        data.erase(data.begin() + static_cast<std::ptrdiff_t>(at),
                   data.begin() + static_cast<std::ptrdiff_t>(at + length));
        break;
      }
      case 5: {  // duplicate a chunk somewhere else
        if (data.empty()) break;
        const size_t at = below(data.size());
        const size_t length = 1 + below(std::min<size_t>(data.size() - at, 64));
        const Bytes piece(data.begin() + static_cast<std::ptrdiff_t>(at),
                          data.begin() + static_cast<std::ptrdiff_t>(at + length));
        insert(data, piece);
        break;
      }
      case 6: {  // splice: this input's prefix, another's suffix
        if (corpus_.empty()) break;
        const Bytes& other = corpus_[below(corpus_.size())];
        data.resize(below(data.size() + 1));
        const size_t from = below(other.size() + 1);
        data.insert(data.end(), other.begin() + static_cast<std::ptrdiff_t>(from), other.end());
        break;
      }
      case 7:
      case 8: {  // a dictionary token (or a boundary number as text) inserted, or written over a digit run
        Bytes token;
        if (!dict_.empty() && below(2) == 0) {
          token = dict_[below(dict_.size())];
        } else {
          const char* text = kNumberTokens[below(std::size(kNumberTokens))];
          token.assign(text, text + std::strlen(text));
        }
        const size_t at = below(data.size() + 1);
        size_t end = at;
        while (end < data.size() && data[end] >= '0' && data[end] <= '9') ++end;
        if (end > at && below(2) == 0) {
          data.erase(data.begin() + static_cast<std::ptrdiff_t>(at), data.begin() + static_cast<std::ptrdiff_t>(end));
        }
        data.insert(data.begin() + static_cast<std::ptrdiff_t>(at), token.begin(), token.end());
        break;
      }
      default: {  // truncate
        if (!data.empty()) data.resize(below(data.size()));
        break;
      }
    }
  }

  std::mt19937_64 rng_;
  const std::vector<Bytes>& corpus_;
  const std::vector<Bytes>& dict_;
  size_t max_len_;
};

[[noreturn]] void usage(const char* message) {
  std::fprintf(stderr,
               "error: %s\nusage: %s [--runs N] [--seed S] [--max-len L] [--dict FILE] [--timeout SECONDS] "
               "[--artifacts DIR] CORPUS_DIR...\n",
               message, g_name.c_str());
  std::exit(2);
}

uint64_t number_arg(int& i, int argc, char** argv) {
  if (i + 1 >= argc) usage((std::string(argv[i]) + " needs a value").c_str());
  const std::string text = argv[++i];
  size_t used = 0;
  uint64_t value = 0;
  try {
    value = std::stoull(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != text.size() || text.empty() || text[0] == '-') {
    usage(("invalid value '" + text + "' for " + argv[i - 1]).c_str());
  }
  return value;
}

}  // namespace

int main(int argc, char** argv) {
  g_name = fs::path(argv[0]).filename().string();
  uint64_t runs = 1000;
  uint64_t seed = 1;
  uint64_t max_len = 4096;
  std::vector<std::string> dict_paths;
  std::string artifacts = ".";
  std::vector<std::string> corpus_dirs;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--runs") {
      runs = number_arg(i, argc, argv);
    } else if (arg == "--seed") {
      seed = number_arg(i, argc, argv);
    } else if (arg == "--max-len") {
      max_len = number_arg(i, argc, argv);
    } else if (arg == "--timeout") {
      g_timeout_s = static_cast<unsigned>(std::clamp<uint64_t>(number_arg(i, argc, argv), 1, 3600));
    } else if (arg == "--dict") {
      if (i + 1 >= argc) usage("--dict needs a value");
      dict_paths.emplace_back(argv[++i]);
    } else if (arg == "--artifacts") {
      if (i + 1 >= argc) usage("--artifacts needs a value");
      artifacts = argv[++i];
    } else if (arg.starts_with("-")) {
      usage(("unknown flag " + arg).c_str());
    } else {
      corpus_dirs.push_back(arg);
    }
  }
  g_artifact_prefix = (fs::path(artifacts) / (g_name + "-")).string();
  install_handlers();

  // The corpus: every regular file under the folders (README files describe them), in name order.
  std::vector<fs::path> files;
  for (const std::string& dir : corpus_dirs) {
    if (!fs::is_directory(dir)) usage(("corpus folder " + dir + " does not exist").c_str());
    for (const fs::directory_entry& entry : fs::recursive_directory_iterator(dir)) {
      if (entry.is_regular_file() && !entry.path().filename().string().starts_with("README")) {
        files.push_back(entry.path());
      }
    }
  }
  std::sort(files.begin(), files.end());
  std::vector<Bytes> corpus;
  for (const fs::path& file : files) corpus.push_back(read_file(file));
  std::vector<Bytes> dict;
  for (const std::string& path : dict_paths) {
    const std::vector<Bytes> tokens = read_dict(path);
    dict.insert(dict.end(), tokens.begin(), tokens.end());
  }

  const auto start = std::chrono::steady_clock::now();
  for (size_t i = 0; i < corpus.size(); ++i) run_one(corpus[i], files[i].string());
  Mutator mutator(seed, corpus, dict, static_cast<size_t>(max_len));
  for (uint64_t r = 0; r < runs; ++r) {
    const Bytes input = mutator.next();
    run_one(input, "mutated input " + std::to_string(r) + " (--seed " + std::to_string(seed) + ")");
  }
#if defined(MOECORE_FUZZ_ASAN)
  __lsan_do_leak_check();  // leaks end the run here (abort) instead of after the success line
#endif
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("fuzz %s: %llu inputs, 0 crashes (%zu corpus files replayed, %llu mutated, seed %llu, %.1f s)\n",
              g_name.c_str(), static_cast<unsigned long long>(corpus.size() + runs), corpus.size(),
              static_cast<unsigned long long>(runs), static_cast<unsigned long long>(seed), seconds);
  return 0;
}
