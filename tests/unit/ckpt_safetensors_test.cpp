// safetensors reader/writer: round trips of every dtype, byte-level checks against files built by hand from the
// format's specification, and corrupt files that must fail with one clear line naming the file and the problem.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "moecore/ckpt/safetensors.h"

namespace moecore {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

class SafetensorsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("moecore_st_test_" + std::to_string(::getpid()));
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string path(const std::string& name) const { return (dir_ / name).string(); }

  void write_raw(const std::string& file, const std::vector<std::byte>& bytes) const {
    std::ofstream out(file, std::ios::binary);
    out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  }

  fs::path dir_;
};

// A file assembled by hand: 8-byte little-endian length, the header text exactly as given, then `data`.
std::vector<std::byte> hand_built(const std::string& header, const std::vector<uint8_t>& data) {
  std::vector<std::byte> out;
  uint64_t n = header.size();
  for (int i = 0; i < 8; ++i, n >>= 8) out.push_back(static_cast<std::byte>(n & 0xff));
  for (const char c : header) out.push_back(static_cast<std::byte>(c));
  for (const uint8_t b : data) out.push_back(static_cast<std::byte>(b));
  return out;
}

// Fills a tensor's bytes with random bits (every byte pattern is a valid integer; floats may be NaN, which a
// byte-exact comparison handles).
Tensor random_tensor(std::vector<int64_t> shape, DType dtype, uint64_t seed) {
  Tensor t(std::move(shape), dtype);
  std::mt19937_64 gen(seed);
  auto* bytes = t.data<uint8_t>();
  for (size_t i = 0; i < t.nbytes(); ++i) bytes[i] = static_cast<uint8_t>(gen() & 0xff);
  return t;
}

TEST_F(SafetensorsTest, RoundTripsEveryDtypeShapeAndMetadata) {
  std::vector<NamedTensor> tensors = {
      {"f32.matrix", random_tensor({3, 5}, DType::kF32, 1)},
      {"f64", random_tensor({7}, DType::kF64, 2)},
      {"bf16", random_tensor({2, 3, 4}, DType::kBF16, 3)},
      {"f16", random_tensor({5, 1}, DType::kF16, 4)},
      {"i32", random_tensor({4}, DType::kI32, 5)},
      {"i64", random_tensor({2, 2}, DType::kI64, 6)},
      {"u8", random_tensor({9}, DType::kU8, 7)},
      {"scalar", random_tensor({}, DType::kF32, 8)},
      {"empty", random_tensor({0, 3}, DType::kF32, 9)},
  };
  const SafetensorsMetadata metadata = {{"format", "pt"}, {"note", "quotes \" and unicode \xc3\xa9"}};
  const std::string file = path("all.safetensors");
  write_safetensors(file, tensors, metadata);

  const SafetensorsFile loaded = read_safetensors(file);
  EXPECT_EQ(loaded.metadata, metadata);
  ASSERT_EQ(loaded.tensors.size(), tensors.size());
  for (const auto& [name, original] : tensors) {
    SCOPED_TRACE(name);
    ASSERT_TRUE(loaded.contains(name));
    const Tensor& t = loaded.at(name);
    EXPECT_EQ(t.dtype(), original.dtype());
    EXPECT_EQ(t.shape(), original.shape());
    ASSERT_EQ(t.nbytes(), original.nbytes());
    EXPECT_EQ(std::memcmp(t.data<std::byte>(), original.data<std::byte>(), t.nbytes()), 0);
  }
  // Written in the given order, so the byte buffer keeps that order.
  for (size_t i = 0; i < tensors.size(); ++i) EXPECT_EQ(loaded.tensors[i].first, tensors[i].first);
}

