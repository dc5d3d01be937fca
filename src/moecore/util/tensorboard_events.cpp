#include "moecore/util/tensorboard_events.h"

#include <fcntl.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <bit>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <stdexcept>
#include <system_error>
#include <utility>

#include "moecore/util/little_endian.h"

namespace moecore {

namespace {

constexpr std::array<uint32_t, 256> make_crc32c_table() {
  std::array<uint32_t, 256> table{};
  for (uint32_t byte = 0; byte < 256; ++byte) {
    uint32_t crc = byte;
    for (int bit = 0; bit < 8; ++bit) crc = (crc & 1) != 0 ? (crc >> 1) ^ 0x82F63B78u : crc >> 1;
    table[byte] = crc;
  }
  return table;
}

constexpr std::array<uint32_t, 256> kCrc32cTable = make_crc32c_table();

uint32_t masked_crc32c_of(const std::string_view bytes) {
  return masked_crc32c(crc32c_of(std::as_bytes(std::span(bytes.data(), bytes.size()))));
}

void append_varint(std::string& out, uint64_t value) {
  while (value >= 0x80) {
    out.push_back(static_cast<char>((value & 0x7F) | 0x80));
    value >>= 7;
  }
  out.push_back(static_cast<char>(value));
}

// Protobuf field keys: (field number << 3) | wire type.
constexpr char kVarint = 0, kFixed64 = 1, kLengthDelimited = 2, kFixed32 = 5;
constexpr char key(const int field, const char wire_type) { return static_cast<char>((field << 3) | wire_type); }

void append_bytes_field(std::string& out, const int field, const std::string_view bytes) {
  out.push_back(key(field, kLengthDelimited));
  append_varint(out, bytes.size());
  out.append(bytes);
}

// A tensorflow.Event without its summary. Fields at their proto3 default (step 0, wall_time +0.0) are left out, as
// protobuf's own serializer does, so the bytes match what TensorFlow writes.
std::string event_head(const double wall_time, const int64_t step) {
  std::string event;
  if (std::bit_cast<uint64_t>(wall_time) != 0) {
    event.push_back(key(1, kFixed64));
    append_little_endian(event, std::bit_cast<uint64_t>(wall_time), 8);
  }
  if (step != 0) {
    event.push_back(key(2, kVarint));
    append_varint(event, static_cast<uint64_t>(step));  // negative steps: 10-byte two's complement
  }
  return event;
}

std::string scalar_event(const std::string_view tag, const float value, const int64_t step, const double wall_time) {
  std::string summary_value;
  if (!tag.empty()) append_bytes_field(summary_value, 1, tag);
  summary_value.push_back(key(2, kFixed32));  // simple_value is in a oneof: written even when 0
  append_little_endian(summary_value, std::bit_cast<uint32_t>(value), 4);
  std::string summary;
  append_bytes_field(summary, 1, summary_value);
  std::string event = event_head(wall_time, step);
  append_bytes_field(event, 5, summary);
  return event;
}

void append_record(std::string& out, const std::string_view data) {
  std::string length;
  append_little_endian(length, data.size(), 8);
  out.append(length);
  append_little_endian(out, masked_crc32c_of(length), 4);
  out.append(data);
  append_little_endian(out, masked_crc32c_of(data), 4);
}

double seconds_since_epoch() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

std::string host_name() {
  std::array<char, 256> name{};
  if (::gethostname(name.data(), name.size() - 1) != 0 || name[0] == '\0') return "localhost";
  return name.data();
}

std::string os_error(const int error) { return std::strerror(error); }

}  // namespace

uint32_t crc32c_of(const std::span<const std::byte> bytes, const uint32_t running) {
  uint32_t crc = ~running;
  for (const std::byte byte : bytes) crc = kCrc32cTable[(crc ^ static_cast<uint32_t>(byte)) & 0xFF] ^ (crc >> 8);
  return ~crc;
}

uint32_t masked_crc32c(const uint32_t crc) { return ((crc >> 15) | (crc << 17)) + 0xa282ead8u; }

TensorBoardWriter::FileDescriptor::~FileDescriptor() {
  if (fd_ >= 0) ::close(fd_);
}

TensorBoardWriter::FileDescriptor::FileDescriptor(FileDescriptor&& other) noexcept
    : fd_(std::exchange(other.fd_, -1)) {}

TensorBoardWriter::FileDescriptor& TensorBoardWriter::FileDescriptor::operator=(FileDescriptor&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = std::exchange(other.fd_, -1);
  }
  return *this;
}

TensorBoardWriter::TensorBoardWriter(const std::string& dir, const int64_t max_queue) : max_queue_(max_queue) {
  if (max_queue < 1) {
    throw std::invalid_argument("TensorBoard max_queue must be at least 1, got " + std::to_string(max_queue));
  }
  std::error_code error;
  std::filesystem::create_directories(dir, error);
  if (error) throw std::runtime_error("cannot create directory " + dir + ": " + error.message());

  const double wall_time = seconds_since_epoch();
  const std::string prefix = (std::filesystem::path(dir) / "events.out.tfevents.").string() +
                             std::to_string(static_cast<int64_t>(wall_time)) + "." + host_name() + "." +
                             std::to_string(::getpid()) + ".";
  static std::atomic<int64_t> files_made{0};
  // O_EXCL: never append to another writer's file, even one of an earlier process with this pid.
  int fd = -1;
  do {
    path_ = prefix + std::to_string(files_made++);
    fd = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  } while (fd < 0 && errno == EEXIST);
  if (fd < 0) throw std::runtime_error("cannot create " + path_ + ": " + os_error(errno));
  file_ = FileDescriptor(fd);

  std::string header = event_head(wall_time, 0);
  append_bytes_field(header, 3, "brain.Event:2");
  append_record(unwritten_, header);
  flush();
}

TensorBoardWriter::~TensorBoardWriter() { close(); }

TensorBoardWriter& TensorBoardWriter::operator=(TensorBoardWriter&& other) noexcept {
  if (this != &other) {
    close();
    path_ = std::move(other.path_);
    file_ = std::move(other.file_);
    max_queue_ = other.max_queue_;
    queued_ = std::exchange(other.queued_, 0);
    unwritten_ = std::move(other.unwritten_);
  }
  return *this;
}

void TensorBoardWriter::close() noexcept {
  try {
    flush();
  } catch (...) {  // a destructor's last flush: what cannot be written is lost
  }
  file_ = FileDescriptor();
}

void TensorBoardWriter::add_scalar(const std::string_view tag, const double value, const int64_t step) {
  add_scalar(tag, value, step, seconds_since_epoch());
}

void TensorBoardWriter::add_scalar(const std::string_view tag, const double value, const int64_t step,
                                   const double wall_time) {
  if (file_.get() < 0) throw std::runtime_error("TensorBoardWriter has no file: it was moved from");
  append_record(unwritten_, scalar_event(tag, static_cast<float>(value), step, wall_time));
  if (++queued_ >= max_queue_) flush();
}

void TensorBoardWriter::flush() {
  if (unwritten_.empty() || file_.get() < 0) return;
  size_t written = 0;
  while (written < unwritten_.size()) {
    const ssize_t n = ::write(file_.get(), unwritten_.data() + written, unwritten_.size() - written);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int error = n == 0 ? ENOSPC : errno;  // no progress: the device takes no more bytes
      unwritten_.erase(0, written);
      throw std::runtime_error("cannot write " + path_ + ": " + os_error(error));
    }
    written += static_cast<size_t>(n);
  }
  unwritten_.clear();
  queued_ = 0;
}

}  // namespace moecore
