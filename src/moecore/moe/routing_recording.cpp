#include "moecore/moe/routing_recording.h"

#include <algorithm>
#include <cstddef>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <span>
#include <string_view>

#include "moecore/model/config.h"
#include "moecore/util/atomic_file.h"
#include "moecore/util/checksum.h"
#include "moecore/util/little_endian.h"

namespace moecore {
namespace {

constexpr std::string_view kMagic = "MOEROUTE";
constexpr uint32_t kVersion = 1;
// Bounds that keep every size product far inside 64 bits (and a corrupt count from allocating the machine).
constexpr int64_t kMaxRouters = 1 << 16, kMaxTopk = 1 << 10, kMaxExperts = 1 << 20, kMaxTokens = int64_t{1} << 26;

uint32_t crc_of(const std::string_view bytes) {
  return crc32_of(std::span<const std::byte>(reinterpret_cast<const std::byte*>(bytes.data()), bytes.size()));
}

// Reads the file's bytes front to back; every shortfall is a one-line error naming the file.
class Reader {
 public:
  Reader(std::string path, const std::string& bytes) : path_(std::move(path)), bytes_(bytes) {}

  uint64_t take(const int width, const char* what) {
    if (bytes_.size() - at_ < static_cast<size_t>(width)) fail(std::string("truncated in ") + what);
    const uint64_t value = read_little_endian(std::string_view(bytes_).substr(at_, static_cast<size_t>(width)));
    at_ += static_cast<size_t>(width);
    return value;
  }
  int64_t bounded(const int width, const char* what, const int64_t low, const int64_t high) {
    const uint64_t value = take(width, what);
    if (value < static_cast<uint64_t>(low) || value > static_cast<uint64_t>(high)) {
      fail(std::string(what) + " " + std::to_string(value) + " is outside [" + std::to_string(low) + ", " +
           std::to_string(high) + "]");
    }
    return static_cast<int64_t>(value);
  }
  // The CRC-32 stored next, checked against the bytes since `from`.
  void check_crc(const size_t from, const char* what) {
    const uint32_t computed = crc_of(std::string_view(bytes_).substr(from, at_ - from));
    const auto stored = static_cast<uint32_t>(take(4, what));
    if (stored != computed) {
      fail(std::string(what) + " does not match its bytes (stored " + crc32_text(stored) + ", computed " +
           crc32_text(computed) + ")");
    }
  }
  size_t at() const { return at_; }
  bool done() const { return at_ == bytes_.size(); }
  // Consumes the magic bytes; false when the file does not start with them.
  bool take_magic() {
    if (bytes_.size() < kMagic.size()) fail("too short for a routing recording");
    at_ = kMagic.size();
    return std::equal(kMagic.begin(), kMagic.end(), bytes_.begin());
  }
  [[noreturn]] void fail(const std::string& problem) const {
    throw ConfigError("routing recording " + path_ + ": " + problem);
  }

