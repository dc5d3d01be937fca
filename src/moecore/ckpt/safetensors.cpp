#include "moecore/ckpt/safetensors.h"

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <stdexcept>

#include "moecore/util/atomic_file.h"
#include "moecore/util/checked_math.h"

namespace moecore {
namespace {

using json = nlohmann::json;

// The reference implementation refuses headers above 100 MB; so do we (a corrupt length must not allocate 2^63 bytes).
constexpr uint64_t kMaxHeaderBytes = 100'000'000;

[[noreturn]] void fail(const std::string& source, const std::string& problem) {
  throw std::runtime_error(source + ": " + problem);
}

bool dtype_from_code(const std::string& code, DType& dtype) {
  static const std::map<std::string, DType> kCodes = {
      {"F32", DType::kF32}, {"F64", DType::kF64}, {"BF16", DType::kBF16}, {"F16", DType::kF16},
      {"I32", DType::kI32}, {"I64", DType::kI64}, {"U8", DType::kU8}};
  const auto it = kCodes.find(code);
  if (it == kCodes.end()) return false;
  dtype = it->second;
  return true;
}

uint64_t read_u64_le(const std::byte* p) {
  uint64_t value = 0;
  for (int i = 7; i >= 0; --i) value = (value << 8) | static_cast<uint64_t>(p[i]);
  return value;
}

void append_u64_le(std::vector<std::byte>& out, uint64_t value) {
  for (int i = 0; i < 8; ++i) {
    out.push_back(static_cast<std::byte>(value & 0xffu));
    value >>= 8;
  }
}

struct Entry {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  uint64_t begin, end;
};

Entry parse_entry(const std::string& source, const std::string& name, const json& value) {
  const std::string where = "tensor '" + name + "'";
  if (!value.is_object()) fail(source, where + " header entry is not a JSON object");
  for (const auto& [key, unused] : value.items()) {
    if (key != "dtype" && key != "shape" && key != "data_offsets")
      fail(source, where + " has unknown field '" + key + "'");
  }
  if (!value.contains("dtype") || !value["dtype"].is_string()) fail(source, where + " has no string 'dtype'");
  if (!value.contains("shape") || !value["shape"].is_array()) fail(source, where + " has no 'shape' array");
  if (!value.contains("data_offsets") || !value["data_offsets"].is_array()) {
    fail(source, where + " has no 'data_offsets' array");
  }
  Entry entry{name, DType::kF32, {}, 0, 0};
  const std::string code = value["dtype"].get<std::string>();
  if (!dtype_from_code(code, entry.dtype)) {
    fail(source, where + " has unsupported dtype '" + code + "' (supported: F32, F64, BF16, F16, I32, I64, U8)");
  }
  for (const json& dim : value["shape"]) {
    if (!dim.is_number_unsigned() || dim.get<uint64_t>() > static_cast<uint64_t>(INT64_MAX)) {
      fail(source, where + " shape " + value["shape"].dump() + " is not non-negative integers within 64 bits");
    }
    entry.shape.push_back(dim.get<int64_t>());
  }
  int64_t expected_bytes = static_cast<int64_t>(dtype_size(entry.dtype));
  try {
    for (const int64_t d : entry.shape) expected_bytes = checked_mul(expected_bytes, d, where + " byte count");
  } catch (const std::overflow_error& e) {
    fail(source, where + " shape " + value["shape"].dump() + " of " + code + " is too large: " + e.what());
  }
  const json& offsets = value["data_offsets"];
  if (offsets.size() != 2 || !offsets[0].is_number_unsigned() || !offsets[1].is_number_unsigned()) {
    fail(source, where + " data_offsets " + offsets.dump() + " is not two non-negative integers");
  }
  entry.begin = offsets[0].get<uint64_t>();
  entry.end = offsets[1].get<uint64_t>();
  if (entry.end < entry.begin) fail(source, where + " data_offsets " + offsets.dump() + " end before begin");
  if (static_cast<uint64_t>(expected_bytes) != entry.end - entry.begin) {
    fail(source, where + " shape " + value["shape"].dump() + " of " + code + " needs " +
                     std::to_string(expected_bytes) + " bytes but data_offsets " + offsets.dump() + " span " +
                     std::to_string(entry.end - entry.begin));
  }
  return entry;
}

}  // namespace

bool SafetensorsFile::contains(const std::string& name) const {
  return std::any_of(tensors.begin(), tensors.end(), [&](const NamedTensor& t) { return t.first == name; });
}

const Tensor& SafetensorsFile::at(const std::string& name) const {
  for (const auto& [tensor_name, tensor] : tensors) {
    if (tensor_name == name) return tensor;
  }
  throw std::runtime_error(source + ": no tensor named '" + name + "'");
}

std::string safetensors_dtype_code(const DType dtype) {
  switch (dtype) {
    case DType::kF32: return "F32";
    case DType::kF64: return "F64";
    case DType::kBF16: return "BF16";
    case DType::kF16: return "F16";
    case DType::kI32: return "I32";
    case DType::kI64: return "I64";
    case DType::kU8: return "U8";
  }
  throw std::invalid_argument("safetensors: unknown dtype");
}

namespace {

// Validates the header against a byte buffer of `buffer_bytes`; returns the tensors in buffer order (and metadata).
std::vector<Entry> parse_header(const std::string_view header_text, const uint64_t buffer_bytes,
                                const std::string& source, SafetensorsMetadata& metadata) {
  // Duplicate names are invalid; nlohmann would silently keep the last, so watch the top-level keys.
  std::set<std::string> seen_keys;
  std::string duplicate;
  const json::parser_callback_t watch_keys = [&](int depth, json::parse_event_t event, json& parsed) {
    if (event == json::parse_event_t::key && depth == 1 && parsed.is_string()) {
      if (!seen_keys.insert(parsed.get<std::string>()).second && duplicate.empty()) {
        duplicate = parsed.get<std::string>();
      }
    }
    return true;
  };
  json header;
  try {
    header = json::parse(header_text, watch_keys);
  } catch (const json::parse_error& e) {
    fail(source, "header is not valid JSON (error at byte " + std::to_string(e.byte) + ")");
  } catch (const json::exception&) {  // 1e999: a number beyond a double
    fail(source, "header is not valid JSON (a number out of range)");
  }
  if (!header.is_object()) fail(source, "header is not a JSON object");
  if (!duplicate.empty()) fail(source, "header names tensor '" + duplicate + "' twice");

  std::vector<Entry> entries;
  for (const auto& [key, value] : header.items()) {
    if (key == "__metadata__") {
      if (!value.is_object()) fail(source, "__metadata__ is not a JSON object");
      for (const auto& [meta_key, meta_value] : value.items()) {
        if (!meta_value.is_string()) fail(source, "__metadata__ value for '" + meta_key + "' is not a string");
        metadata[meta_key] = meta_value.get<std::string>();
      }
      continue;
    }
    entries.push_back(parse_entry(source, key, value));
  }

  std::sort(entries.begin(), entries.end(),
            [](const Entry& a, const Entry& b) { return a.begin != b.begin ? a.begin < b.begin : a.end < b.end; });
  uint64_t expected_begin = 0;
  for (size_t i = 0; i < entries.size(); ++i) {
    const Entry& e = entries[i];
    if (e.end > buffer_bytes) {
      fail(source, "tensor '" + e.name + "' data_offsets [" + std::to_string(e.begin) + ", " + std::to_string(e.end) +
                       "] run past the byte buffer (" + std::to_string(buffer_bytes) + " bytes)");
    }
    if (e.begin < expected_begin) {
      fail(source, "tensor '" + e.name + "' bytes overlap tensor '" + entries[i - 1].name + "'");
    }
    if (e.begin > expected_begin) {
      fail(source, "byte buffer has a gap of " + std::to_string(e.begin - expected_begin) + " bytes before tensor '" +
                       e.name + "'");
    }
    expected_begin = e.end;
  }
  if (expected_begin != buffer_bytes) {
    fail(source, "byte buffer has " + std::to_string(buffer_bytes - expected_begin) +
                     " trailing bytes not covered by any tensor");
  }
  return entries;
}

uint64_t checked_header_length(const std::byte* first8, const uint64_t file_bytes, const std::string& source) {
  if (file_bytes < 8) {
    fail(source, "file has " + std::to_string(file_bytes) + " bytes, too short for the 8-byte header length");
  }
  const uint64_t header_bytes = read_u64_le(first8);
  if (header_bytes > file_bytes - 8) {
    fail(source, "header length " + std::to_string(header_bytes) + " runs past the end of the file (" +
                     std::to_string(file_bytes) + " bytes)");
  }
  if (header_bytes > kMaxHeaderBytes) fail(source, "header length " + std::to_string(header_bytes) + " exceeds 100 MB");
  return header_bytes;
}

}  // namespace

SafetensorsFile parse_safetensors(const std::span<const std::byte> bytes, const std::string& source) {
  const uint64_t header_bytes = checked_header_length(bytes.data(), bytes.size(), source);
  SafetensorsFile file;
  file.source = source;
  const std::string_view header_text(reinterpret_cast<const char*>(bytes.data() + 8), header_bytes);
  const std::vector<Entry> entries = parse_header(header_text, bytes.size() - 8 - header_bytes, source, file.metadata);
  const std::byte* buffer = bytes.data() + 8 + header_bytes;
  for (const Entry& e : entries) {
    Tensor tensor(e.shape, e.dtype);
    if (e.end > e.begin) std::memcpy(tensor.data<std::byte>(), buffer + e.begin, e.end - e.begin);
    file.tensors.emplace_back(e.name, std::move(tensor));
  }
  return file;
}

const SafetensorsTensorInfo* SafetensorsHeader::find(const std::string& name) const {
  for (const SafetensorsTensorInfo& info : tensors) {
    if (info.name == name) return &info;
  }
  return nullptr;
}

SafetensorsHeader read_safetensors_header(const std::string& path) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec)) fail(path, "no such file (or not a regular file)");
  const uint64_t file_bytes = std::filesystem::file_size(path, ec);
  if (ec) fail(path, "cannot determine the file size: " + ec.message());
  std::ifstream in(path, std::ios::binary);
  if (!in) fail(path, std::string("cannot open: ") + std::strerror(errno));
  std::array<std::byte, 8> first8{};
  if (file_bytes >= 8 && !in.read(reinterpret_cast<char*>(first8.data()), 8)) fail(path, "read failed");
  const uint64_t header_bytes = checked_header_length(first8.data(), file_bytes, path);
  std::string header_text(header_bytes, '\0');
  if (header_bytes > 0 && !in.read(header_text.data(), static_cast<std::streamsize>(header_bytes))) {
    fail(path, "read of the header failed");
  }
  SafetensorsHeader header;
  header.path = path;
  header.data_start = 8 + header_bytes;
  for (const Entry& e : parse_header(header_text, file_bytes - 8 - header_bytes, path, header.metadata)) {
    header.tensors.push_back(
        SafetensorsTensorInfo{e.name, e.dtype, e.shape, 8 + header_bytes + e.begin, e.end - e.begin});
  }
  return header;
}

