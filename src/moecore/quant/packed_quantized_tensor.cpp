#include "moecore/quant/packed_quantized_tensor.h"

#include <algorithm>
#include <limits>
#include <stdexcept>
#include <utility>

#include "moecore/quant/fp8_formats.h"

namespace moecore::quant {
namespace {

constexpr uint8_t kE4M3NanCode = 0x7F;  // NVFP4's scale of a block holding NaN (nvfp4_scaling.cpp)

bool packs_nibbles(const QuantizedTensor& q) { return q.format == ElementFormat::kE2M1; }

// The decode scale of a block from its stored byte, as the quantizer computed it.
float scale_of(const QuantizedTensor& q, const uint8_t code) {
  if (q.recipe == Recipe::kMxfp8) return decode_e8m0(code);
  if (q.recipe == Recipe::kNvfp4)
    return code == kE4M3NanCode ? std::numeric_limits<float>::quiet_NaN() : decode_e4m3(code);
  throw std::logic_error("unpack: " + recipe_name(q.recipe) + " has no scale bytes");
}

}  // namespace

int64_t PackedQuantizedTensor::bytes() const {
  return (codes.defined() ? codes.nbytes() : 0) + (scales.defined() ? scales.nbytes() : 0);
}

PackedQuantizedTensor pack(QuantizedTensor q, const Device device, const MemCategory category) {
  PackedQuantizedTensor p;
  const auto n = static_cast<int64_t>(q.codes.size());
  if (packs_nibbles(q)) {
    p.codes = Tensor({(n + 1) / 2}, DType::kU8, category, device);
    uint8_t* out = p.codes.data<uint8_t>();
    for (int64_t i = 0; i < n; i += 2) {
      const uint8_t high = i + 1 < n ? q.codes[static_cast<size_t>(i + 1)] : 0;
      out[i / 2] = static_cast<uint8_t>((q.codes[static_cast<size_t>(i)] & 0x0F) | (high << 4));
    }
  } else {
    p.codes = Tensor({n}, DType::kU8, category, device);
    std::copy(q.codes.begin(), q.codes.end(), p.codes.data<uint8_t>());
  }
  if (!q.scale_codes.empty()) {
    p.scales = Tensor({static_cast<int64_t>(q.scale_codes.size())}, DType::kU8, category, device);
    std::copy(q.scale_codes.begin(), q.scale_codes.end(), p.scales.data<uint8_t>());
  } else {
    p.scales = Tensor({static_cast<int64_t>(q.scales.size())}, DType::kF32, category, device);
    std::copy(q.scales.begin(), q.scales.end(), p.scales.data<float>());
  }
  q.codes = {};
  q.scales = {};
  q.scale_codes = {};
  p.meta = std::move(q);
  return p;
}

QuantizedTensor unpack(const PackedQuantizedTensor& p) {
  QuantizedTensor q = p.meta;
  const auto n = static_cast<size_t>(q.rows * q.cols);
  q.codes.resize(n);
  const uint8_t* codes = p.codes.data<uint8_t>();
  if (packs_nibbles(q)) {
    for (size_t i = 0; i < n; ++i) q.codes[i] = (codes[i / 2] >> (4 * (i % 2))) & 0x0F;
  } else {
    std::copy_n(codes, n, q.codes.begin());
  }
  const auto blocks = static_cast<size_t>(p.scales.numel());
  if (p.scales.dtype() == DType::kU8) {
    const uint8_t* bytes = p.scales.data<uint8_t>();
    q.scale_codes.assign(bytes, bytes + blocks);
    q.scales.resize(blocks);
    for (size_t i = 0; i < blocks; ++i) q.scales[i] = scale_of(q, bytes[i]);
  } else {
    const float* scales = p.scales.data<float>();
    q.scales.assign(scales, scales + blocks);
  }
  return q;
}

}  // namespace moecore::quant