TEST_F(SafetensorsTest, WriterBytesFollowTheSpecification) {
  Tensor a({2}, DType::kF32);
  a.data<float>()[0] = 1.0f;   // IEEE-754 single: 0x3F800000, little-endian 00 00 80 3F
  a.data<float>()[1] = -2.0f;  // 0xC0000000 -> 00 00 00 C0
  Tensor b({1, 1}, DType::kI64);
  b.data<int64_t>()[0] = 0x0102030405060708;  // -> 08 07 06 05 04 03 02 01
  const std::vector<std::byte> bytes = encode_safetensors({{"a", a}, {"b", b}}, {{"k", "v"}});

  ASSERT_GE(bytes.size(), 8u);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<uint8_t>(bytes[static_cast<size_t>(i)]);
  EXPECT_EQ(n % 8, 0u) << "header is padded so the byte buffer starts 8-byte aligned";
  ASSERT_EQ(bytes.size(), 8 + n + 16);
  const std::string header(reinterpret_cast<const char*>(bytes.data() + 8), n);
  EXPECT_EQ(header.front(), '{');
  const json expected = {
      {"__metadata__", {{"k", "v"}}},
      {"a", {{"dtype", "F32"}, {"shape", {2}}, {"data_offsets", {0, 8}}}},
      {"b", {{"dtype", "I64"}, {"shape", {1, 1}}, {"data_offsets", {8, 16}}}},
  };
  EXPECT_EQ(json::parse(header), expected);  // trailing padding must be spaces (valid JSON whitespace)
  const std::vector<uint8_t> expected_data = {0x00, 0x00, 0x80, 0x3F, 0x00, 0x00, 0x00, 0xC0,
                                              0x08, 0x07, 0x06, 0x05, 0x04, 0x03, 0x02, 0x01};
  for (size_t i = 0; i < expected_data.size(); ++i) {
    EXPECT_EQ(static_cast<uint8_t>(bytes[8 + n + i]), expected_data[i]) << "data byte " << i;
  }
}

TEST_F(SafetensorsTest, ReadsAHandBuiltFile) {
  // Tensors listed out of buffer order, keys in an unusual order, padding spaces after the JSON.
  const std::string header =
      R"({"w":{"shape":[2],"data_offsets":[4,8],"dtype":"BF16"},)"
      R"("__metadata__":{"format":"pt"},"x":{"dtype":"I32","data_offsets":[0,4],"shape":[]}}   )";
  // x = int32 -7 (F9 FF FF FF); w = bf16 [1.0 (0x3F80), -0.5 (0xBF00)].
  const std::string file = path("hand.safetensors");
  write_raw(file, hand_built(header, {0xF9, 0xFF, 0xFF, 0xFF, 0x80, 0x3F, 0x00, 0xBF}));
  const SafetensorsFile loaded = read_safetensors(file);
  EXPECT_EQ(loaded.metadata.at("format"), "pt");
  ASSERT_EQ(loaded.tensors.size(), 2u);
  EXPECT_EQ(loaded.tensors[0].first, "x");
  EXPECT_EQ(loaded.at("x").dtype(), DType::kI32);
  EXPECT_TRUE(loaded.at("x").shape().empty());
  EXPECT_EQ(loaded.at("x").data<int32_t>()[0], -7);
  const Tensor w = to_float32(loaded.at("w"));
  EXPECT_EQ(w.shape(), std::vector<int64_t>({2}));
  EXPECT_EQ(w.data<float>()[0], 1.0f);
  EXPECT_EQ(w.data<float>()[1], -0.5f);
}

TEST_F(SafetensorsTest, ToFloat32ConvertsHalfTypesExactly) {
  Tensor f16({3}, DType::kF16);
  const uint16_t f16_bits[] = {0x3C00, 0xC500, 0x3555};  // 1.0, -5.0, 0.333251953125
  std::memcpy(f16.data<uint16_t>(), f16_bits, sizeof(f16_bits));
  const Tensor out = to_float32(f16);
  EXPECT_EQ(out.data<float>()[0], 1.0f);
  EXPECT_EQ(out.data<float>()[1], -5.0f);
  EXPECT_EQ(out.data<float>()[2], 0.333251953125f);
  Tensor f64({1}, DType::kF64);
  f64.data<double>()[0] = 0.1;
  EXPECT_EQ(to_float32(f64).data<float>()[0], 0.1f);
  EXPECT_THROW(to_float32(Tensor({1}, DType::kI32)), std::runtime_error);
}

TEST_F(SafetensorsTest, AtomicWriteReplacesTheFileAndLeavesNoTemporaries) {
  const std::string file = path("w.safetensors");
  write_safetensors(file, {{"a", random_tensor({4}, DType::kF32, 11)}});
  const Tensor second = random_tensor({6}, DType::kF64, 12);
  write_safetensors(file, {{"b", second}});
  const SafetensorsFile loaded = read_safetensors(file);
  ASSERT_EQ(loaded.tensors.size(), 1u);
  EXPECT_EQ(loaded.tensors[0].first, "b");
  EXPECT_EQ(std::memcmp(loaded.at("b").data<std::byte>(), second.data<std::byte>(), second.nbytes()), 0);
  int entries = 0;
  for ([[maybe_unused]] const auto& e : fs::directory_iterator(dir_)) ++entries;
  EXPECT_EQ(entries, 1);
  // A folder that does not exist: a clear error, nothing written.
  EXPECT_THROW(write_safetensors(path("missing/x.safetensors"), {{"a", second}}), std::runtime_error);
}