// Reads each tensor's bytes straight into its storage (no copy of the whole file in memory).
SafetensorsFile read_safetensors(const std::string& path) {
  const SafetensorsHeader header = read_safetensors_header(path);
  std::ifstream in(path, std::ios::binary);
  if (!in) fail(path, std::string("cannot open: ") + std::strerror(errno));
  SafetensorsFile file;
  file.source = path;
  file.metadata = header.metadata;
  for (const SafetensorsTensorInfo& info : header.tensors) {
    Tensor tensor(info.shape, info.dtype);
    if (info.nbytes > 0 &&
        (!in.seekg(static_cast<std::streamoff>(info.file_offset)) ||
         !in.read(reinterpret_cast<char*>(tensor.data<std::byte>()), static_cast<std::streamsize>(info.nbytes)))) {
      fail(path, "read of tensor '" + info.name + "' failed");
    }
    file.tensors.emplace_back(info.name, std::move(tensor));
  }
  return file;
}

Tensor read_safetensors_tensor(const SafetensorsHeader& header, const SafetensorsTensorInfo& info) {
  Tensor tensor(info.shape, info.dtype);
  if (info.nbytes == 0) return tensor;
  std::ifstream in(header.path, std::ios::binary);
  if (!in) fail(header.path, std::string("cannot open: ") + std::strerror(errno));
  if (!in.seekg(static_cast<std::streamoff>(info.file_offset)) ||
      !in.read(reinterpret_cast<char*>(tensor.data<std::byte>()), static_cast<std::streamsize>(info.nbytes))) {
    fail(header.path, "read of tensor '" + info.name + "' failed");
  }
  return tensor;
}

