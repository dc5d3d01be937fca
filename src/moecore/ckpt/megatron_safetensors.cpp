#include "moecore/ckpt/megatron_safetensors.h"

#include <set>
#include <stdexcept>

namespace moecore {

void save_megatron_safetensors(const GPTModel& model, const std::string& path, const SafetensorsMetadata& metadata) {
  std::vector<NamedTensor> tensors;
  tensors.reserve(model.params().size());
  for (const Param& p : model.params()) tensors.emplace_back(p.name, p.value);
  write_safetensors(path, tensors, metadata);
}

void load_megatron_safetensors(GPTModel& model, const std::string& path) {
  const SafetensorsFile file = read_safetensors(path);
  std::set<std::string> expected;
  for (Param& p : model.params()) {
    expected.insert(p.name);
    if (!file.contains(p.name)) throw std::runtime_error(path + ": missing parameter '" + p.name + "'");
    const Tensor& stored = file.at(p.name);
    if (stored.shape() != p.value.shape()) {
      throw std::runtime_error(path + ": parameter '" + p.name + "' has shape " + stored.shape_str() +
                               ", the model expects " + p.value.shape_str());
    }
    p.value.copy_from(to_float32(stored));
  }
  for (const auto& [name, unused] : file.tensors) {
    if (!expected.contains(name)) throw std::runtime_error(path + ": tensor '" + name + "' is not a model parameter");
  }
}

}  // namespace moecore
