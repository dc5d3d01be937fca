// Fuzz harness: a HuggingFace checkpoint's config.json as `moecore generate --load` and training from an HF folder
// read it (read_hf_config: the llama, qwen3, mixtral, qwen3_moe and moecore_moe fields and moecore's MoE block,
// then ModelConfig / MoEConfig validation). A config that reads must pass check_hf_config_matches against itself, and
// the export-type choice (hf_model_type) must answer for it.
//
// Input: the config.json file.
#include <cstddef>
#include <cstdint>
#include <exception>
#include <string>

#include "fuzz_util.h"
#include "moecore/ckpt/hf_checkpoint.h"
#include "moecore/ckpt/hf_state_source.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const moecore::fuzz::ScratchDir dir("hf_config");
  moecore::fuzz::write_bytes(dir.file("config.json"), std::string_view(reinterpret_cast<const char*>(data), size));
  moecore::ModelConfig config;
  try {
    config = moecore::read_hf_config(dir.path().string());
  } catch (const std::exception& error) {
    moecore::fuzz::expected_error(error);
    return 0;
  }
  try {
    moecore::check_hf_config_matches(dir.path().string(), config);
  } catch (const std::exception& error) {
    moecore::fuzz::property_failed(std::string("a config.json that reads does not match itself: ") + error.what());
  }
  try {
    (void)moecore::hf_model_type(config);
  } catch (const std::exception& error) {
    moecore::fuzz::expected_error(error);
  }
  return 0;
}
