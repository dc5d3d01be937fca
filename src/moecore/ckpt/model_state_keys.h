// The keys, global shapes and initialisers of the state a one-process GPTModel built from a ModelConfig holds
// (parameters, then buffers; add_model_state's keys), computed from the config alone: sources that produce a model's
// tensors on demand (HF import, upcycling) list their keys without building a second model.
// tests/unit/ckpt_hf_state_source_test.cpp checks it against add_model_state of built models.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "moecore/model/config.h"
#include "moecore/model/param.h"

namespace moecore {

struct ModelStateKey {
  std::string key;
  std::vector<int64_t> global_shape;
  InitKind init = InitKind::kNormal;  // as GPTModel initialises it (init_param); buffers: kZeros
  bool buffer = false;
};

// In GPTModel's registration order: parameters layer by layer, then the buffers.
std::vector<ModelStateKey> model_state_keys(const ModelConfig& config);

}  // namespace moecore
