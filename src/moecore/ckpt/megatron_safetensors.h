// A GPTModel's parameters as one safetensors file under their Megatron names (fp32), e.g.
// "decoder.layers.0.self_attention.linear_qkv.weight". Used by the parity harness and the tests.
#pragma once

#include <string>

#include "moecore/ckpt/safetensors.h"
#include "moecore/model/gpt_model.h"

namespace moecore {

// Writes every parameter's value (atomically).
void save_megatron_safetensors(const GPTModel& model, const std::string& path,
                               const SafetensorsMetadata& metadata = {});

// Overwrites every parameter's value from `path` (any floating dtype, converted to fp32). The file must hold exactly
// the model's parameters with their shapes: a missing, extra or mis-shaped tensor throws std::runtime_error naming it.
void load_megatron_safetensors(GPTModel& model, const std::string& path);

}  // namespace moecore
