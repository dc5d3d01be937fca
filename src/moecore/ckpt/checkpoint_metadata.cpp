#include "moecore/ckpt/checkpoint_metadata.h"

#include <limits>

#include "moecore/ckpt/safetensors.h"
#include "moecore/util/checked_math.h"

namespace moecore {
namespace {

using ojson = nlohmann::ordered_json;

// Reads fields of metadata.json, each error naming the file and the field's JSON path.
class FieldReader {
 public:
  explicit FieldReader(std::string path) : path_(std::move(path)) {}

  [[noreturn]] void fail(const std::string& where, const std::string& problem) const {
    throw CheckpointError(path_ + ": \"" + where + "\" " + problem);
  }
  const ojson& field(const ojson& parent, const std::string& name, const std::string& where) const {
    const auto it = parent.find(name);
    if (it == parent.end()) fail(where, "is missing");
    return *it;
  }
  const ojson& object(const ojson& value, const std::string& where) const {
    if (!value.is_object()) fail(where, "must be an object, got " + json_value_text(value));
    return value;
  }
  const ojson& array(const ojson& value, const std::string& where) const {
    if (!value.is_array()) fail(where, "must be an array, got " + json_value_text(value));
    return value;
  }
  std::string string(const ojson& value, const std::string& where) const {
    if (!value.is_string()) fail(where, "must be a string, got " + json_value_text(value));
    return value.get<std::string>();
  }
  int64_t integer(const ojson& value, const std::string& where) const {
    const bool fits = value.is_number_integer() &&
                      (!value.is_number_unsigned() ||
                       value.get<uint64_t>() <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()));
    if (!fits) fail(where, "must be an integer within 64 bits, got " + json_value_text(value));
    return value.get<int64_t>();
  }
  int64_t non_negative(const ojson& value, const std::string& where) const {
    const int64_t n = integer(value, where);
    if (n < 0) fail(where, "must not be negative, got " + std::to_string(n));
    return n;
  }
  std::vector<int64_t> integers(const ojson& value, const std::string& where) const {
    const ojson& list = array(value, where);
    std::vector<int64_t> out;
    for (size_t i = 0; i < list.size(); ++i) out.push_back(integer(list[i], where + "[" + std::to_string(i) + "]"));
    return out;
  }
  std::string crc32(const ojson& value, const std::string& where) const {
    const std::string text = string(value, where);
    if (text.size() != 8 || text.find_first_not_of("0123456789abcdef") != std::string::npos) {
      fail(where, "must be 8 lowercase hex digits, got " + json_value_text(value));
    }
    return text;
  }

