// The key / value cache of incremental decoding (generation, one process): per decoder layer, what attention needs
// of every position already seen, so that each new token runs through the model as one position instead of
// re-running the whole context. Row p of a layer's cache holds position p.
//   standard attention: first = keys [capacity, G, d] (after qk-layernorm and RoPE), second = values [capacity, G, d]
//   multi-latent attention (what DeepSeek-V3's inference caches): first = the kv latent [capacity, kv_lora_rank]
//     (after kv_layernorm), second = the rotated rope key [capacity, qk_pos_emb_head_dim]; attention runs in the
//     latent space with linear_kv_up_proj absorbed (MLASelfAttention::forward_decode)
// Values are fp32 (activations are fp32 tensors, rounded to the 16-bit activation dtype where the model runs in it).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "moecore/model/config.h"
#include "moecore/tensor/tensor.h"

namespace moecore {

struct LayerKvCache {
  Tensor first_SX, second_SY;  // rows = positions; see above for what each holds

  // Writes rows of new_TX / new_TY (one per new token) at their positions.
  void write(std::span<const int64_t> positions, const Tensor& new_first_TX, const Tensor& new_second_TY);
};

class KvCache {
 public:
  // Room for `capacity` positions of one sequence in each of config.num_layers layers (the whole model).
  KvCache(const ModelConfig& config, int64_t capacity);

  int64_t capacity() const { return capacity_; }
  // Positions 0..length()-1 are cached; the next token is position length().
  int64_t length() const { return length_; }
  void clear() { length_ = 0; }
  // Called once every layer has written `count` new positions after length().
  void advance(int64_t count);
  LayerKvCache& layer(int64_t index) { return layers_.at(static_cast<size_t>(index)); }

 private:
  int64_t capacity_ = 0, length_ = 0;
  std::vector<LayerKvCache> layers_;
};

// The keys a decode step attends: positions 0..max(positions) (a new token at position p attends keys 0..p).
int64_t attended_positions(std::span<const int64_t> positions);

class GPTModel;

// Why `model` cannot decode through a KvCache exactly as its full forward computes (empty: it can). Incremental
// decoding needs the whole model in one process (no tensor, context or pipeline split: generation gathers the model
// first) and no computation whose result for a token depends on the other tokens of the forward: MoE token dropping
// (--moe-expert-capacity-factor: an expert's capacity counts the forward's tokens) and quantized linear layers
// (FP8 / FP4 scales over the whole input) are such. In fp32 the decode's numbers differ from the full forward's only
// in the last bits (a one-row GEMM and a one-query attention sum in another order; ~1e-7 relative); 16-bit
// activations (--bf16 / --fp16) would round those to whole 16-bit steps, which flip near-tied greedy picks, so they
// are refused too.
std::string kv_cache_unsupported_reason(const GPTModel& model);

}  // namespace moecore
