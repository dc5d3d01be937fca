// metadata.json of a moecore_sharded checkpoint (docs/checkpoint-format.md), read field by field: every value of
// the wrong JSON type, a missing field, a size that overflows or a piece outside its tensor is one line naming the
// file and the field's JSON path, e.g. `.../metadata.json: "args.model" must be an object, got null`.
#pragma once

#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <vector>

#include "moecore/ckpt/state_source.h"

namespace moecore {

inline constexpr const char* kShardedFormat = "moecore_sharded";
inline constexpr int kShardedFormatVersion = 1;

class CheckpointError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct MetadataPiece {
  std::string file;
  std::string name;  // the safetensors entry in `file`
  StateBox box;
  std::string crc32;
};
struct MetadataTensor {
  std::string key;
  StoredTensorInfo info;
  std::vector<MetadataPiece> pieces;
};
struct MetadataFile {
  int64_t bytes = 0;
  std::string crc32;
};
struct CheckpointMetadata {
  int64_t iteration = 0;
  std::map<std::string, MetadataFile> files;
  std::vector<MetadataTensor> tensors;  // in metadata.json's order
};

// Checks the structure of `metadata` (the parsed text of the file at `path`): types, the format and version,
// non-negative sizes whose byte counts fit int64, pieces inside their tensor naming listed files, CRC-32s of 8 hex
// digits; "layout" and "args" (and "args.model", "args.training" when present) are objects. Throws CheckpointError.
CheckpointMetadata parse_checkpoint_metadata(const nlohmann::ordered_json& metadata, const std::string& path);

// "null", "true", "3", "\"text\"", "an array", "an object": how an error shows a JSON value it did not expect.
std::string json_value_text(const nlohmann::ordered_json& value);

}  // namespace moecore
