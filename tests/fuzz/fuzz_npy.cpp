// Fuzz harness: the .npy index caches of the GPT dataset (Megatron's *-document_index.npy, *-sample_index.npy,
// *-shuffle_index.npy under --data-cache-path): npy_decode / load_npy alone, and a cache with one of the three
// files replaced, loaded by GPTDataset (which must validate it) and every sample read from it.
//
// Input: a selector byte, then the .npy file. Selector % 4 == 0: the file alone (npy_decode, load_npy, and a
// decoded array written again with npy_encode must decode to the same array); 1, 2, 3: it replaces the fixture
// cache's document, sample or shuffle index (fuzz_npy_fixture.h).
#include <cstddef>
#include <cstdint>
#include <exception>
#include <filesystem>
#include <string>
#include <vector>

#include "fuzz_npy_fixture.h"
#include "fuzz_util.h"
#include "moecore/data/file_bytes.h"
#include "moecore/data/npy.h"

namespace {

namespace fs = std::filesystem;

struct Cache {
  moecore::fuzz::ScratchDir dir{"npy"};
  std::vector<std::string> paths;  // the three files, in selector order
  std::vector<std::string> valid;  // their bytes as the dataset wrote them
  Cache() {
    (void)moecore::fuzz::fixture_dataset(dir.path().string());
    for (const char* suffix : moecore::fuzz::kFixtureCacheFiles) {
      for (const fs::directory_entry& entry : fs::directory_iterator(dir.path())) {
        if (entry.path().filename().string().ends_with(suffix)) paths.push_back(entry.path().string());
      }
    }
    if (paths.size() != 3) moecore::fuzz::property_failed("the fixture dataset did not write its three cache files");
    for (const std::string& path : paths) valid.push_back(moecore::read_file_bytes(path));
  }
};

void decode_alone(const moecore::fuzz::ScratchDir& dir, std::string_view bytes) {
  const moecore::NpyArray array = moecore::npy_decode(bytes, "input.npy");
  const std::string path = dir.file("alone.npy");
  moecore::fuzz::write_bytes(path, bytes);
  const moecore::NpyArray loaded = moecore::load_npy(path);
  if (loaded.shape != array.shape || loaded.values != array.values) moecore::fuzz::property_failed("load_npy differs");
  const moecore::NpyArray again =
      moecore::npy_decode(moecore::npy_encode(array.dtype, array.shape, array.values), "re");
  if (again.shape != array.shape || again.values != array.values || again.dtype != array.dtype) {
    moecore::fuzz::property_failed("npy_encode of a decoded array decodes to another array");
  }
}

void load_cache(const Cache& cache, const size_t which, std::string_view bytes) {
  for (size_t k = 0; k < 3; ++k) moecore::fuzz::write_bytes(cache.paths[k], k == which ? bytes : cache.valid[k]);
  const moecore::GPTDataset dataset = moecore::fuzz::fixture_dataset(cache.dir.path().string());
  if (!dataset.loaded_from_cache()) moecore::fuzz::property_failed("the fixture cache was not used");
  std::vector<int32_t> text(static_cast<size_t>(dataset.sequence_length() + 1));
  for (int64_t s = 0; s < dataset.size(); ++s) dataset.sample_text(s, text);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const Cache cache;
  if (size == 0) return 0;
  const std::string_view bytes(reinterpret_cast<const char*>(data) + 1, size - 1);
  try {
    if (data[0] % 4 == 0) {
      decode_alone(cache.dir, bytes);
    } else {
      load_cache(cache, static_cast<size_t>(data[0] % 4) - 1, bytes);
    }
  } catch (const std::exception& error) {
    moecore::fuzz::expected_error(error);
  }
  return 0;
}
