// A HuggingFace checkpoint folder as a StateSource: the import path of `load_hf` and of training that starts from an
// HF model (`--load HF_DIR`).
#pragma once

#include <memory>
#include <string>

#include "moecore/ckpt/state_source.h"
#include "moecore/model/config.h"

namespace moecore {

// DIR (config.json + model.safetensors, or the shards DIR/model.safetensors.index.json lists) as a source whose keys
// are exactly the parameter and buffer names of a one-process GPTModel built from `config` (model_state_keys.h), with
// their global shapes, in fp32. Each key's HF tensors are found by the name and row mapping of hf_checkpoint.h (the
// export's, hf_layout.h; the layout's MoE names follow DIR/config.json's model_type): the fused qkv rows are gathered
// per query group from q/k/v_proj, SwiGLU's fc1 from gate_proj (w1) and up_proj (w3), the expert-bias buffer from
// mlp.gate.e_score_correction_bias. A tied model reads no lm_head (one in the file is ignored, as HF does).
// Values of any floating dtype (F32, F16, BF16, F64) are converted to fp32; each key's tensors are read from their
// files when the key is loaded (only those tensors' bytes), so the model is never held twice.
// Checked here, before anything is read: every HF tensor the mapping needs exists with the shape `config` implies
// (std::runtime_error "DIR: missing tensor 'NAME'" / "FILE: tensor 'NAME' has shape [..], the model needs [..]"), no
// tensor in the files is left unused (rotary inv_freq buffers of older exports excepted), and a key of `config` the
// model_type cannot hold (e.g. LayerNorm biases in a llama folder) is a ConfigError naming it.
// `config` should first be compared with DIR/config.json (check_hf_config_matches); load_hf reads it from there.
std::unique_ptr<GlobalTensorSource> hf_state_source(const std::string& dir, const ModelConfig& config);

// Compares the model-shape fields of DIR/config.json (as read_hf_config reads them) with `config` (the training
// flags) and throws ConfigError with one line naming the config.json field and the flag for the first disagreement,
// e.g. "HF config.json hidden_size 64 does not match --hidden-size 128". Compared: layers, hidden size, heads, query
// groups, kv channels, the vocabulary (config.json's vocab_size is the embedding's row count: an export from moecore
// writes the padded vocabulary, so it must equal config.vocab_size, the padded vocabulary), RMSNorm and its epsilon,
// SwiGLU, RoPE (base, whole head), q/k norms, linear biases, tied embeddings; MoE: number of experts, top-k, expert
// and shared-expert FFN sizes, the shared-expert gate, the layer pattern, the score function, pre-softmax, top-k
// scaling factor, group-limited routing and the expert-bias buffer; the dense FFN size when a layer is dense.
// Training-only settings (dropout, sequence length, load balancing, capacity, jitter, dispatcher) are not compared.
void check_hf_config_matches(const std::string& dir, const ModelConfig& config);

}  // namespace moecore
