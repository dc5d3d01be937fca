#include "moecore/ops/row_blocks.h"

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "moecore/kernels/cpu/convert.h"
#include "moecore/ops/staging.h"

namespace moecore::ops::detail {
namespace {

// fp32 scratch per block, all 16-bit operands together: within a core's L2 with room for the kernel's own reads.
constexpr int64_t kBlockScratchFloats = int64_t{32} << 10;
// Blocks start at multiples of this many rows and each operand's scratch at a 64-byte boundary, so every row sits at
// the offset from a 64-byte boundary it has in a whole-tensor (64-byte aligned) fp32 copy: the kernels' vectorised
// loops then group their sums as on that copy.
constexpr int64_t kAlignFloats = 16;

int64_t round_up(const int64_t n, const int64_t m) { return (n + m - 1) / m * m; }

void widen(float* out, const Tensor& t, const int64_t offset, const int64_t n) {
  const uint16_t* bits = t.data<uint16_t>() + offset;
  const kernels::cpu::ConvertIsa isa = kernels::cpu::best_convert_isa();
  if (t.dtype() == DType::kBF16) {
    kernels::cpu::decode_bf16(out, bits, n, isa);
  } else {
    kernels::cpu::decode_fp16(out, bits, n, isa);
  }
}

void narrow(Tensor& t, const int64_t offset, const float* in, const int64_t n) {
  uint16_t* bits = t.data<uint16_t>() + offset;
  const kernels::cpu::ConvertIsa isa = kernels::cpu::best_convert_isa();
  if (t.dtype() == DType::kBF16) {
    kernels::cpu::encode_bf16(bits, in, n, isa);
  } else {
    kernels::cpu::encode_fp16(bits, in, n, isa);
  }
}

}  // namespace

bool row_blocks_apply(const std::initializer_list<RowOperand> operands) {
  return std::any_of(operands.begin(), operands.end(), [](const RowOperand& o) {
    return o.tensor != nullptr && o.tensor->defined() && is_16bit(o.tensor->dtype()) &&
           o.tensor->device() == Device::kCPU;
  });
}

bool same_16bit(const std::initializer_list<const Tensor*> tensors) {
  const Tensor& first = **tensors.begin();
  return std::all_of(tensors.begin(), tensors.end(), [&](const Tensor* t) {
    return t->defined() && is_16bit(t->dtype()) && t->dtype() == first.dtype() && t->device() == Device::kCPU;
  });
}

void run_row_blocks(const int64_t R, const std::initializer_list<RowOperand> operands,
                    const std::function<void(int64_t, int64_t, float* const*)>& body) {
  const std::vector<RowOperand> ops(operands);
  // Handles sharing the operands' storage: outputs are written through them.
  std::vector<Tensor> handles;
  handles.reserve(ops.size());
  int64_t widths16 = 0;
  for (const RowOperand& o : ops) {
    if (o.tensor == nullptr || !o.tensor->defined() || o.width < 0 || o.tensor->numel() < R * o.width) {
      throw std::logic_error("run_row_blocks: an operand is not " + std::to_string(R) + " rows");
    }
    const DType dtype = o.tensor->dtype();
    if (is_16bit(dtype)) {
      widths16 += o.width;
    } else if (dtype != DType::kF32) {
      throw std::logic_error("run_row_blocks: a " + std::string(dtype_name(dtype)) + " operand");
    }
    handles.push_back(*o.tensor);
  }
  const int64_t block =
      std::min(std::max<int64_t>(R, 1),
               round_up(std::max<int64_t>(1, kBlockScratchFloats / std::max<int64_t>(widths16, 1)), kAlignFloats));
  const int64_t n_blocks = (R + block - 1) / block;
  const auto n_ops = static_cast<int64_t>(ops.size());
#pragma omp parallel
  {
    std::vector<float> scratch(static_cast<size_t>(block * widths16 + (n_ops + 1) * kAlignFloats));
    std::vector<float*> rows(ops.size());
#pragma omp for schedule(static)
    for (int64_t b = 0; b < n_blocks; ++b) {
      const int64_t r0 = b * block, r1 = std::min(R, r0 + block);
      auto* next = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(scratch.data()) + 63) & ~uintptr_t{63});
      for (size_t i = 0; i < ops.size(); ++i) {
        const RowOperand& o = ops[i];
        if (!is_16bit(o.tensor->dtype())) {
          rows[i] = handles[i].data<float>() + r0 * o.width;
          continue;
        }
        rows[i] = next;
        next += round_up((r1 - r0) * o.width, kAlignFloats);
        if (o.use != RowUse::kOut) widen(rows[i], *o.tensor, r0 * o.width, (r1 - r0) * o.width);
      }
      body(r0, r1, rows.data());
      for (size_t i = 0; i < ops.size(); ++i) {
        const RowOperand& o = ops[i];
        if (o.use != RowUse::kIn && is_16bit(o.tensor->dtype())) {
          narrow(handles[i], r0 * o.width, rows[i], (r1 - r0) * o.width);
        }
      }
    }
  }
}

}  // namespace moecore::ops::detail
