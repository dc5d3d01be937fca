// The tiny models the model-level tests build by hand (ModelConfig, no flags): a dense GPT, its llama-style MoE
// variant, and FP8 delayed scaling for the latter. Each test sets on top the few fields it is about.
#pragma once

#include <cstdint>

#include "moecore/model/config.h"

namespace moecore::test {

// 2 layers, hidden 32 (4 heads of 8, no GQA), ffn 64, sequence SEQ_LENGTH over 16 positions, vocabulary 64, no
// biases, no dropout; otherwise Megatron's defaults (LayerNorm, GeLU, learned absolute positions, tied output).
inline ModelConfig tiny_dense_config(const int64_t seq_length) {
  ModelConfig c;
  c.num_layers = 2;
  c.hidden_size = 32;
  c.ffn_hidden_size = 64;
  c.num_attention_heads = 4;
  c.num_query_groups = 4;
  c.kv_channels = 8;
  c.seq_length = seq_length;
  c.max_position_embeddings = 16;
  c.vocab_size = 64;
  c.add_bias_linear = false;
  c.attention_dropout = 0.0;
  c.hidden_dropout = 0.0;
  return c;
}

// tiny_dense_config made llama-style (RMSNorm, SwiGLU, RoPE), layer 0 dense and layer 1 MoE: 4 experts of width 32,
// top-2, grouped GEMM.
inline ModelConfig tiny_moe_config(const int64_t seq_length) {
  ModelConfig c = tiny_dense_config(seq_length);
  c.normalization = Normalization::kRMSNorm;
  c.activation = Activation::kSwiGLU;
  c.position_embedding_type = PositionEmbedding::kRope;
  c.moe.num_experts = 4;
  c.moe.ffn_hidden_size = 32;
  c.moe.topk = 2;
  c.moe.grouped_gemm = true;
  c.moe.moe_layer_pattern = {false, true};
  return c;
}

// FP8 delayed scaling (--fp8-recipe delayed, --fp8-format hybrid) with an amax history of HISTORY and ALGO.
inline quant::QuantizedLinearConfig fp8_delayed(const int64_t history, const quant::AmaxComputeAlgo algo) {
  quant::QuantizedLinearConfig q;
  q.recipe = quant::Recipe::kDelayed;
  q.format = quant::Fp8Format::kHybrid;
  q.delayed = {history, algo, 0};
  return q;
}

}  // namespace moecore::test
