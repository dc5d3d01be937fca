// The model a plan is made for: train's ModelConfig with the padded vocabulary. Multi-latent attention and
// multi-token prediction are the model's own (config.mla, q_lora_rank 0 for Megatron's None; config.mtp_num_layers,
// which holds the flags' depths also where a --pipeline-model-parallel-layout places them on stages of their own:
// moecore's engine does not run such stages, so train's parse of that layout gets none).
#pragma once

#include "moecore/model/config.h"

namespace moecore::plan {

struct PlanModel {
  // Shapes as train parses them; vocab_size is the padded vocabulary (Megatron's padded_vocab_size).
  ModelConfig config;
};

}  // namespace moecore::plan
