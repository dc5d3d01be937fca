// A trainable parameter: fp32 value and gradient under a Megatron-style name
// (e.g. "decoder.layers.0.self_attention.linear_qkv.weight").
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "moecore/model/stable_store.h"
#include "moecore/quant/delayed_linear_scaling.h"
#include "moecore/quant/recipe.h"
#include "moecore/tensor/tensor.h"

namespace moecore {

enum class InitKind { kNormal, kScaledNormal, kZeros, kOnes };

// Where this rank's tensor sits in the one-process tensor. Along dimension `dim` the full extent is `segments`
// equal segments (2 for SwiGLU's fused [gate; up] fc1, else 1); each segment is cut into `num_shards` equal chunks
// and this rank holds chunk `shard_index` of every segment, concatenated. num_shards == 1: the whole tensor.
// Tensor-parallel shards are cut over the TP group (routed experts: the expert-TP group), chunk index = group rank.
struct ParamShard {
  int dim = 0;
  int segments = 1;
  int num_shards = 1;
  int shard_index = 0;
  std::vector<int64_t> full_shape;  // the one-process shape
};

struct Param {
  std::string name;
  Tensor value;  // fp32, MemCategory::kParams
  Tensor grad;   // fp32, MemCategory::kGrads, same shape; backward accumulates into it
  InitKind init = InitKind::kNormal;
  bool no_weight_decay = false;  // biases and norm weights, as Megatron
  ParamShard shard;              // this rank's slice of the one-process tensor
  bool is_expert = false;        // routed-expert parameter: gradient reduced over expert-DP, sharded over expert-TP
  // Replicated over TP, but each TP rank's backward only sees part of the tokens or heads (sequence-parallel
  // norms and row-parallel biases, the router, q/k norms): the gradient is summed over TP before the DP reduction.
  bool grad_sum_over_tp = false;
  // `grad` is known to hold only zeros: set by DistributedDataParallel::zero_grad (and GPTModel::zero_grad), cleared
  // by the grouped experts' backward, whose weight gradients then write instead of adding (sparing a read of every
  // touched expert's gradient in the first micro-batch). Nothing else reads it; a stale false only costs that read.
  bool grad_zero = false;
  // The module whose backward completes this gradient (the overlap hooks): -1 the embedding, 0..L-1 the decoder
  // layers, L the final norm and output layer.
  int module = -1;
  // The tied word embedding under pipeline parallelism: the first stage's embedding and the last stage's output
  // weight are two copies; their gradients are summed over the embedding group after the data-parallel reduction
  // (Megatron's _allreduce_word_embedding_grads), each in a bucket of its own so distributed-optimizer shards line up.
  bool sum_over_embedding_group = false;
  // The last stage's copy of that weight: left out of the gradient norm, which counts the first stage's.
  bool pipeline_copy = false;
  // The weight of a ColumnParallelLinear / RowParallelLinear: a GEMM the FP8 / FP4 recipes quantize when it runs in
  // a decoder layer (the output layer runs outside every layer's quantization).
  bool linear_weight = false;
  // Linear weights of decoder layers that run quantized (--fp8-format / --fp4-format, outside
  // --first-last-layers-bf16): how the layer's GEMMs quantize this weight row-wise (quant::make_spec(recipe, element,
  // Role::kWeight)). The blocks are those of this rank's local [rows, cols] tensor: a tensor-parallel shard is
  // quantized on its own, as TE's Linear quantizes each rank's weight. Unset for every other param.
  std::optional<quant::QuantSpec> weight_quantization;
  // --fp8-recipe delayed: the GEMM's scaling state (TE's fp8_meta: amax histories and scales), made by the decoder
  // layer that owns the linear layer; training state, saved in checkpoints (train/training_state.h).
  std::unique_ptr<quant::DelayedLinearScaling> delayed_scaling;

  bool tensor_sharded() const { return shard.num_shards > 1; }
};

// The model's parameters in registration order; a registered Param never moves (model/stable_store.h).
using ParamStore = StableStore<Param>;

// A zero-filled fp32 parameter and its gradient, tracked as kParams / kGrads. 1-D parameters (biases, norm
// weights) get no weight decay, as Megatron's default parameter groups.
Param make_param(std::string name, const std::vector<int64_t>& shape, InitKind init);
// A parameter holding this rank's shard of a one-process tensor of shape shard.full_shape.
Param make_sharded_param(std::string name, const ParamShard& shard, InitKind init);
// The local shape of `shard` (full_shape with dimension `dim` divided by num_shards); throws std::invalid_argument
// when a segment does not divide evenly.
std::vector<int64_t> shard_shape(const ParamShard& shard);
// Flat index in the one-process tensor of flat local element `local_index`.
int64_t full_index(const ParamShard& shard, int64_t local_index);

// The parameter named `name`; throws std::logic_error when it was not registered.
Param* find_param(ParamStore& params, const std::string& name);

// Fills `param.value` from the counter RNG keyed by (seed, name, element index): N(0, std) for kNormal,
// N(0, std / sqrt(2 * num_layers)) for kScaledNormal (Megatron's output-layer init for linear_proj / fc2).
// A shard draws the elements of its place in the one-process tensor, so every layout starts from the same model.
void init_param(Param& param, uint64_t seed, double std, int64_t num_layers);

}  // namespace moecore
