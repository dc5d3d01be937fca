// The test drivers' copy of a model's state: every parameter and buffer by name, as fp32 values (the one-process
// model a training run gathers on rank 0).
#pragma once

#include <cstring>
#include <map>
#include <ostream>
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

// Two runs' losses and tensors compared bit for bit: prints each difference to `out` (the runs named `a` and `b`)
// and returns how many there are (a different number of losses or tensors, or none at all, counts as one).
inline int bit_differences(const std::vector<double>& losses_a,
                           const std::map<std::string, std::vector<float>>& tensors_a, const char* a,
                           const std::vector<double>& losses_b,
                           const std::map<std::string, std::vector<float>>& tensors_b, const char* b,
                           std::ostream& out) {
  if (losses_a.size() != losses_b.size() || losses_a.empty()) {
    out << "FAILED: " << losses_a.size() << " vs " << losses_b.size() << " losses\n";
    return 1;
  }
  int failures = 0;
  for (size_t i = 0; i < losses_a.size(); ++i) {
    if (std::memcmp(&losses_a[i], &losses_b[i], sizeof(double)) != 0) {
      out << "iteration " << i + 1 << ": lm loss " << losses_a[i] << " (" << a << ") vs " << losses_b[i] << " (" << b
          << ")\n";
      ++failures;
    }
  }
  for (const auto& [name, values] : tensors_a) {
    const auto it = tensors_b.find(name);
    if (it == tensors_b.end() || it->second.size() != values.size() ||
        std::memcmp(values.data(), it->second.data(), values.size() * sizeof(float)) != 0) {
      out << name << ": differs\n";
      ++failures;
    }
  }
  if (tensors_a.size() != tensors_b.size()) ++failures;
  return failures;
}

}  // namespace moecore::test