 private:
  std::string path_;
};

DType dtype_of(const FieldReader& reader, const ojson& value, const std::string& where) {
  const std::string code = reader.string(value, where);
  for (const DType d : {DType::kF32, DType::kF64, DType::kBF16, DType::kF16, DType::kI32, DType::kI64, DType::kU8}) {
    if (safetensors_dtype_code(d) == code) return d;
  }
  reader.fail(where, "is an unknown dtype '" + code + "' (F32, F64, BF16, F16, I32, I64, U8)");
}

MetadataPiece read_piece(const FieldReader& reader, const ojson& p, const std::string& where,
                         const std::vector<int64_t>& global_shape, const CheckpointMetadata& out) {
  reader.object(p, where);
  MetadataPiece piece;
  piece.file = reader.string(reader.field(p, "file", where + ".file"), where + ".file");
  if (!out.files.contains(piece.file))
    reader.fail(where + ".file", "names " + piece.file + ", not listed in \"files\"");
  piece.name = reader.string(reader.field(p, "name", where + ".name"), where + ".name");
  piece.box.offsets = reader.integers(reader.field(p, "offsets", where + ".offsets"), where + ".offsets");
  piece.box.shape = reader.integers(reader.field(p, "shape", where + ".shape"), where + ".shape");
  const size_t rank = global_shape.size();
  bool inside = piece.box.offsets.size() == rank && piece.box.shape.size() == rank;
  for (size_t d = 0; inside && d < rank; ++d) {  // compared so that nothing overflows
    inside = piece.box.offsets[d] >= 0 && piece.box.shape[d] >= 0 && piece.box.shape[d] <= global_shape[d] &&
             piece.box.offsets[d] <= global_shape[d] - piece.box.shape[d];
  }
  if (!inside) reader.fail(where, "lies outside the tensor " + shape_text(global_shape));
  if (p.contains("flat_range")) {
    const std::vector<int64_t> range = reader.integers(p["flat_range"], where + ".flat_range");
    if (range.size() != 2) reader.fail(where + ".flat_range", "is not a pair");
    piece.box.flat_begin = range[0];
    piece.box.flat_end = range[1];
    if (range[0] < 0 || range[0] > range[1] || range[1] > piece.box.box_numel()) {
      reader.fail(where + ".flat_range", "lies outside the piece's " + std::to_string(piece.box.box_numel()) +
                                             " elements (the piece lies outside the tensor)");
    }
  }
  piece.crc32 = reader.crc32(reader.field(p, "crc32", where + ".crc32"), where + ".crc32");
  return piece;
}

MetadataTensor read_tensor(const FieldReader& reader, const std::string& key, const ojson& t,
                           const CheckpointMetadata& out) {
  const std::string where = "tensors." + key;
  reader.object(t, where);
  MetadataTensor tensor;
  tensor.key = key;
  tensor.info.dtype = dtype_of(reader, reader.field(t, "dtype", where + ".dtype"), where + ".dtype");
  tensor.info.global_shape = reader.integers(reader.field(t, "shape", where + ".shape"), where + ".shape");
  // Non-negative dimensions whose byte count fits int64: every piece's box lies inside, so its sizes fit too.
  int64_t bytes = static_cast<int64_t>(dtype_size(tensor.info.dtype));
  for (const int64_t d : tensor.info.global_shape) {
    if (d < 0) reader.fail(where + ".shape", "has a negative dimension: " + shape_text(tensor.info.global_shape));
    try {
      bytes = checked_mul(bytes, d, key + " byte count");
    } catch (const std::overflow_error& e) {
      reader.fail(where + ".shape", std::string("is too large: ") + e.what());
    }
  }
  const ojson& pieces = reader.array(reader.field(t, "pieces", where + ".pieces"), where + ".pieces");
  for (size_t i = 0; i < pieces.size(); ++i) {
    tensor.pieces.push_back(
        read_piece(reader, pieces[i], where + ".pieces[" + std::to_string(i) + "]", tensor.info.global_shape, out));
  }
  return tensor;
}

}  // namespace

std::string json_value_text(const ojson& value) {
  if (value.is_array()) return "an array";
  if (value.is_object()) return "an object";
  std::string text = value.dump(-1, ' ', false, ojson::error_handler_t::replace);
  if (text.size() > 40) text = text.substr(0, 40) + "...";
  return text;
}

CheckpointMetadata parse_checkpoint_metadata(const ojson& metadata, const std::string& path) {
  const FieldReader reader(path);
  if (!metadata.is_object()) throw CheckpointError(path + ": must be a JSON object, got " + json_value_text(metadata));
  CheckpointMetadata out;
  if (reader.string(reader.field(metadata, "format", "format"), "format") != kShardedFormat) {
    throw CheckpointError(path + ": not a moecore_sharded checkpoint (\"format\" is " +
                          json_value_text(metadata["format"]) + ")");
  }
  const int64_t version = reader.integer(reader.field(metadata, "format_version", "format_version"), "format_version");
  if (version != kShardedFormatVersion) {
    throw CheckpointError(path + ": format version " + std::to_string(version) + " is not supported (1 is)");
  }
  out.iteration = reader.non_negative(reader.field(metadata, "iteration", "iteration"), "iteration");
  reader.object(reader.field(metadata, "layout", "layout"), "layout");
  const ojson& args = reader.object(reader.field(metadata, "args", "args"), "args");
  for (const char* part : {"model", "training"}) {
    if (args.contains(part)) reader.object(args[part], std::string("args.") + part);
  }
  const ojson& files = reader.object(reader.field(metadata, "files", "files"), "files");
  for (const auto& [name, f] : files.items()) {
    const std::string where = "files." + name;
    if (name.empty() || name.find('/') != std::string::npos || name.starts_with(".")) {
      reader.fail(where, "is not a file name in the checkpoint folder");
    }
    reader.object(f, where);
    out.files[name] = MetadataFile{reader.non_negative(reader.field(f, "bytes", where + ".bytes"), where + ".bytes"),
                                   reader.crc32(reader.field(f, "crc32", where + ".crc32"), where + ".crc32")};
  }
  const ojson& tensors = reader.object(reader.field(metadata, "tensors", "tensors"), "tensors");
  for (const auto& [key, t] : tensors.items()) out.tensors.push_back(read_tensor(reader, key, t, out));
  return out;
}

}  // namespace moecore
