// TensorBoardWriter: event files whose records (TFRecord framing, masked CRC-32C, tensorflow.Event protobufs) read back
// with a reader written here and with the independent scripts/read_tfevents.py; the queue, flush and file naming.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <bit>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "moecore/util/tensorboard_events.h"
#include "test_source_dir.h"
#include "test_temp_dir.h"

namespace moecore {
namespace {

namespace fs = std::filesystem;

std::span<const std::byte> bytes_of(const std::string_view text) {
  return std::as_bytes(std::span(text.data(), text.size()));
}

std::string contents(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream out;
  out << in.rdbuf();
  return out.str();
}

void overwrite(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
}

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

uint64_t little_endian(const std::string_view bytes) {
  uint64_t value = 0;
  for (size_t i = 0; i < bytes.size(); ++i) value |= uint64_t{static_cast<unsigned char>(bytes[i])} << (8 * i);
  return value;
}

// "0a 01 61" -> the bytes 0x0a 0x01 0x61.
std::string bytes_of_hex(const std::string_view hex) {
  std::string bytes;
  for (size_t i = 0; i < hex.size();) {
    if (hex[i] == ' ') {
      ++i;
      continue;
    }
    bytes.push_back(static_cast<char>(std::stoi(std::string(hex.substr(i, 2)), nullptr, 16)));
    i += 2;
  }
  return bytes;
}

// The data of each TFRecord in `file`, both masked CRCs checked.
std::vector<std::string> records_of(const std::string& file) {
  std::vector<std::string> records;
  size_t pos = 0;
  while (pos < file.size()) {
    const std::string_view rest = std::string_view(file).substr(pos);
    if (rest.size() < 12) {
      ADD_FAILURE() << "record " << records.size() << ": " << rest.size() << " bytes left, less than a header";
      break;
    }
    const uint64_t length = little_endian(rest.substr(0, 8));
    EXPECT_EQ(little_endian(rest.substr(8, 4)), masked_crc32c(crc32c_of(bytes_of(rest.substr(0, 8)))))
        << "length CRC of record " << records.size();
    if (rest.size() < 12 + length + 4) {
      ADD_FAILURE() << "record " << records.size() << " runs past the end of the file";
      break;
    }
    const std::string_view data = rest.substr(12, length);
    EXPECT_EQ(little_endian(rest.substr(12 + length, 4)), masked_crc32c(crc32c_of(bytes_of(data))))
        << "data CRC of record " << records.size();
    records.emplace_back(data);
    pos += 12 + length + 4;
  }
  return records;
}

// Protobuf fields: (number, wire type, value), the value's bytes or its varint.
struct Field {
  int number = 0;
  int wire_type = 0;
  uint64_t varint = 0;
  std::string_view bytes;
};

std::vector<Field> fields_of(std::string_view message) {
  const auto read_varint = [&message]() {
    uint64_t value = 0;
    for (int shift = 0; !message.empty(); shift += 7) {
      const auto byte = static_cast<unsigned char>(message[0]);
      message.remove_prefix(1);
      value |= uint64_t{byte & 0x7Fu} << shift;
      if ((byte & 0x80) == 0) return value;
    }
    ADD_FAILURE() << "varint runs past the message";
    return value;
  };
  std::vector<Field> fields;
  while (!message.empty()) {
    const uint64_t key = read_varint();
    Field field{static_cast<int>(key >> 3), static_cast<int>(key & 7), 0, {}};
    size_t size = 0;
    switch (field.wire_type) {
      case 0: field.varint = read_varint(); break;
      case 1: size = 8; break;
      case 5: size = 4; break;
      case 2: size = read_varint(); break;
      default: ADD_FAILURE() << "wire type " << field.wire_type; return fields;
    }
    if (size > message.size()) {
      ADD_FAILURE() << "field " << field.number << " runs past the message";
      return fields;
    }
    field.bytes = message.substr(0, size);
    message.remove_prefix(size);
    fields.push_back(field);
  }
  return fields;
}

// A scalar as read back.
struct Scalar {
  std::string tag;
  float value = 0;
  int64_t step = 0;
  double wall_time = 0;
};

struct Event {
  std::optional<double> wall_time;
  int64_t step = 0;
  std::string file_version;
  std::vector<Scalar> scalars;  // their tag and value; the step and wall time are the event's
};

Event event_of(const std::string_view data) {
  Event event;
  for (const Field& field : fields_of(data)) {
    if (field.number == 1 && field.wire_type == 1) event.wall_time = std::bit_cast<double>(little_endian(field.bytes));
    if (field.number == 2 && field.wire_type == 0) event.step = static_cast<int64_t>(field.varint);
    if (field.number == 3 && field.wire_type == 2) event.file_version = field.bytes;
    if (field.number != 5 || field.wire_type != 2) continue;
    for (const Field& value : fields_of(field.bytes)) {
      EXPECT_EQ(value.number, 1);
      Scalar scalar;
      for (const Field& part : fields_of(value.bytes)) {
        if (part.number == 1) scalar.tag = part.bytes;
        if (part.number == 2) {
          EXPECT_EQ(part.wire_type, 5);
          scalar.value = std::bit_cast<float>(static_cast<uint32_t>(little_endian(part.bytes)));
        }
      }
      event.scalars.push_back(scalar);
    }
  }
  return event;
}

// The scalars of an event file in order, each event checked to hold one, after its brain.Event:2 header.
std::vector<Scalar> scalars_in(const std::string& path) {
  const std::vector<std::string> records = records_of(contents(path));
  std::vector<Scalar> scalars;
  if (records.empty()) {
    ADD_FAILURE() << path << " has no records";
    return scalars;
  }
  EXPECT_EQ(event_of(records[0]).file_version, "brain.Event:2");
  for (size_t i = 1; i < records.size(); ++i) {
    const Event event = event_of(records[i]);
    EXPECT_EQ(event.file_version, "");
    EXPECT_EQ(event.scalars.size(), 1u) << "record " << i;
    for (Scalar scalar : event.scalars) {
      scalar.step = event.step;
      scalar.wall_time = event.wall_time.value_or(0);
      scalars.push_back(scalar);
    }
  }
  return scalars;
}

void expect_same_value(const float actual, const double written, const std::string& tag) {
  if (std::isnan(written)) {
    EXPECT_TRUE(std::isnan(actual)) << tag;
  } else {
    EXPECT_EQ(actual, static_cast<float>(written)) << tag;
  }
}

// Every event file starts so: data length 24, then the masked CRC of those 8 bytes (0x224b7fa3, also from
// scripts/read_tfevents.py and seen at the start of files TensorFlow writes).
constexpr std::string_view kHeaderStart = "\x18\0\0\0\0\0\0\0\xa3\x7f\x4b\x22";
constexpr size_t kHeaderRecordSize = 12 + 24 + 4;

TEST(UtilTensorBoardCrc32c, CheckValueEmptyInputAndContinuation) {
  EXPECT_EQ(crc32c_of(bytes_of("123456789")), 0xE3069283u);
  EXPECT_EQ(crc32c_of({}), 0u);
  EXPECT_EQ(crc32c_of(bytes_of("56789"), crc32c_of(bytes_of("1234"))), 0xE3069283u);
  EXPECT_EQ(crc32c_of({}, 0xE3069283u), 0xE3069283u);
}

TEST(UtilTensorBoardCrc32c, MaskMatchesTheIndependentDecoder) {
  // The expected values were printed by scripts/read_tfevents.py's own CRC-32C and mask:
  //   masked_crc32c(b"123456789") and masked_crc32c(struct.pack("<Q", 24)).
  EXPECT_EQ(masked_crc32c(0xE3069283u), 0xC78AB0E5u);
  const std::string length_24 = bytes_of_hex("18 00 00 00 00 00 00 00");
  EXPECT_EQ(masked_crc32c(crc32c_of(bytes_of(length_24))), 0x224B7FA3u);
}

TEST(UtilTensorBoardWriter, ScalarsReadBackInOrderAfterTheHeader) {
  const test::TempDir dir("tensorboard");
  struct Written {
    std::string tag;
    double value;
    int64_t step;
    double wall_time;
  };
  const std::vector<Written> written = {
      {"loss", 0.1, 0, 1700000000.25},
      {"loss", -3.5, 1, 1700000001.5},
      {"lr", 1e30, -7, 1700000002.0},
      {"grad/norm", std::numeric_limits<double>::quiet_NaN(), 2, 1700000003.0},
      {"", 0.0, std::numeric_limits<int64_t>::min(), 1.0},
      {"tokens", 123456789.0, std::numeric_limits<int64_t>::max(), 0.0},  // wall_time 0 is left out, read as 0
  };
  const double before = now_seconds();
  std::string path;
  {
    TensorBoardWriter writer(dir.path().string());
    path = writer.path();
    for (const Written& scalar : written) writer.add_scalar(scalar.tag, scalar.value, scalar.step, scalar.wall_time);
    writer.add_scalar("now", 2.0, 9);
    writer.flush();
    EXPECT_EQ(contents(path).substr(0, kHeaderStart.size()), kHeaderStart);
    const std::vector<std::string> records = records_of(contents(path));
    ASSERT_EQ(records.size(), written.size() + 2);
    const Event header = event_of(records[0]);
    EXPECT_EQ(header.file_version, "brain.Event:2");
    EXPECT_EQ(header.step, 0);
    EXPECT_EQ(records[0].size() + 16, kHeaderRecordSize);
    ASSERT_TRUE(header.wall_time.has_value());
    EXPECT_GE(*header.wall_time, before);
    EXPECT_LE(*header.wall_time, now_seconds());
  }
  const std::vector<Scalar> read = scalars_in(path);
  ASSERT_EQ(read.size(), written.size() + 1);
  for (size_t i = 0; i < written.size(); ++i) {
    EXPECT_EQ(read[i].tag, written[i].tag);
    EXPECT_EQ(read[i].step, written[i].step) << read[i].tag;
    EXPECT_EQ(read[i].wall_time, written[i].wall_time) << read[i].tag;
    expect_same_value(read[i].value, written[i].value, read[i].tag);
  }
  EXPECT_EQ(read.back().tag, "now");
  EXPECT_EQ(read.back().value, 2.0f);
  EXPECT_GE(read.back().wall_time, before);
  EXPECT_LE(read.back().wall_time, now_seconds());
}

TEST(UtilTensorBoardWriter, OneRecordIsByteExact) {
  const test::TempDir dir("tensorboard");
  TensorBoardWriter writer(dir.path().string());
  writer.add_scalar("a", 1.0, 3, 1700000000.5);
  writer.flush();
  // Event {wall_time: 1700000000.5 (09 + fixed64), step: 3 (10 03), summary (2a, 10 bytes) {value (0a, 8 bytes)
  // {tag: "a" (0a 01 61), simple_value: 1.0f (15 + fixed32)}}}, framed: length 23, its masked CRC, the data, the
  // data's masked CRC (both CRCs printed by scripts/read_tfevents.py's masked_crc32c).
  const std::string expected = bytes_of_hex(
      "17 00 00 00 00 00 00 00  e7 ce f8 1e"
      "  09 00 00 20 40 fc 54 d9 41  10 03  2a 0a  0a 08  0a 01 61  15 00 00 80 3f"
      "  b7 cf 08 23");
  const std::string file = contents(writer.path());
  ASSERT_EQ(file.size(), kHeaderRecordSize + expected.size());
  EXPECT_EQ(file.substr(kHeaderRecordSize), expected);
}

TEST(UtilTensorBoardWriter, WritesWhenTheQueueIsFull) {
  const test::TempDir dir("tensorboard");
  TensorBoardWriter writer(dir.path().string(), 2);
  EXPECT_EQ(fs::file_size(writer.path()), kHeaderRecordSize) << "the header is written at once";
  writer.add_scalar("loss", 1.0, 1);
  EXPECT_EQ(fs::file_size(writer.path()), kHeaderRecordSize) << "one scalar stays queued";
  writer.add_scalar("loss", 2.0, 2);
  const std::vector<Scalar> two = scalars_in(writer.path());
  ASSERT_EQ(two.size(), 2u);
  EXPECT_EQ(two[1].value, 2.0f);
  writer.add_scalar("loss", 3.0, 3);
  EXPECT_EQ(scalars_in(writer.path()).size(), 2u) << "the queue starts again after it is written";
  writer.flush();
  EXPECT_EQ(scalars_in(writer.path()).size(), 3u);
}

TEST(UtilTensorBoardWriter, DestructorFlushes) {
  const test::TempDir dir("tensorboard");
  std::string path;
  {
    TensorBoardWriter writer(dir.path().string());
    path = writer.path();
    writer.add_scalar("loss", 1.5, 10);
    writer.add_scalar("loss", 1.25, 20);
    EXPECT_EQ(fs::file_size(path), kHeaderRecordSize);
  }
  const std::vector<Scalar> read = scalars_in(path);
  ASSERT_EQ(read.size(), 2u);
  EXPECT_EQ(read[0].step, 10);
  EXPECT_EQ(read[1].value, 1.25f);
}

TEST(UtilTensorBoardWriter, FlushedScalarsSurviveSigkill) {
  const test::TempDir dir("tensorboard");
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {  // the child never returns into the test runner
    try {
      TensorBoardWriter writer(dir.path().string());
      writer.add_scalar("flushed", 1.0, 1);
      writer.flush();
      writer.add_scalar("queued", 2.0, 2);
      ::raise(SIGKILL);
    } catch (...) {
    }
    ::_exit(1);
  }
  int wait_status = 0;
  ASSERT_EQ(::waitpid(child, &wait_status, 0), child);
  ASSERT_TRUE(WIFSIGNALED(wait_status) && WTERMSIG(wait_status) == SIGKILL);
  const fs::directory_iterator file(dir.path());
  ASSERT_NE(file, fs::directory_iterator());
  const std::vector<Scalar> read = scalars_in(file->path().string());
  ASSERT_EQ(read.size(), 1u);
  EXPECT_EQ(read[0].tag, "flushed");
}

TEST(UtilTensorBoardWriter, MovedWriterKeepsItsFileAndQueue) {
  const test::TempDir dir("tensorboard");
  TensorBoardWriter first(dir.path().string());
  first.add_scalar("loss", 1.0, 1);
  TensorBoardWriter moved(std::move(first));
  moved.add_scalar("loss", 2.0, 2);
  TensorBoardWriter other(dir.path().string());
  const std::string first_path = moved.path();
  const std::string other_path = other.path();
  other.add_scalar("other", 3.0, 3);
  other = std::move(moved);  // `other`'s own file gets its queued scalar first
  EXPECT_EQ(scalars_in(other_path).size(), 1u);
  EXPECT_EQ(other.path(), first_path);
  other.flush();
  EXPECT_EQ(scalars_in(first_path).size(), 2u);
}

TEST(UtilTensorBoardWriter, FileNamesCarryTimeHostPidAndACounter) {
  const test::TempDir dir("tensorboard");
  const double before = now_seconds();
  const TensorBoardWriter first(dir.path().string());
  const TensorBoardWriter second(dir.path().string());
  ASSERT_NE(first.path(), second.path());
  EXPECT_EQ(fs::path(first.path()).parent_path(), dir.path());

  std::array<char, 256> host{};
  ASSERT_EQ(::gethostname(host.data(), host.size() - 1), 0);
  const auto counter_of = [&](const std::string& path) {
    const std::string name = fs::path(path).filename().string();
    const std::string prefix = "events.out.tfevents.";
    EXPECT_EQ(name.rfind(prefix, 0), 0u) << name;
    size_t end = 0;
    const int64_t seconds = std::stoll(name.substr(prefix.size()), &end);
    EXPECT_GE(seconds, static_cast<int64_t>(before));
    EXPECT_LE(seconds, static_cast<int64_t>(now_seconds()));
    const std::string rest = name.substr(prefix.size() + end);
    const std::string host_and_pid = "." + std::string(host.data()) + "." + std::to_string(::getpid()) + ".";
    EXPECT_EQ(rest.rfind(host_and_pid, 0), 0u) << name;
    return std::stoll(rest.substr(host_and_pid.size()));
  };
  EXPECT_EQ(counter_of(second.path()), counter_of(first.path()) + 1);
}

TEST(UtilTensorBoardWriter, UnmakeableDirectoryAndBadQueueSizeThrow) {
  const test::TempDir dir("tensorboard");
  overwrite(dir.path("plain"), "a file, not a folder");
  const std::string under_file = dir.path("plain") + "/runs";
  test::expect_error_containing<std::runtime_error>([&] { TensorBoardWriter writer(under_file); }, under_file);
  test::expect_error_containing<std::invalid_argument>([&] { TensorBoardWriter writer(dir.path("ok"), 0); },
                                                       "max_queue");
}

// scripts/read_tfevents.py run on `target`: its exit status, stdout and stderr.
struct DecoderRun {
  int status = -1;
  std::string out;
  std::string err;
};

std::optional<DecoderRun> run_decoder(const std::string& target, const std::string& err_path) {
  const fs::path script = test::source_dir() / "scripts" / "read_tfevents.py";
  if (!fs::exists(script) || ::access("/usr/bin/python3", X_OK) != 0) return std::nullopt;
  const std::string command = "/usr/bin/python3 '" + script.string() + "' '" + target + "' --json 2>'" + err_path + "'";
  FILE* pipe = ::popen(command.c_str(), "r");
  if (pipe == nullptr) return std::nullopt;
  DecoderRun run;
  std::array<char, 4096> chunk{};
  size_t n = 0;
  while ((n = std::fread(chunk.data(), 1, chunk.size(), pipe)) > 0) run.out.append(chunk.data(), n);
  const int wait_status = ::pclose(pipe);
  run.status = WIFEXITED(wait_status) ? WEXITSTATUS(wait_status) : -1;
  run.err = contents(err_path);
  return run;
}

std::vector<nlohmann::json> json_lines(const std::string& text) {
  std::vector<nlohmann::json> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    // Python's json writes NaN, which nlohmann::json does not read: stand null in for it.
    if (const size_t nan = line.find(": NaN"); nan != std::string::npos) line.replace(nan, 5, ": null");
    lines.push_back(nlohmann::json::parse(line));
  }
  return lines;
}

TEST(UtilTensorBoardDecoder, ReadsWhatTheWriterWrote) {
  const test::TempDir dir("tensorboard");
  const std::vector<std::pair<std::string, double>> written = {
      {"loss", 0.1}, {"lr", -3.5}, {"big", 1e30}, {"grad/norm", std::numeric_limits<double>::quiet_NaN()}};
  std::string path;
  {
    TensorBoardWriter writer(dir.path("run"));
    path = writer.path();
    for (size_t i = 0; i < written.size(); ++i) {
      writer.add_scalar(written[i].first, written[i].second, static_cast<int64_t>(i) - 1, 1700000000.0 + i);
    }
  }
  const std::optional<DecoderRun> run = run_decoder(dir.path("run"), dir.path("stderr.txt"));
  if (!run) GTEST_SKIP() << "needs /usr/bin/python3 and scripts/read_tfevents.py in the source folder";
  ASSERT_EQ(run->status, 0) << run->err;
  const std::vector<nlohmann::json> lines = json_lines(run->out);
  ASSERT_EQ(lines.size(), written.size() + 1) << run->out;
  EXPECT_EQ(lines[0]["file_version"], "brain.Event:2");
  for (size_t i = 0; i < written.size(); ++i) {
    const nlohmann::json& line = lines[i + 1];
    EXPECT_EQ(line["tag"], written[i].first);
    EXPECT_EQ(line["step"].dump(), std::to_string(static_cast<int64_t>(i) - 1))
        << "a negative step is not read as unsigned";
    EXPECT_EQ(line["wall_time"].get<double>(), 1700000000.0 + i);
    if (std::isnan(written[i].second)) {
      EXPECT_TRUE(line["value"].is_null()) << line;
    } else {
      EXPECT_EQ(line["value"].get<double>(), static_cast<double>(static_cast<float>(written[i].second))) << line;
    }
  }
}

TEST(UtilTensorBoardDecoder, RejectsCorruptRecordsAndSkipsATruncatedLastOne) {
  const test::TempDir dir("tensorboard");
  std::string path;
  {
    TensorBoardWriter writer(dir.path().string());
    path = writer.path();
    for (int step = 1; step <= 3; ++step) writer.add_scalar("loss", step * 0.5, step, 1700000000.0 + step);
  }
  const std::string good = contents(path);
  const size_t record_size = (good.size() - kHeaderRecordSize) / 3;
  const std::string err_path = dir.path("stderr.txt");
  const std::optional<DecoderRun> clean = run_decoder(path, err_path);
  if (!clean) GTEST_SKIP() << "needs /usr/bin/python3 and scripts/read_tfevents.py in the source folder";
  ASSERT_EQ(clean->status, 0) << clean->err;
  EXPECT_EQ(json_lines(clean->out).size(), 4u);

  // A letter of record 2's tag (its data ends with the tag, 15, the float and the CRC), then a byte of its length.
  const size_t record_2 = kHeaderRecordSize + record_size;
  for (const size_t offset : {record_2 + record_size - 10, record_2 + 1}) {
    std::string corrupt = good;
    corrupt[offset] = static_cast<char>(corrupt[offset] ^ 0x20);
    overwrite(path, corrupt);
    const DecoderRun run = run_decoder(path, err_path).value();
    EXPECT_NE(run.status, 0) << "offset " << offset;
    EXPECT_NE(run.err.find(path), std::string::npos) << run.err;
    EXPECT_NE(run.err.find("record 2"), std::string::npos) << run.err;
  }

  // A writer killed mid-record: cut inside the last record's framing header, and inside its data.
  for (const size_t cut : {good.size() - record_size + 5, good.size() - 9}) {
    overwrite(path, good.substr(0, cut));
    const DecoderRun run = run_decoder(path, err_path).value();
    EXPECT_EQ(run.status, 0) << run.err;
    EXPECT_NE(run.err.find("warning"), std::string::npos) << run.err;
    const std::vector<nlohmann::json> lines = json_lines(run.out);
    ASSERT_EQ(lines.size(), 3u) << run.out;
    EXPECT_EQ(lines[2]["step"], 2);
    EXPECT_EQ(lines[2]["value"], 1.0);
  }
}

}  // namespace
}  // namespace moecore
