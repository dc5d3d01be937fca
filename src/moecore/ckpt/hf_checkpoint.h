// HuggingFace export/import of GPT models: config.json + model.safetensors (+ generation_config.json).
// Dense models: LlamaForCausalLM ("llama") or, with --qk-layernorm, Qwen3ForCausalLM ("qwen3").
// MoE models (--num-experts): MixtralForCausalLM ("mixtral"), Qwen3MoeForCausalLM ("qwen3_moe"), or moecore's own
// "moecore_moe" for what HF's classes cannot compute (e.g. a DeepSeek-V3-like config without MLA). Models with
// multi-latent attention: DeepseekV3ForCausalLM ("deepseek_v3", hf_deepseek_v3.h: the MLA tensors one to one as
// P self_attn.{q_a_proj, q_a_layernorm, q_b_proj (or q_proj), kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj}
// <-> M self_attention.{linear_q_down_proj, q_layernorm, linear_q_up_proj (linear_q_proj), linear_kv_down_proj,
// kv_layernorm, linear_kv_up_proj, linear_proj}, the MoE layers as qwen3_moe's names plus shared experts and
// e_score_correction_bias).
//
// Name mapping (layer i; P = "model.layers.{i}.", M = "decoder.layers.{i}."):
//   model.embed_tokens.weight              embedding.word_embeddings.weight
//   P input_layernorm.weight               M input_layernorm.weight
//   P self_attn.{q,k,v}_proj.{weight,bias} M self_attention.linear_qkv.{weight,bias}, rows split per query group g:
//                                          [g's N/G query heads | k_g | v_g], d rows each
//   P self_attn.o_proj.{weight,bias}       M self_attention.linear_proj.{weight,bias}
//   P self_attn.{q,k}_norm.weight          M self_attention.{q,k}_layernorm.weight    (qwen3, qwen3_moe, moecore_moe
//                                                                                       with qk_layernorm)
//   P post_attention_layernorm.weight      M pre_mlp_layernorm.weight
//   dense layer:
//   P mlp.{gate,up}_proj.{weight,bias}     M mlp.linear_fc1.{weight,bias} rows [0, F) and [F, 2F)
//   P mlp.down_proj.{weight,bias}          M mlp.linear_fc2.{weight,bias}
//   MoE layer (X = "block_sparse_moe." for mixtral, "mlp." otherwise; Fe = --moe-ffn-hidden-size):
//   P X gate.{weight,bias}                 M mlp.router.{weight,bias}                       [E, H]
//   P X experts.{e}.w1 / w3 .weight        M mlp.experts.local_experts.{e}.linear_fc1.weight rows [0, Fe) / [Fe, 2Fe)
//   P X experts.{e}.w2.weight              M mlp.experts.local_experts.{e}.linear_fc2.weight  (mixtral)
//   P X experts.{e}.{gate,up}_proj.{w,b}   M mlp.experts.local_experts.{e}.linear_fc1.{w,b} rows [0, Fe) / [Fe, 2Fe)
//   P X experts.{e}.down_proj.{w,b}        M mlp.experts.local_experts.{e}.linear_fc2.{w,b}   (qwen3_moe, moecore_moe)
//   P X shared_experts.{gate,up}_proj.weight M mlp.shared_experts.linear_fc1.weight rows [0, S) / [S, 2S) (moecore_moe;
//   P X shared_experts.down_proj.weight    M mlp.shared_experts.linear_fc2.weight       names as DeepSeek-V3's HF
//   files) P X shared_expert_gate.weight          M mlp.shared_experts.gate_weight [1, H]      (moecore_moe;
//   Qwen2-MoE's name) model.norm.weight                      decoder.final_layernorm.weight lm_head.weight
//   output_layer.weight (absent when tied: tie_word_embeddings)
// Biases exist iff --add-bias-linear: llama's attention_bias (q, k, v and o) and mlp_bias; qwen3 has no MLP biases,
// so a qwen3-style model must have add_bias_linear off; mixtral and qwen3_moe have no router/expert biases either.
//
// config.json of the MoE types (besides the llama fields: hidden_size, num_attention_heads, head_dim, rope_theta, ...):
//   mixtral:     intermediate_size = Fe, num_local_experts, num_experts_per_tok, router_aux_loss_coef,
//                router_jitter_noise (= --moe-input-jitter-eps; training only, and HF also feeds the jittered
//                input to the experts), output_router_logits false, sliding_window null.
//                HF routes softmax over all experts -> top-k -> renormalised over the k, which equals Megatron's
//                default post-softmax top-k; every layer must be MoE, no shared experts, no capacity factor.
//   qwen3_moe:   intermediate_size = dense F, moe_intermediate_size = Fe, num_experts, num_experts_per_tok,
//                norm_topk_prob (true = post-softmax, false = --moe-router-pre-softmax: softmax, top-k, no
//                renormalisation), decoder_sparse_step 1, mlp_only_layers = the dense layers, router_aux_loss_coef.
//   moecore_moe: architectures ["MoecoreMoeForCausalLM"], which HF does not know (it refuses to load it: no MLA-less
//                DeepSeek-V3 exists there). The llama fields plus mlp_bias, qk_layernorm, intermediate_size = F,
//                moe_intermediate_size, num_experts, num_experts_per_tok, mlp_only_layers (informational).
//   All three:   "moecore_moe_config", every MoEConfig field under its Megatron flag name (hf_moe_config.h). For
//                moecore_moe it is authoritative (sigmoid/sqrtsoftplus scores, groups, scaling factor, capacity,
//                shared experts, ...); HF ignores it; for mixtral/qwen3_moe it brings back only the training-only
//                settings (load-balancing types and coefficients, z-loss, router dtype, jitter, bias update rate,
//                grouped GEMM, dense --ffn-hidden-size of an all-MoE mixtral), the architecture coming from HF's
//                fields.
//   router_aux_loss_coef is the coefficient of the first aux_loss / seq_aux_loss / global_aux_loss type (0 if none).
// The expert-bias buffer (--moe-router-enable-expert-bias, moecore_moe only) travels as
// model.layers.{i}.mlp.gate.e_score_correction_bias [E] in fp32 (DeepSeek-V3's name).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "moecore/ckpt/safetensors.h"
#include "moecore/model/config.h"
#include "moecore/model/gpt_model.h"

