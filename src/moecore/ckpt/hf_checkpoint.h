// HuggingFace export/import of dense GPT models as LlamaForCausalLM ("llama") or, with --qk-layernorm,
// Qwen3ForCausalLM ("qwen3"): config.json + model.safetensors (+ generation_config.json).
//
// Name mapping (layer i; P = "model.layers.{i}.", M = "decoder.layers.{i}."):
//   model.embed_tokens.weight              embedding.word_embeddings.weight
//   P input_layernorm.weight               M input_layernorm.weight
//   P self_attn.{q,k,v}_proj.{weight,bias} M self_attention.linear_qkv.{weight,bias}, rows split per query group g:
//                                          [g's N/G query heads | k_g | v_g], d rows each
//   P self_attn.o_proj.{weight,bias}       M self_attention.linear_proj.{weight,bias}
//   P self_attn.{q,k}_norm.weight          M self_attention.{q,k}_layernorm.weight        (qwen3)
//   P post_attention_layernorm.weight      M pre_mlp_layernorm.weight
//   P mlp.{gate,up}_proj.{weight,bias}     M mlp.linear_fc1.{weight,bias} rows [0, F) and [F, 2F)
//   P mlp.down_proj.{weight,bias}          M mlp.linear_fc2.{weight,bias}
//   model.norm.weight                      decoder.final_layernorm.weight
//   lm_head.weight                         output_layer.weight (absent when tied: tie_word_embeddings)
// Biases exist iff --add-bias-linear: llama's attention_bias (q, k, v and o) and mlp_bias; qwen3 has no MLP biases,
// so a qwen3-style model must have add_bias_linear off.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "moecore/ckpt/megatron_safetensors.h"
#include "moecore/model/config.h"
#include "moecore/model/gpt_model.h"

namespace moecore {

struct HfExportInfo {
  int64_t bos_token_id = 50256;  // GPT-2's <|endoftext|> (Megatron's eod) unless the tokenizer says otherwise
  int64_t eos_token_id = 50256;
  DType dtype = DType::kF32;  // weights in model.safetensors: kF32 or kBF16 (config.json's torch_dtype follows)
  // GPT-2 BPE files: when set, copied in as vocab.json / merges.txt with a tokenizer_config.json naming
  // GPT2Tokenizer, so the directory carries its tokenizer (HF's GPT2Tokenizer and `moecore generate` read them).
  std::string gpt2_vocab_file;
  std::string gpt2_merge_file;
};

struct HfImportOptions {
  int64_t seq_length = 0;           // 0: the config's max_position_embeddings
  double hidden_dropout = 0.0;      // HF configs carry no hidden dropout
  double attention_dropout = -1.0;  // < 0: the config's attention_dropout (0 when absent)
  uint64_t seed = 0;                // GPTModel init seed; every parameter is then overwritten
};

// "llama" or "qwen3" for a model HF can represent; otherwise throws ConfigError
// "HF export supports llama/qwen3-style models (RMSNorm, SwiGLU, RoPE); this model has X".
std::string hf_model_type(const ModelConfig& config);

// Writes DIR/config.json, DIR/generation_config.json and DIR/model.safetensors into DIR.tmp, then swaps it in for
// DIR, so a failure leaves any earlier export intact. Refuses to replace a DIR holding files it did not write.
void export_hf(const GPTModel& model, const HfExportInfo& info, const std::string& dir);

// The ModelConfig described by DIR/config.json (model_type llama or qwen3); throws ConfigError naming the file and the
// first field it cannot represent.
ModelConfig read_hf_config(const std::string& dir, const HfImportOptions& options = {});

// A model built from DIR/config.json with weights from DIR/model.safetensors (or the shards listed in
// DIR/model.safetensors.index.json), any floating dtype converted to fp32.
std::unique_ptr<GPTModel> load_hf(const std::string& dir, const HfImportOptions& options = {});

}  // namespace moecore