 private:
  std::string path_;
  const std::string& bytes_;
  size_t at_ = 0;
};

std::string file_bytes(const std::string& path) {
  std::error_code error;
  if (!std::filesystem::is_regular_file(path, error)) {
    throw ConfigError("routing recording " + path + ": no such file");
  }
  std::ifstream in(path, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) throw ConfigError("routing recording " + path + ": cannot be read");
  return bytes;
}

}  // namespace

std::string routing_recording_problem(const RoutingRecording& recording) {
  const int64_t R = recording.num_routers(), k = recording.topk, E = recording.num_experts;
  if (R < 1 || R > kMaxRouters) return "the number of routers must be in [1, " + std::to_string(kMaxRouters) + "]";
  if (k < 1 || k > kMaxTopk) return "top-k must be in [1, " + std::to_string(kMaxTopk) + "]";
  if (E < k || E > kMaxExperts) return "the number of experts must be in [top-k, " + std::to_string(kMaxExperts) + "]";
  for (size_t i = 0; i < recording.records.size(); ++i) {
    const RoutingRecord& record = recording.records[i];
    const auto n = static_cast<int64_t>(record.tokens.size());
    const std::string where = "record " + std::to_string(i) + ": ";
    if (n < 1 || n > kMaxTokens) return where + "the token count must be in [1, " + std::to_string(kMaxTokens) + "]";
    if (record.routed < 0 || record.routed > n) return where + "more routed tokens than tokens";
    if (static_cast<int64_t>(record.experts.size()) != record.routed * R * k) {
      return where + "expert ids do not fill routed x routers x top-k";
    }
    for (int64_t t = 0; t < record.routed; ++t) {
      for (int64_t r = 0; r < R; ++r) {
        const int32_t* ids = recording.experts_of(record, t, r);
        for (int64_t a = 0; a < k; ++a) {
          if (ids[a] < 0 || ids[a] >= E) {
            return where + "token " + std::to_string(t) + ", router " + std::to_string(r) + ": expert " +
                   std::to_string(ids[a]) + " is outside [0, " + std::to_string(E) + ")";
          }
          for (int64_t b = 0; b < a; ++b) {
            if (ids[a] == ids[b]) {
              return where + "token " + std::to_string(t) + ", router " + std::to_string(r) + ": expert " +
                     std::to_string(ids[a]) + " is chosen twice";
            }
          }
        }
      }
    }
  }
  return "";
}

RoutingRecording read_routing_recording(const std::string& path) {
  const std::string bytes = file_bytes(path);
  Reader in(path, bytes);
  if (!in.take_magic()) in.fail("not a routing recording (its first 8 bytes are not MOEROUTE)");
  if (const uint64_t version = in.take(4, "the version"); version != kVersion) {
    in.fail("version " + std::to_string(version) + " (this moecore reads version " + std::to_string(kVersion) + ")");
  }
  RoutingRecording recording;
  const int64_t R = in.bounded(4, "the number of routers", 1, kMaxRouters);
  recording.topk = in.bounded(4, "top-k", 1, kMaxTopk);
  recording.num_experts = in.bounded(4, "the number of experts", recording.topk, kMaxExperts);
  for (int64_t r = 0; r < R; ++r) recording.router_layers.push_back(in.bounded(4, "a router's layer", 0, kMaxRouters));
  const uint64_t count = in.take(8, "the number of records");
  in.check_crc(0, "the header's CRC-32");
  for (uint64_t i = 0; i < count; ++i) {
    const size_t start = in.at();
    RoutingRecord record;
    const int64_t n = in.bounded(4, "a record's token count", 1, kMaxTokens);
    record.routed = in.bounded(4, "a record's routed token count", 0, n);
    record.tokens.resize(static_cast<size_t>(n));
    for (int32_t& token : record.tokens) token = static_cast<int32_t>(static_cast<uint32_t>(in.take(4, "a token id")));
    record.experts.resize(static_cast<size_t>(record.routed * R * recording.topk));
    for (int32_t& expert : record.experts) {
      expert = static_cast<int32_t>(static_cast<uint32_t>(in.take(4, "an expert id")));
    }
    in.check_crc(start, ("record " + std::to_string(i) + "'s CRC-32").c_str());
    recording.records.push_back(std::move(record));
  }
  if (!in.done()) in.fail("bytes after the last of its " + std::to_string(count) + " records");
  if (const std::string problem = routing_recording_problem(recording); !problem.empty()) in.fail(problem);
  return recording;
}

void write_routing_recording(const std::string& path, const RoutingRecording& recording) {
  if (const std::string problem = routing_recording_problem(recording); !problem.empty()) {
    throw ConfigError("routing recording " + path + ": " + problem);
  }
  std::string bytes(kMagic);
  append_little_endian(bytes, kVersion, 4);
  append_little_endian(bytes, static_cast<uint64_t>(recording.num_routers()), 4);
  append_little_endian(bytes, static_cast<uint64_t>(recording.topk), 4);
  append_little_endian(bytes, static_cast<uint64_t>(recording.num_experts), 4);
  for (const int64_t layer : recording.router_layers) append_little_endian(bytes, static_cast<uint64_t>(layer), 4);
  append_little_endian(bytes, recording.records.size(), 8);
  append_little_endian(bytes, crc_of(bytes), 4);
  for (const RoutingRecord& record : recording.records) {
    const size_t start = bytes.size();
    append_little_endian(bytes, record.tokens.size(), 4);
    append_little_endian(bytes, static_cast<uint64_t>(record.routed), 4);
    for (const int32_t token : record.tokens) append_little_endian(bytes, static_cast<uint32_t>(token), 4);
    for (const int32_t expert : record.experts) append_little_endian(bytes, static_cast<uint32_t>(expert), 4);
    append_little_endian(bytes, crc_of(std::string_view(bytes).substr(start)), 4);
  }
  AtomicFile file(path);
  file.write(bytes);
  file.commit();
}

}  // namespace moecore