std::vector<std::byte> encode_safetensors_header(const std::vector<NamedTensor>& tensors,
                                                 const SafetensorsMetadata& metadata) {
  json header = json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t offset = 0;
  for (const auto& [name, tensor] : tensors) {
    if (name == "__metadata__") throw std::invalid_argument("safetensors: a tensor may not be named __metadata__");
    if (header.contains(name)) throw std::invalid_argument("safetensors: tensor '" + name + "' given twice");
    if (!tensor.defined()) throw std::invalid_argument("safetensors: tensor '" + name + "' is undefined");
    const uint64_t n = tensor.nbytes();
    header[name] = {{"dtype", safetensors_dtype_code(tensor.dtype())},
                    {"shape", tensor.shape()},
                    {"data_offsets", {offset, offset + n}}};
    offset += n;
  }
  std::string header_text = header.dump();
  header_text.append((8 - header_text.size() % 8) % 8, ' ');  // the byte buffer starts 8-byte aligned
  std::vector<std::byte> out;
  out.reserve(8 + header_text.size());
  append_u64_le(out, header_text.size());
  for (const char c : header_text) out.push_back(static_cast<std::byte>(c));
  return out;
}

std::vector<std::byte> encode_safetensors(const std::vector<NamedTensor>& tensors,
                                          const SafetensorsMetadata& metadata) {
  std::vector<std::byte> out = encode_safetensors_header(tensors, metadata);
  for (const auto& [name, tensor] : tensors) {
    const std::byte* data = tensor.data<std::byte>();
    out.insert(out.end(), data, data + tensor.nbytes());
  }
  return out;
}

