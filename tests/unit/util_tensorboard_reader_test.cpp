// read_tensorboard_events: records built here byte by byte from TensorFlow's formats (TFRecord framing with masked
// CRC-32C, tensorflow.Event / Summary protobufs) and files TensorBoardWriter wrote read back; corrupt and cut files.
#include <gtest/gtest.h>

#include <bit>
#include <cstdint>
#include <fstream>
#include <span>
#include <string>
#include <string_view>

#include "moecore/util/tensorboard_events.h"
#include "moecore/util/tensorboard_reader.h"
#include "test_temp_dir.h"

namespace moecore {
namespace {

std::string little_endian(const uint64_t value, const int bytes) {
  std::string out;
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>((value >> (8 * i)) & 0xFF));
  return out;
}

uint32_t masked_crc(const std::string_view bytes) {
  return masked_crc32c(crc32c_of(std::as_bytes(std::span(bytes.data(), bytes.size()))));
}

std::string record(const std::string& data) {
  const std::string length = little_endian(data.size(), 8);
  return length + little_endian(masked_crc(length), 4) + data + little_endian(masked_crc(data), 4);
}

// Protobuf pieces (fields below 16, lengths below 128: one-byte keys and lengths).
std::string bytes_field(const int field, const std::string& bytes) {
  return std::string(1, static_cast<char>((field << 3) | 2)) + static_cast<char>(bytes.size()) + bytes;
}
std::string float_field(const int field, const float value) {
  return std::string(1, static_cast<char>((field << 3) | 5)) + little_endian(std::bit_cast<uint32_t>(value), 4);
}
std::string double_field(const int field, const double value) {
  return std::string(1, static_cast<char>((field << 3) | 1)) + little_endian(std::bit_cast<uint64_t>(value), 8);
}
std::string varint_field(const int field, const uint8_t value) {  // value < 128
  return std::string(1, static_cast<char>(field << 3)) + static_cast<char>(value);
}

void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
}

std::string hand_made_file() {
  const std::string header = record(double_field(1, 1700000000.5) + bytes_field(3, "brain.Event:2"));
  // Event{wall_time, step 7, summary{value{tag "lm loss", simple_value 2.5}, value{tag "img" (an image: skipped)}}}
  const std::string values =
      bytes_field(1, bytes_field(1, "lm loss") + float_field(2, 2.5f)) + bytes_field(1, bytes_field(1, "img"));
  const std::string scalar = record(double_field(1, 1700000001.0) + varint_field(2, 7) + bytes_field(5, values));
  // An Event with an unknown field (99 would need two key bytes: use 14, a varint) and step 0 left out.
  const std::string other =
      record(varint_field(14, 3) + bytes_field(5, bytes_field(1, bytes_field(1, "lr") + float_field(2, -0.125f))));
  return header + scalar + other;
}

TEST(TensorBoardReader, ReadsHandMadeRecords) {
  const test::TempDir dir("tb_reader");
  write_file(dir.path("events.out.tfevents.1.host.1.0"), hand_made_file());
  const TensorBoardEvents events = read_tensorboard_events(dir.path("events.out.tfevents.1.host.1.0"));
  EXPECT_EQ(events.file_version, "brain.Event:2");
  EXPECT_FALSE(events.truncated_tail);
  ASSERT_EQ(events.scalars.size(), 2u);
  EXPECT_EQ(events.scalars[0].tag, "lm loss");
  EXPECT_EQ(events.scalars[0].step, 7);
  EXPECT_EQ(events.scalars[0].value, 2.5);
  EXPECT_EQ(events.scalars[0].wall_time, 1700000001.0);
  EXPECT_EQ(events.scalars[1].tag, "lr");
  EXPECT_EQ(events.scalars[1].step, 0);
  EXPECT_EQ(events.scalars[1].value, -0.125);
}

TEST(TensorBoardReader, ReadsWhatTheWriterWrote) {
  const test::TempDir dir("tb_reader");
  std::string path;
  {
    TensorBoardWriter writer(dir.path("tb"), 2);
    writer.add_scalar("lm loss", 10.83297, 1, 5.0);
    writer.add_scalar("learning-rate", 6e-4, 1, 5.0);
    writer.add_scalar("lm loss", 7.25, 2, 6.0);
    writer.add_scalar("negative step", 1.0, -3, 7.0);
    path = writer.path();
  }
  EXPECT_EQ(tensorboard_event_files(dir.path("tb")), std::vector<std::string>{path});
  const TensorBoardEvents events = read_tensorboard_events(path);
  ASSERT_EQ(events.scalars.size(), 4u);
  EXPECT_EQ(events.scalars[0].value, static_cast<double>(10.83297f));  // stored as a float
  EXPECT_EQ(events.scalars[1].tag, "learning-rate");
  EXPECT_EQ(events.scalars[2].step, 2);
  EXPECT_EQ(events.scalars[3].step, -3);
  EXPECT_EQ(events.scalars[3].wall_time, 7.0);
}

TEST(TensorBoardReader, ACutFileKeepsItsWholeRecords) {
  const test::TempDir dir("tb_reader");
  const std::string whole = hand_made_file();
  for (const size_t cut : {size_t{3}, size_t{13}, size_t{20}}) {
    write_file(dir.path("events.out.tfevents.1"), whole.substr(0, whole.size() - cut));
    const TensorBoardEvents events = read_tensorboard_events(dir.path("events.out.tfevents.1"));
    EXPECT_TRUE(events.truncated_tail) << cut;
    EXPECT_EQ(events.scalars.size(), 1u) << cut;
  }
}

TEST(TensorBoardReader, ACorruptRecordNamesItsOffset) {
  const test::TempDir dir("tb_reader");
  std::string bytes = hand_made_file();
  const size_t second = record(double_field(1, 1700000000.5) + bytes_field(3, "brain.Event:2")).size();
  std::string data_flip = bytes;
  data_flip[second + 20] ^= 0x01;  // inside the second record's data
  write_file(dir.path("a"), data_flip);
  test::expect_error_containing<std::runtime_error>(
      [&] { read_tensorboard_events(dir.path("a")); },
      "the record at byte " + std::to_string(second) + " is corrupt (data CRC)");
  std::string length_flip = bytes;
  length_flip[second] ^= 0x01;
  write_file(dir.path("b"), length_flip);
  test::expect_error_containing<std::runtime_error>([&] { read_tensorboard_events(dir.path("b")); }, "(length CRC)");
  test::expect_error_containing<std::runtime_error>([&] { read_tensorboard_events(dir.path("missing")); },
                                                    "cannot read");
}

// A record whose CRCs hold but whose protobuf runs past its end is corrupt, not a crash.
TEST(TensorBoardReader, AMalformedEventIsCorrupt) {
  const test::TempDir dir("tb_reader");
  write_file(dir.path("c"), record(std::string("\x2a\x7f", 2) + "short"));  // summary of 127 bytes, 5 present
  test::expect_error_containing<std::runtime_error>([&] { read_tensorboard_events(dir.path("c")); },
                                                    "runs past the message");
}

}  // namespace
}  // namespace moecore
