#include "moecore/data/npy.h"

#include <bit>
#include <cstring>
#include <limits>
#include <utility>

#include "moecore/data/file_bytes.h"
#include "moecore/data/indexed_dataset.h"
#include "moecore/util/checked_math.h"

namespace moecore {

static_assert(std::endian::native == std::endian::little, ".npy arrays are read and written little-endian");

namespace {

constexpr char kMagic[6] = {'\x93', 'N', 'U', 'M', 'P', 'Y'};
constexpr size_t kAlign = 64;         // numpy's ARRAY_ALIGN
constexpr size_t kGrowthDigits = 21;  // numpy's GROWTH_AXIS_MAX_DIGITS: room to grow axis 0 in place

struct DTypeInfo {
  NpyDType dtype;
  const char* descr;
  size_t bytes;
  int64_t min;
  int64_t max;
};

constexpr DTypeInfo kDTypes[] = {
    {NpyDType::kI2, "<i2", 2, std::numeric_limits<int16_t>::min(), std::numeric_limits<int16_t>::max()},
    {NpyDType::kI4, "<i4", 4, std::numeric_limits<int32_t>::min(), std::numeric_limits<int32_t>::max()},
    {NpyDType::kI8, "<i8", 8, std::numeric_limits<int64_t>::min(), std::numeric_limits<int64_t>::max()},
    {NpyDType::kU2, "<u2", 2, 0, std::numeric_limits<uint16_t>::max()},
    {NpyDType::kU4, "<u4", 4, 0, std::numeric_limits<uint32_t>::max()},
};

const DTypeInfo& info(NpyDType dtype) {
  for (const DTypeInfo& entry : kDTypes) {
    if (entry.dtype == dtype) return entry;
  }
  return kDTypes[2];
}

int64_t element_count(const std::vector<int64_t>& shape) {
  int64_t count = 1;
  for (const int64_t dim : shape) count = checked_mul(count, dim, "npy element count");
  return count;
}

// Python's repr of a shape tuple: "()", "(3,)", "(3, 2)".
std::string shape_repr(const std::vector<int64_t>& shape) {
  std::string text = "(";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i > 0) text += ", ";
    text += std::to_string(shape[i]);
  }
  if (shape.size() == 1) text += ",";
  return text + ")";
}

// Value of `key` in the header dict text, up to the next top-level comma or brace.
std::string_view dict_value(std::string_view header, std::string_view key, const std::string& name) {
  std::string quoted(1, '\'');  // built piecewise: GCC 12 warns falsely on "'" + std::string(...)
  quoted.append(key);
  quoted.append("':");
  const size_t at = header.find(quoted);
  if (at == std::string_view::npos) throw DataError(name + ": .npy header has no '" + std::string(key) + "'");
  size_t begin = at + quoted.size();
  while (begin < header.size() && header[begin] == ' ') ++begin;
  if (begin < header.size() && header[begin] == '(') {  // a tuple ends at its closing parenthesis
    const size_t close = header.find(')', begin);
    if (close == std::string_view::npos) throw DataError(name + ": bad .npy header");
    return header.substr(begin, close + 1 - begin);
  }
  size_t end = begin;
  while (end < header.size() && header[end] != ',' && header[end] != '}') ++end;
  return header.substr(begin, end - begin);
}

std::vector<int64_t> parse_shape(std::string_view text, const std::string& name) {
  if (text.size() < 2 || text.front() != '(' || text.back() != ')') {
    throw DataError(name + ": bad .npy shape " + std::string(text));
  }
  std::vector<int64_t> shape;
  std::string_view inner = text.substr(1, text.size() - 2);
  while (!inner.empty()) {
    const size_t comma = inner.find(',');
    std::string_view item = inner.substr(0, comma);
    while (!item.empty() && item.front() == ' ') item.remove_prefix(1);
    while (!item.empty() && item.back() == ' ') item.remove_suffix(1);
    if (!item.empty()) {
      int64_t dim = 0;
      for (const char c : item) {
        if (c < '0' || c > '9' || dim > (int64_t{1} << 50)) {
          throw DataError(name + ": bad .npy shape " + std::string(text));
        }
        dim = dim * 10 + (c - '0');
      }
      shape.push_back(dim);
    }
    if (comma == std::string_view::npos) break;
    inner.remove_prefix(comma + 1);
  }
  return shape;
}

}  // namespace

