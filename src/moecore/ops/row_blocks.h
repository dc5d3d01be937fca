// 16-bit activations through row-local kernels, block by block (internal to ops/). A Staging (staging.h) widens each
// 16-bit tensor whole before an op's kernel runs and narrows each output whole after it: for the ops that stream their
// operands once (norms, rotary embedding, residual adds, dropout) that is three times their own memory traffic, and
// an fp32 copy of every operand in memory. Where the kernel treats rows independently, run_row_blocks runs it on
// blocks of rows instead: each block's 16-bit inputs are widened into the thread's fp32 scratch, the kernel runs on
// the block, and its 16-bit outputs are narrowed from the scratch (round to nearest even, once). The values are the
// whole-tensor Staging's bit for bit, while the fp32 copies stay in the core's cache. Blocks run in parallel, one
// thread each (the kernels' own parallel loops run inside as one thread).
#pragma once

#include <cstdint>
#include <functional>
#include <initializer_list>

#include "moecore/tensor/tensor.h"

namespace moecore::ops::detail {

enum class RowUse : uint8_t {
  kIn,     // read
  kOut,    // overwritten in full by the kernel (not read; not widened)
  kInOut,  // read and written (accumulated into, or in place)
};

struct RowOperand {
  const Tensor* tensor;  // row r is elements [r * width, (r + 1) * width)
  int64_t width;
  RowUse use;
};

// Whether an op should run in row blocks: one of `operands` is a bf16 / fp16 tensor on the CPU device. (The reference
// device keeps the whole-tensor Staging: the op tests compare the two.)
bool row_blocks_apply(std::initializer_list<RowOperand> operands);

// Whether `tensors` are all bf16, or all fp16, on the CPU device: an op that only moves elements then moves their bits
// (the CPU kernels of rows.h take uint16_t).
bool same_16bit(std::initializer_list<const Tensor*> tensors);

// Calls body(r0, r1, rows) for blocks [r0, r1) covering [0, R), in parallel; rows[i] points at operand i's row r0 in
// fp32: the tensor's own data for an fp32 tensor, the thread's scratch for a 16-bit one. Operands of other dtypes
// throw std::logic_error.
void run_row_blocks(int64_t R, std::initializer_list<RowOperand> operands,
                    const std::function<void(int64_t r0, int64_t r1, float* const* rows)>& body);

}  // namespace moecore::ops::detail