void write_file_atomically(const std::string& path, const std::span<const std::byte> bytes) {
  if (const std::string problem =
          replace_file(path, std::string_view(reinterpret_cast<const char*>(bytes.data()), bytes.size()));
      !problem.empty()) {
    fail(path, problem);
  }
}

void write_safetensors(const std::string& path, const std::vector<NamedTensor>& tensors,
                       const SafetensorsMetadata& metadata) {
  write_file_atomically(path, encode_safetensors(tensors, metadata));
}

Tensor to_float32(const Tensor& tensor, const MemCategory category) {
  Tensor out(tensor.shape(), DType::kF32, category);
  float* dst = out.data<float>();
  const auto n = static_cast<size_t>(tensor.numel());
  switch (tensor.dtype()) {
    case DType::kF32: std::memcpy(dst, tensor.data<float>(), n * sizeof(float)); break;
    case DType::kF64:
      for (size_t i = 0; i < n; ++i) dst[i] = static_cast<float>(tensor.data<double>()[i]);
      break;
    case DType::kBF16:
      for (size_t i = 0; i < n; ++i) dst[i] = bf16_to_fp32(tensor.data<uint16_t>()[i]);
      break;
    case DType::kF16:
      for (size_t i = 0; i < n; ++i) dst[i] = fp16_to_fp32(tensor.data<uint16_t>()[i]);
      break;
    default:
      throw std::runtime_error("cannot convert a " + std::string(dtype_name(tensor.dtype())) +
                               " tensor to float32 (floating-point weights expected)");
  }
  return out;
}

}  // namespace moecore