namespace moecore {

struct HfExportInfo {
  int64_t bos_token_id = 50256;  // GPT-2's <|endoftext|> (Megatron's eod) unless the tokenizer says otherwise
  int64_t eos_token_id = 50256;
  DType dtype = DType::kF32;  // weights in model.safetensors: kF32 or kBF16 (config.json's torch_dtype follows)
  // "" picks automatically: dense -> qwen3 (qk-layernorm) or llama; MoE -> qwen3_moe (qk-layernorm, if it fits), else
  // mixtral if it fits, else moecore_moe. Naming a type forces it (ConfigError naming the obstacle if it cannot).
  std::string model_type;
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

// The model_type an export writes (see HfExportInfo::model_type); throws ConfigError
// "HF export supports llama/qwen3-style models (RMSNorm, SwiGLU, RoPE); this model has X" for a model none can hold,
// "HF export as mixtral cannot represent X" when the requested type does not fit.
std::string hf_model_type(const ModelConfig& config, const std::string& requested = "");

// Why an export cannot write DIR, or "" when it can: DIR and DIR.tmp must be absent or folders holding only files an
// export writes (an earlier export is replaced whole; a folder with other files is never mixed into), and DIR's
// parent folder must exist (or be creatable) and take new files. export_hf throws
// std::runtime_error("HF export: " + problem).
std::string hf_export_dir_problem(const std::string& dir);

// Writes DIR/config.json, DIR/generation_config.json and DIR/model.safetensors into DIR.tmp, then swaps it in for
// DIR, so a failure leaves any earlier export intact. Refuses to replace a DIR holding files it did not write. The
// Multi-Token Prediction depths (mtp.*) are left out: the export is the main model.
void export_hf(const GPTModel& model, const HfExportInfo& info, const std::string& dir);

// The ModelConfig described by DIR/config.json (model_type llama, qwen3, mixtral, qwen3_moe or moecore_moe); throws
// ConfigError naming the file and the first field it cannot represent.
ModelConfig read_hf_config(const std::string& dir, const HfImportOptions& options = {});

// The model_type of DIR/config.json, after the checks read_hf_config makes.
std::string read_hf_model_type(const std::string& dir);

// A model built from DIR/config.json with weights from DIR/model.safetensors (or the shards listed in
// DIR/model.safetensors.index.json), any floating dtype converted to fp32: load_state from hf_state_source
// (hf_state_source.h) into the new model's parameters and buffers.
std::unique_ptr<GPTModel> load_hf(const std::string& dir, const HfImportOptions& options = {});

}  // namespace moecore
