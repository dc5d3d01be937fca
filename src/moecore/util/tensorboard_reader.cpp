#include "moecore/util/tensorboard_reader.h"

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <span>
#include <stdexcept>
#include <string_view>

#include "moecore/util/little_endian.h"
#include "moecore/util/tensorboard_events.h"

namespace moecore {

namespace {

// A protobuf message's bytes read field by field; a malformed message throws std::invalid_argument.
class ProtoReader {
 public:
  explicit ProtoReader(const std::string_view bytes) : bytes_(bytes) {}
  bool done() const { return at_ == bytes_.size(); }

  uint64_t varint() {
    uint64_t value = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      if (at_ >= bytes_.size()) throw std::invalid_argument("a varint runs past the message");
      const auto byte = static_cast<uint8_t>(bytes_[at_++]);
      value |= static_cast<uint64_t>(byte & 0x7F) << shift;
      if ((byte & 0x80) == 0) return value;
    }
    throw std::invalid_argument("a varint is longer than 10 bytes");
  }
  uint64_t fixed(const int bytes) {
    if (bytes_.size() - at_ < static_cast<size_t>(bytes)) throw std::invalid_argument("a fixed field runs past");
    uint64_t value = 0;
    for (int i = 0; i < bytes; ++i) value |= static_cast<uint64_t>(static_cast<uint8_t>(bytes_[at_++])) << (8 * i);
    return value;
  }
  std::string_view length_delimited() {
    const uint64_t size = varint();
    if (size > bytes_.size() - at_) throw std::invalid_argument("a length-delimited field runs past the message");
    const std::string_view out = bytes_.substr(at_, size);
    at_ += size;
    return out;
  }
  void skip(const int wire_type) {
    switch (wire_type) {
      case 0: varint(); return;
      case 1: fixed(8); return;
      case 2: length_delimited(); return;
      case 5: fixed(4); return;
      default: throw std::invalid_argument("wire type " + std::to_string(wire_type) + " is not readable");
    }
  }

 private:
  std::string_view bytes_;
  size_t at_ = 0;
};

// summary.value: tag (1), simple_value (2, float). Values without a simple_value (images, histograms) are skipped.
void read_summary(const std::string_view summary, const int64_t step, const double wall_time, TensorBoardEvents& out) {
  ProtoReader fields(summary);
  while (!fields.done()) {
    const uint64_t key = fields.varint();
    if (key != ((1 << 3) | 2)) {
      fields.skip(static_cast<int>(key & 7));
      continue;
    }
    ProtoReader value(fields.length_delimited());
    TensorBoardScalar scalar{.tag = "", .step = step, .value = 0.0, .wall_time = wall_time};
    bool simple = false;
    while (!value.done()) {
      const uint64_t value_key = value.varint();
      if (value_key == ((1 << 3) | 2)) {
        scalar.tag = std::string(value.length_delimited());
      } else if (value_key == ((2 << 3) | 5)) {
        scalar.value = std::bit_cast<float>(static_cast<uint32_t>(value.fixed(4)));
        simple = true;
      } else {
        value.skip(static_cast<int>(value_key & 7));
      }
    }
    if (simple) out.scalars.push_back(std::move(scalar));
  }
}

void read_event(const std::string_view event, TensorBoardEvents& out) {
  ProtoReader fields(event);
  double wall_time = 0.0;
  int64_t step = 0;
  std::string_view summary;
  while (!fields.done()) {
    const uint64_t key = fields.varint();
    switch (key) {
      case (1 << 3) | 1: wall_time = std::bit_cast<double>(fields.fixed(8)); break;
      case (2 << 3) | 0: step = static_cast<int64_t>(fields.varint()); break;
      case (3 << 3) | 2: out.file_version = std::string(fields.length_delimited()); break;
      case (5 << 3) | 2: summary = fields.length_delimited(); break;
      default: fields.skip(static_cast<int>(key & 7));
    }
  }
  if (!summary.empty()) read_summary(summary, step, wall_time, out);
}

uint32_t masked_crc_of(const std::string_view bytes) {
  return masked_crc32c(crc32c_of(std::as_bytes(std::span(bytes.data(), bytes.size()))));
}

}  // namespace

TensorBoardEvents read_tensorboard_events(const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  if (!file) throw std::runtime_error("cannot read " + path + ": " + std::strerror(errno));
  const std::string bytes((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  if (file.bad()) throw std::runtime_error("cannot read " + path + ": " + std::strerror(errno));
  TensorBoardEvents out;
  const std::string_view all(bytes);
  size_t at = 0;
  while (at < all.size()) {
    const auto corrupt = [&](const std::string& what) {
      return std::runtime_error(path + ": the record at byte " + std::to_string(at) + " is corrupt (" + what + ")");
    };
    if (all.size() - at < 12) {
      out.truncated_tail = true;
      break;
    }
    const std::string_view length_bytes = all.substr(at, 8);
    if (read_little_endian(all.substr(at + 8, 4)) != masked_crc_of(length_bytes)) throw corrupt("length CRC");
    const uint64_t length = read_little_endian(length_bytes);
    if (length > all.size() - at - 12 || all.size() - at - 12 - length < 4) {
      out.truncated_tail = true;
      break;
    }
    const std::string_view data = all.substr(at + 12, length);
    if (read_little_endian(all.substr(at + 12 + length, 4)) != masked_crc_of(data)) throw corrupt("data CRC");
    try {
      read_event(data, out);
    } catch (const std::invalid_argument& e) {
      throw corrupt(e.what());
    }
    at += 16 + length;
  }
  return out;
}

std::vector<std::string> tensorboard_event_files(const std::string& dir) {
  std::vector<std::string> files;
  std::error_code error;
  for (const auto& entry : std::filesystem::directory_iterator(dir, error)) {
    const std::string name = entry.path().filename().string();
    if (entry.is_regular_file() && name.starts_with("events.out.tfevents.")) files.push_back(entry.path().string());
  }
  std::sort(files.begin(), files.end());
  return files;
}

}  // namespace moecore
