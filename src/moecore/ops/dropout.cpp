#include "moecore/ops/dropout.h"

#include <algorithm>

#include "moecore/ops/dispatch.h"
#include "moecore/ops/precision.h"
#include "moecore/ops/row_blocks.h"

namespace moecore::ops {
using detail::ptr;

void dropout_forward(Tensor& out, const Tensor& inp, const DropoutSpec& spec) {
  constexpr const char* op = "dropout_forward";
  detail::check_tensors(op, {&out, &inp});
  detail::check_numel(op, "out", out, inp.numel());
  if (spec.p == 0.0f && detail::is_16bit(out.dtype()) && out.dtype() == inp.dtype()) {  // the identity: bits move
    if (out.data<uint16_t>() != inp.data<uint16_t>()) {
      std::copy_n(inp.data<uint16_t>(), inp.numel(), out.data<uint16_t>());
    }
    return;
  }
  // Element i draws at spec.offset + i: a block of elements from i0 draws from spec.offset + i0.
  const std::initializer_list<detail::RowOperand> elements = {{&out, 1, detail::RowUse::kOut},
                                                              {&inp, 1, detail::RowUse::kIn}};
  if (detail::row_blocks_apply(elements)) {
    detail::run_row_blocks(inp.numel(), elements, [&](const int64_t i0, const int64_t i1, float* const* p) {
      DropoutSpec block = spec;
      block.offset += static_cast<uint64_t>(i0);
      kernels::cpu::dropout_forward(p[0], p[1], i1 - i0, block);
    });
    detail::round_activations({&out});
    return;
  }
  detail::Staging staging;
  staging.write_only(out, {&inp});
  detail::dispatch(op, inp,
                   [&]<typename T>(auto k) { k.dropout_forward(ptr<T>(out), ptr<T>(inp), inp.numel(), spec); });
  detail::round_activations({&out});
}

void dropout_backward(Tensor& dinp, const Tensor& dout, const DropoutSpec& spec) {
  constexpr const char* op = "dropout_backward";
  detail::check_tensors(op, {&dinp, &dout});
  detail::check_numel(op, "dinp", dinp, dout.numel());
  const std::initializer_list<detail::RowOperand> elements = {{&dinp, 1, detail::RowUse::kInOut},
                                                              {&dout, 1, detail::RowUse::kIn}};
  if (detail::row_blocks_apply(elements)) {
    detail::run_row_blocks(dout.numel(), elements, [&](const int64_t i0, const int64_t i1, float* const* p) {
      DropoutSpec block = spec;
      block.offset += static_cast<uint64_t>(i0);
      kernels::cpu::dropout_backward(p[0], p[1], i1 - i0, block);
    });
    detail::round_activations({&dinp});
    return;
  }
  const detail::Staging staging;
  detail::dispatch(op, dout,
                   [&]<typename T>(auto k) { k.dropout_backward(ptr<T>(dinp), ptr<T>(dout), dout.numel(), spec); });
  detail::round_activations({&dinp});
}

}  // namespace moecore::ops
