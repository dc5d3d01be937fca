// The test drivers' copy of a model's state: every parameter and buffer by name, as fp32 values (the one-process
// model a training run gathers on rank 0).
#pragma once

#include <map>
#include <string>
#include <vector>

#include "moecore/model/gpt_model.h"

namespace moecore::test {

inline std::map<std::string, std::vector<float>> model_tensors(const GPTModel& model) {
  std::map<std::string, std::vector<float>> tensors;
  for (const Param& p : model.params()) {
    const auto v = p.value.span<float>();
    tensors[p.name].assign(v.begin(), v.end());
  }
  for (const Buffer& b : model.named_buffers()) {
    const auto v = b.value.span<float>();
    tensors[b.name].assign(v.begin(), v.end());
  }
  return tensors;
}

}  // namespace moecore::test
