// The 16-bit copies of the weights that the native 16-bit GEMMs read, made once per training step instead of once per
// GEMM call. Under --bf16 / --fp16 the model weights are fp32 tensors holding values of the 16-bit format (the
// optimizer rounds them); the native GEMMs read their 16-bit bits. Inside a ScopedWeightCasts (the training step's
// forward and backward passes over all its micro-batches, during which no weight changes) the first cast of each
// model parameter is kept and every later GEMM on it reads the copy: the experts' and the output layer's weights are
// cast once per step rather than in forward and again in backward, as TransformerEngine keeps a weight's cast from the
// first micro-batch (is_first_microbatch). The copy holds the same bits a fresh cast would.
#pragma once

#include "moecore/tensor/tensor.h"

namespace moecore::ops {

// While one lives (scopes nest; the outermost owns the copies), cached_weight_cast keeps its casts; they are freed
// when the outermost ends. The caller guarantees that no model parameter changes inside the scope.
class ScopedWeightCasts {
 public:
  ScopedWeightCasts();
  ~ScopedWeightCasts();
  ScopedWeightCasts(const ScopedWeightCasts&) = delete;
  ScopedWeightCasts& operator=(const ScopedWeightCasts&) = delete;
};

// Whether a ScopedWeightCasts is live.
bool weight_casts_live();

// How many casts the live scope holds (0 without one).
int64_t weight_casts_kept();

// `weight` (fp32 holding values of `dtype`, kBF16 or kF16) as a [numel] tensor of `dtype`: the live scope's copy,
// made on first use. An undefined tensor when no scope is live or `weight` is not a model parameter (its storage is
// not counted as MemCategory::kParams, e.g. FSDP's gathered units): the caller casts it itself.
Tensor cached_weight_cast(const Tensor& weight, DType dtype);

}  // namespace moecore::ops
