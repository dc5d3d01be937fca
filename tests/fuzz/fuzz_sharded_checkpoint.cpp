// Fuzz harness: a saved iteration folder of moecore's sharded checkpoint format (metadata.json and the rank's
// safetensors file; docs/checkpoint-format.md), opened with ShardedCheckpoint, verified (file and piece CRC-32s),
// and every small tensor read back whole; and the save folder's tracker file (latest_checkpointed_iteration.txt).
//
// Input: the two files in one (fuzz_util.h split_two_files): uint32 length N, N bytes of metadata.json, the rest
// rank_00000.safetensors. The first 64 bytes of metadata.json are also written as the tracker.
#include <cstddef>
#include <cstdint>
#include <exception>
#include <filesystem>
#include <string>

#include "fuzz_util.h"
#include "moecore/ckpt/checkpoint_dir.h"
#include "moecore/ckpt/sharded_checkpoint.h"
#include "moecore/ckpt/state_source.h"

namespace {

constexpr int64_t kMaxElementsRead = int64_t{1} << 16;

void open_checkpoint(const std::string& iter_dir) {
  const moecore::ShardedCheckpoint checkpoint(iter_dir);
  checkpoint.verify();
  for (const std::string& key : checkpoint.keys()) {
    const std::optional<moecore::StoredTensorInfo> info = checkpoint.info(key);
    if (!info) moecore::fuzz::property_failed("a listed key has no info");
    int64_t elements = 1;
    bool small = true;
    for (const int64_t d : info->global_shape) {
      if (d < 0 || (d > 0 && elements > kMaxElementsRead / d)) small = false;
      if (small) elements *= d;
    }
    if (!small || elements > kMaxElementsRead) continue;
    try {
      (void)moecore::read_global_tensor(checkpoint, key, info->dtype);
      if (info->global_shape.empty()) {
        if (info->dtype == moecore::DType::kI64) (void)checkpoint.i64(key);
        if (info->dtype == moecore::DType::kF64) (void)checkpoint.f64(key);
      }
    } catch (const std::exception& error) {  // pieces that do not cover the tensor, a dtype it cannot convert
      moecore::fuzz::expected_error(error);
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const moecore::fuzz::ScratchDir root("sharded_checkpoint");
  static const std::string iter_dir = moecore::iteration_dir(root.path().string(), 1);
  std::filesystem::create_directories(iter_dir);
  const moecore::fuzz::TwoFiles files = moecore::fuzz::split_two_files(data, size);
  moecore::fuzz::write_bytes(iter_dir + "/metadata.json", files.first);
  moecore::fuzz::write_bytes(iter_dir + "/rank_00000.safetensors", files.second);
  moecore::fuzz::write_bytes(moecore::tracker_path(root.path().string()), files.first.substr(0, 64));
  try {
    (void)moecore::read_tracker(root.path().string());
  } catch (const std::exception& error) {
    moecore::fuzz::expected_error(error);
    if (std::string_view(error.what()).find('\n') != std::string_view::npos) {
      moecore::fuzz::property_failed("the tracker's error is not one line");
    }
  }
  try {
    open_checkpoint(iter_dir);
  } catch (const std::exception& error) {
    moecore::fuzz::expected_named_error(error);
  }
  return 0;
}
