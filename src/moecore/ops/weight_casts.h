// The 16-bit copies of the weights that the native 16-bit GEMMs read, made once per training step instead of once per
// GEMM call. Under --bf16 / --fp16 the model weights are fp32 tensors holding values of the 16-bit format (the
// optimizer rounds them); the native GEMMs read their 16-bit bits. Inside a ScopedWeightCasts (the training step's
// forward and backward passes over all its micro-batches, during which no weight changes) the first cast of each
// model parameter is kept and every later GEMM on it reads the copy: the experts' and the output layer's weights are
// cast once per step rather than in forward and again in backward, as TransformerEngine keeps a weight's cast from the
// first micro-batch (is_first_microbatch). The copy holds the same bits a fresh cast would.
//
// Across steps (WeightCastCarry) the copies outlive the scope: the optimizer writes each one's bits in the pass that
// updates its weight, and the next step's scope starts with them, so under --bf16 no step casts its weights at all.
#pragma once

#include <cstdint>
#include <memory>

#include "moecore/tensor/tensor.h"

namespace moecore::ops {

// The casts one step's scope kept, handed on to the next step's. When the scope ends they become stale; the
// optimizer refreshes each one it rewrites with its weight's update (AdamWOptimizer::step), and drop_stale() frees
// the others (a weight changed some other way, or no update ran). The next scope given the carry takes the fresh
// ones. The owner guarantees that between a scope's end and the next scope nothing but that optimizer step changes
// a weight whose cast it refreshed.
class WeightCastCarry {
 public:
  WeightCastCarry();
  ~WeightCastCarry();
  WeightCastCarry(const WeightCastCarry&) = delete;
  WeightCastCarry& operator=(const WeightCastCarry&) = delete;

  // The stale cast of `weight` in `dtype`, now counted fresh: the caller overwrites it with the updated weight's
  // bits. Undefined when there is none.
  Tensor refresh(const Tensor& weight, DType dtype);
  // Frees the casts not refreshed since the last scope ended.
  void drop_stale();
  int64_t fresh() const;  // casts the next scope will start with
  int64_t stale() const;

 private:
  friend class ScopedWeightCasts;
  struct State;
  std::unique_ptr<State> state_;
};

// While one lives (scopes nest; the outermost owns the copies), cached_weight_cast keeps its casts; they are freed
// when the outermost ends, or with a carry (the outermost's) handed to it as stale ones, the scope having started
// with its fresh ones. The caller guarantees that no model parameter changes inside the scope.
class ScopedWeightCasts {
 public:
  explicit ScopedWeightCasts(WeightCastCarry* carry = nullptr);
  ~ScopedWeightCasts();
  ScopedWeightCasts(const ScopedWeightCasts&) = delete;
  ScopedWeightCasts& operator=(const ScopedWeightCasts&) = delete;

 private:
  WeightCastCarry* carry_;
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
