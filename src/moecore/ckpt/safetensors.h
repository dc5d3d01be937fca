// safetensors files (https://github.com/huggingface/safetensors, format section of its README):
//   8 bytes   little-endian uint64 N, the header length
//   N bytes   JSON object: {"__metadata__": {str: str}, NAME: {"dtype": "F32", "shape": [..], "data_offsets": [b, e]}}
//             (data_offsets are relative to the start of the byte buffer; padded with spaces to a multiple of 8)
//   rest      the byte buffer: every tensor's little-endian, row-major bytes, contiguous, no gaps, no overlaps.
// The reader checks every one of these rules and throws std::runtime_error "PATH: problem" on the first broken one.
#pragma once

#include <cstddef>
#include <map>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "moecore/tensor/tensor.h"

namespace moecore {

using NamedTensor = std::pair<std::string, Tensor>;
using SafetensorsMetadata = std::map<std::string, std::string>;

struct SafetensorsFile {
  std::vector<NamedTensor> tensors;  // in byte-buffer order
  SafetensorsMetadata metadata;

  bool contains(const std::string& name) const;
  // The tensor called `name`; throws std::runtime_error naming it (and `source`) when absent.
  const Tensor& at(const std::string& name) const;
  std::string source;  // the path it was read from (for messages)
};

// safetensors dtype codes: "F32", "F64", "BF16", "F16", "I32", "I64", "U8".
std::string safetensors_dtype_code(DType dtype);

// Reads and validates a whole file.
SafetensorsFile read_safetensors(const std::string& path);

// A file's table of contents without its tensors' bytes (lazy readers: the HF import reads one tensor at a time).
struct SafetensorsTensorInfo {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  uint64_t file_offset = 0;  // of the tensor's first byte, from the start of the file
  uint64_t nbytes = 0;
};
struct SafetensorsHeader {
  std::string path;
  std::vector<SafetensorsTensorInfo> tensors;  // in byte-buffer order
  SafetensorsMetadata metadata;
  uint64_t data_start = 0;  // 8 + the header length: the file offset of the byte buffer
  const SafetensorsTensorInfo* find(const std::string& name) const;  // null when absent
};
// Reads and validates the header (every rule read_safetensors checks) against the file's size.
SafetensorsHeader read_safetensors_header(const std::string& path);
// Reads just `info`'s bytes from header.path (std::runtime_error "PATH: ..." when the read fails).
Tensor read_safetensors_tensor(const SafetensorsHeader& header, const SafetensorsTensorInfo& info);
// Parses an in-memory file; `source` names it in error messages.
SafetensorsFile parse_safetensors(std::span<const std::byte> bytes, const std::string& source);

// The file's bytes for `tensors` in the given order (names must be unique and not "__metadata__").
// The first bytes of that file: the header length and the header, for writers that stream the tensors after it.
std::vector<std::byte> encode_safetensors_header(const std::vector<NamedTensor>& tensors,
                                                 const SafetensorsMetadata& metadata = {});
std::vector<std::byte> encode_safetensors(const std::vector<NamedTensor>& tensors,
                                          const SafetensorsMetadata& metadata = {});
// Writes atomically: a temporary file next to `path`, flushed to disk, then renamed over it.
void write_safetensors(const std::string& path, const std::vector<NamedTensor>& tensors,
                       const SafetensorsMetadata& metadata = {});

// Writes `bytes` to `path` atomically (temporary file in the same folder, fsync, rename).
void write_file_atomically(const std::string& path, std::span<const std::byte> bytes);

// A float32 copy of a floating-point tensor (F32, F64, BF16, F16); throws std::runtime_error for other dtypes.
Tensor to_float32(const Tensor& tensor, MemCategory category = MemCategory::kOther);

}  // namespace moecore
