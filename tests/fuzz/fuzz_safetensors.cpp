// Fuzz harness: safetensors files, read the three ways moecore reads them (parse_safetensors on bytes,
// read_safetensors on a file, read_safetensors_header + read_safetensors_tensor one tensor at a time), floats
// converted with to_float32. The three must agree on whether the file is valid, and a valid file written again with
// encode_safetensors must read back with the same tensors.
//
// Input: the .safetensors file.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <span>
#include <string>

#include "fuzz_util.h"
#include "moecore/ckpt/safetensors.h"

namespace {

bool is_float(const moecore::DType dtype) {
  return dtype == moecore::DType::kF32 || dtype == moecore::DType::kF64 || dtype == moecore::DType::kBF16 ||
         dtype == moecore::DType::kF16;
}

bool same_tensor(const moecore::Tensor& a, const moecore::Tensor& b) {
  return a.dtype() == b.dtype() && a.shape() == b.shape() && a.nbytes() == b.nbytes() &&
         (a.nbytes() == 0 || std::memcmp(a.data<std::byte>(), b.data<std::byte>(), a.nbytes()) == 0);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const moecore::fuzz::ScratchDir dir("safetensors");
  const std::string path = dir.file("model.safetensors");
  moecore::fuzz::write_bytes(path, std::string_view(reinterpret_cast<const char*>(data), size));
  const std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(data), size);

  int valid = 0;
  moecore::SafetensorsFile parsed;
  try {
    parsed = moecore::parse_safetensors(bytes, "input");
    ++valid;
  } catch (const std::exception& error) {
    moecore::fuzz::expected_named_error(error);
  }
  try {
    const moecore::SafetensorsFile file = moecore::read_safetensors(path);
    ++valid;
    if (file.tensors.size() != parsed.tensors.size()) moecore::fuzz::property_failed("read and parse disagree");
  } catch (const std::exception& error) {
    moecore::fuzz::expected_named_error(error);
  }
  try {
    const moecore::SafetensorsHeader header = moecore::read_safetensors_header(path);
    ++valid;
    for (size_t i = 0; i < header.tensors.size(); ++i) {
      const moecore::Tensor tensor = moecore::read_safetensors_tensor(header, header.tensors[i]);
      if (i < parsed.tensors.size() && !same_tensor(tensor, parsed.tensors[i].second)) {
        moecore::fuzz::property_failed("read_safetensors_tensor differs from parse_safetensors");
      }
      if (is_float(tensor.dtype())) (void)moecore::to_float32(tensor);
    }
  } catch (const std::exception& error) {
    moecore::fuzz::expected_named_error(error);
  }
  if (valid != 0 && valid != 3) moecore::fuzz::property_failed("the three readers disagree on validity");
  if (valid == 3) {
    try {
      const std::vector<std::byte> again = moecore::encode_safetensors(parsed.tensors, parsed.metadata);
      const moecore::SafetensorsFile reread = moecore::parse_safetensors(again, "re-encoded");
      if (reread.tensors.size() != parsed.tensors.size() || reread.metadata != parsed.metadata) {
        moecore::fuzz::property_failed("re-encoded file differs");
      }
      for (size_t i = 0; i < parsed.tensors.size(); ++i) {
        if (reread.tensors[i].first != parsed.tensors[i].first ||
            !same_tensor(reread.tensors[i].second, parsed.tensors[i].second)) {
          moecore::fuzz::property_failed("re-encoded tensor differs");
        }
      }
    } catch (const std::exception& error) {
      // encode_safetensors refuses what the reader accepts only for reasons it names (e.g. a "__metadata__" name).
      moecore::fuzz::expected_named_error(error);
    }
  }
  return 0;
}