TEST_F(SafetensorsTest, WriterRejectsBadNames) {
  const Tensor t = random_tensor({1}, DType::kF32, 13);
  EXPECT_THROW(encode_safetensors({{"a", t}, {"a", t}}), std::invalid_argument);
  EXPECT_THROW(encode_safetensors({{"__metadata__", t}}), std::invalid_argument);
}

struct CorruptCase {
  std::string label;
  std::vector<std::byte> bytes;
  std::string expected_phrase;
};

TEST_F(SafetensorsTest, CorruptFilesFailWithOneClearLine) {
  const std::vector<uint8_t> eight = {0, 0, 128, 63, 0, 0, 0, 192};
  std::vector<std::byte> huge_length = hand_built("{}", {});
  huge_length[0] = std::byte{0xff};
  huge_length[5] = std::byte{0x7f};
  const std::vector<CorruptCase> cases = {
      {"short", {std::byte{1}, std::byte{0}}, "too short"},
      {"length past end", huge_length, "runs past the end of the file"},
      {"bad json", hand_built(R"({"a": {"dtype": "F32", )", eight), "not valid JSON"},
      {"not an object", hand_built("[1, 2]", {}), "not a JSON object"},
      {"offsets out of range", hand_built(R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", eight),
       "run past the byte buffer"},
      {"overlap",
       hand_built(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                  R"("b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
                  eight),
       "overlap"},
      {"gap", hand_built(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", eight), "gap"},
      {"trailing bytes", hand_built(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", eight),
       "trailing bytes"},
      {"shape vs bytes", hand_built(R"({"a":{"dtype":"F64","shape":[2],"data_offsets":[0,8]}})", eight),
       "needs 16 bytes"},
      {"unknown dtype", hand_built(R"({"a":{"dtype":"F7","shape":[2],"data_offsets":[0,8]}})", eight),
       "unsupported dtype 'F7'"},
      {"negative dim", hand_built(R"({"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", eight),
       "not non-negative integers"},
      {"end before begin", hand_built(R"({"a":{"dtype":"U8","shape":[0],"data_offsets":[8,0]}})", eight),
       "end before begin"},
      {"missing offsets", hand_built(R"({"a":{"dtype":"F32","shape":[2]}})", eight), "no 'data_offsets'"},
      {"duplicate",
       hand_built(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                  R"("a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
                  eight),
       "twice"},
      {"metadata value", hand_built(R"({"__metadata__":{"k":3}})", {}), "not a string"},
      {"overflowing shape",
       hand_built(R"({"a":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,8]}})", eight), "overflows"},
      // 2^62 elements of 4 bytes: the byte count wrapped to 0 ("needs 0 bytes")
      {"byte count wraps",
       hand_built(R"({"a":{"dtype":"F32","shape":[2147483648,2147483648],"data_offsets":[0,0]}})", {}),
       "is too large: tensor 'a' byte count overflows 64-bit integers"},
      // 2^63 elements: beyond int64 (a Tensor of that shape cannot exist)
      {"elements beyond int64",
       hand_built(R"({"a":{"dtype":"U8","shape":[4294967296,2147483648],"data_offsets":[0,9223372036854775808]}})", {}),
       "is too large"},
  };
  for (const CorruptCase& c : cases) {
    SCOPED_TRACE(c.label);
    const std::string file = path("corrupt.safetensors");
    write_raw(file, c.bytes);
    try {
      read_safetensors(file);
      ADD_FAILURE() << "no error for " << c.label;
    } catch (const std::runtime_error& e) {
      const std::string message = e.what();
      EXPECT_NE(message.find(file), std::string::npos) << message;
      EXPECT_NE(message.find(c.expected_phrase), std::string::npos) << message;
      EXPECT_EQ(message.find('\n'), std::string::npos) << message;
    }
    // The in-memory parser applies the same checks.
    try {
      parse_safetensors(c.bytes, "in-memory");
      ADD_FAILURE() << "no in-memory error for " << c.label;
    } catch (const std::runtime_error& e) {
      EXPECT_NE(std::string(e.what()).find("in-memory: "), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(c.expected_phrase), std::string::npos) << e.what();
    }
  }
  EXPECT_THROW(read_safetensors(path("does_not_exist.safetensors")), std::runtime_error);
}

}  // namespace
}  // namespace moecore