std::string npy_encode(NpyDType dtype, const std::vector<int64_t>& shape, const std::vector<int64_t>& values) {
  const DTypeInfo& type = info(dtype);
  if (element_count(shape) != static_cast<int64_t>(values.size())) {
    throw DataError("npy: shape " + shape_repr(shape) + " does not match " + std::to_string(values.size()) + " values");
  }
  std::string header =
      std::string("{'descr': '") + type.descr + "', 'fortran_order': False, 'shape': " + shape_repr(shape) + ", }";
  if (!shape.empty()) header.append(kGrowthDigits - std::to_string(shape.front()).size(), ' ');
  const size_t padding = kAlign - ((sizeof(kMagic) + 2 + 2 + header.size() + 1) % kAlign);
  header.append(padding, ' ');
  header += '\n';

  std::string bytes(kMagic, sizeof(kMagic));
  bytes += '\x01';
  bytes += '\x00';
  const auto header_length = static_cast<uint16_t>(header.size());
  bytes += static_cast<char>(header_length & 0xff);
  bytes += static_cast<char>(header_length >> 8);
  bytes += header;
  const size_t data_begin = bytes.size();
  bytes.resize(data_begin + values.size() * type.bytes);
  char* out = bytes.data() + data_begin;
  for (const int64_t value : values) {
    if (value < type.min || value > type.max) {
      throw DataError(std::string("npy: value ") + std::to_string(value) + " does not fit " + type.descr);
    }
    switch (dtype) {
      case NpyDType::kI2: {
        const auto v = static_cast<int16_t>(value);
        std::memcpy(out, &v, 2);
        break;
      }
      case NpyDType::kU2: {
        const auto v = static_cast<uint16_t>(value);
        std::memcpy(out, &v, 2);
        break;
      }
      case NpyDType::kI4: {
        const auto v = static_cast<int32_t>(value);
        std::memcpy(out, &v, 4);
        break;
      }
      case NpyDType::kU4: {
        const auto v = static_cast<uint32_t>(value);
        std::memcpy(out, &v, 4);
        break;
      }
      case NpyDType::kI8: std::memcpy(out, &value, 8); break;
    }
    out += type.bytes;
  }
  return bytes;
}

NpyArray npy_decode(std::string_view bytes, const std::string& name) {
  if (bytes.size() < 10 || std::memcmp(bytes.data(), kMagic, sizeof(kMagic)) != 0) {
    throw DataError(name + ": not a .npy file (bad magic)");
  }
  const auto major = static_cast<uint8_t>(bytes[6]);
  size_t header_begin = 0;
  size_t header_length = 0;
  if (major == 1) {
    header_begin = 10;
    header_length = static_cast<uint8_t>(bytes[8]) | (static_cast<size_t>(static_cast<uint8_t>(bytes[9])) << 8);
  } else if (major == 2 || major == 3) {
    if (bytes.size() < 12) throw DataError(name + ": truncated .npy header");
    header_begin = 12;
    uint32_t length32 = 0;
    std::memcpy(&length32, bytes.data() + 8, 4);
    header_length = length32;
  } else {
    throw DataError(name + ": unsupported .npy version " + std::to_string(major));
  }
  if (bytes.size() < header_begin + header_length) throw DataError(name + ": truncated .npy header");
  const std::string_view header = bytes.substr(header_begin, header_length);

  std::string_view descr = dict_value(header, "descr", name);
  if (descr.size() >= 2 && (descr.front() == '\'' || descr.front() == '"')) descr = descr.substr(1, descr.size() - 2);
  const DTypeInfo* type = nullptr;
  for (const DTypeInfo& entry : kDTypes) {
    if (descr == entry.descr) type = &entry;
  }
  if (type == nullptr) throw DataError(name + ": unsupported .npy dtype " + std::string(descr));
  if (dict_value(header, "fortran_order", name) != "False") {
    throw DataError(name + ": Fortran-order .npy arrays are not supported");
  }
  NpyArray array;
  array.dtype = type->dtype;
  array.shape = parse_shape(dict_value(header, "shape", name), name);
  int64_t count = 1;
  for (const int64_t dim : array.shape) {
    // More elements than bytes: truncated or corrupt. Compared before multiplying: (2^14, 2^50) wrapped to 0.
    if (dim != 0 && count > static_cast<int64_t>(bytes.size()) / dim) {
      throw DataError(name + ": .npy shape " + shape_repr(array.shape) + " exceeds the file size");
    }
    count *= dim;
  }
  const size_t data_begin = header_begin + header_length;
  const size_t expected = data_begin + static_cast<size_t>(count) * type->bytes;
  if (bytes.size() != expected) {
    throw DataError(name + ": .npy size mismatch: expected " + std::to_string(expected) + " bytes for shape " +
                    shape_repr(array.shape) + ", found " + std::to_string(bytes.size()));
  }
  array.values.resize(static_cast<size_t>(count));
  const char* in = bytes.data() + data_begin;
  for (int64_t& value : array.values) {
    switch (type->dtype) {
      case NpyDType::kI2: {
        int16_t v;
        std::memcpy(&v, in, 2);
        value = v;
        break;
      }
      case NpyDType::kU2: {
        uint16_t v;
        std::memcpy(&v, in, 2);
        value = v;
        break;
      }
      case NpyDType::kI4: {
        int32_t v;
        std::memcpy(&v, in, 4);
        value = v;
        break;
      }
      case NpyDType::kU4: {
        uint32_t v;
        std::memcpy(&v, in, 4);
        value = v;
        break;
      }
      case NpyDType::kI8: std::memcpy(&value, in, 8); break;
    }
    in += type->bytes;
  }
  return array;
}

void save_npy_atomic(const std::string& path, NpyDType dtype, const std::vector<int64_t>& shape,
                     const std::vector<int64_t>& values) {
  write_file_atomic(path, npy_encode(dtype, shape, values));
}

NpyArray load_npy(const std::string& path) { return npy_decode(read_file_bytes(path), path); }

}  // namespace moecore
