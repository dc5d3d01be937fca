// Staging of 16-bit activations for fp32 kernels (internal to ops/). Under --bf16 / --fp16 activations and their
// gradients are stored as bf16 / fp16 tensors (2 bytes an element, as Megatron's Float16Module holds them), while
// every kernel computes in fp32. An op opens a Staging for its whole body; the typed pointers of dispatch.h
// (ptr / opt) then hand the kernels an exact fp32 copy of each 16-bit input and an fp32 scratch for each 16-bit
// output (copied in first, so outputs that are accumulated into, `+=`, stay correct). When the op ends the scratch
// is rounded to nearest even and narrowed into its 16-bit tensor: the value the fp32 path would have written and
// rounded (round_activations), bit for bit. fp32 and fp64 tensors pass through untouched.
#pragma once

#include <initializer_list>
#include <memory>
#include <vector>

#include "moecore/tensor/tensor.h"

namespace moecore::ops::detail {

inline bool is_16bit(const DType dtype) { return dtype == DType::kBF16 || dtype == DType::kF16; }

class Staging {
 public:
  Staging();
  // Narrows the written scratch into its 16-bit tensors (unless unwinding an exception).
  ~Staging() noexcept(false);
  Staging(const Staging&) = delete;
  Staging& operator=(const Staging&) = delete;

  // The fp32 tensor the kernels read for `t`: t itself unless t is bf16 / fp16, else its exact fp32 copy.
  const Tensor& in(const Tensor& t);
  const Tensor* in(const Tensor* t) { return t == nullptr ? nullptr : &in(*t); }
  // The fp32 tensor the kernels write for `t`: t itself unless t is bf16 / fp16, else an fp32 copy of it that is
  // narrowed into t when the Staging ends.
  Tensor& out(Tensor& t);
  Tensor* out(Tensor* t) { return t == nullptr ? nullptr : &out(*t); }
  // out() for an output the op overwrites in full: its scratch is not copied in first, unless `t` is one of the op's
  // `inputs` (in place). Call it before the op reads any tensor.
  Tensor& write_only(Tensor& t, std::initializer_list<const Tensor*> inputs);

  // The innermost live Staging of this thread (null when none).
  static Staging* innermost();
  // Whether `t` lies inside the fp32 scratch of a written `dtype` tensor of this Staging or an enclosing one: its
  // values are rounded to nearest even when they are narrowed, so rounding them to `dtype` before is a second pass
  // that changes nothing (round_activations skips it).
  bool narrows(const Tensor& t, DType dtype) const;

 private:
  struct Entry {
    Tensor target;  // the 16-bit tensor
    Tensor f32;     // its fp32 copy / scratch
    bool written = false;
  };
  // The entry of `t` in this Staging or an enclosing one (a tensor staged by an outer op stays staged there).
  Entry* find(const Tensor& t);
  Entry& stage(const Tensor& t, bool copy_in);

  std::vector<std::unique_ptr<Entry>> entries_;
  Staging* outer_;
  int uncaught_;
};

// The fp32 data of a 16-bit tensor through the innermost Staging (one is opened by dispatch() when none is live).
const float* staged_in(const Tensor& t);
float* staged_out(Tensor& t);

}  // namespace moecore::ops::detail
