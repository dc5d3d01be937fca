#include <exception>
#include <filesystem>
#include <iostream>
#include <optional>
#include <string>
#include <vector>

#include "moecore/ckpt/hf_checkpoint.h"
#include "moecore/cli/commands.h"
#include "moecore/cli/generate_args.h"
#include "moecore/tokenizer/tokenizer.h"
#include "moecore/train/generate.h"

int run_generate(int argc, char** argv) {
  try {
    const moecore::GenerateArgs args = moecore::parse_generate_args(std::vector<std::string>(argv + 1, argv + argc));
    if (args.help_requested) {
      std::cout << moecore::generate_usage();
      return 0;
    }
    const auto model = moecore::load_hf(args.load_dir);
    const auto tokenizer = moecore::build_tokenizer(moecore::generate_tokenizer_options(args));
    moecore::check_tokenizer_against_model(args, tokenizer->vocab_size(), model->config().vocab_size);
    moecore::check_sampling_against_vocabulary(args, tokenizer->vocab_size());
    const std::vector<int32_t> prompt = tokenizer->tokenize(args.prompt);
    moecore::check_prompt(*model, prompt);
    moecore::SamplingOptions sampling;
    sampling.max_new_tokens = args.max_new_tokens;
    sampling.temperature = args.temperature;
    sampling.top_k = args.top_k;
    sampling.seed = args.seed;
    sampling.kv_cache = args.kv_cache;
    sampling.vocab_limit = tokenizer->vocab_size();
    // The NullTokenizer's text is ids separated by spaces: the new ids follow the prompt's after one.
    std::cout << args.prompt << (args.tokenizer_type == "NullTokenizer" ? " " : "") << std::flush;
    std::optional<moecore::RoutingRecorder> recorder;
    if (!args.record_routing.empty()) {
      if (!model->config().moe.enabled()) {
        throw moecore::ConfigError("--record-routing needs a MoE model (this one has no MoE layers)");
      }
      recorder.emplace(model->config());
      sampling.routing_recorder = &*recorder;
    }
    std::vector<int32_t> produced;
    std::string printed;
    std::vector<int32_t> sequence = moecore::generate(*model, prompt, sampling, [&](const int32_t id) {
      // Print the text as it grows; byte-level BPE pieces may end mid-character, so print the new suffix.
      produced.push_back(id);
      const std::string text = tokenizer->detokenize(produced);
      std::cout << text.substr(printed.size()) << std::flush;
      printed = text;
    });
    std::cout << std::endl;
    if (recorder) {
      moecore::append_routing_record(args.record_routing, recorder->empty_recording(),
                                     recorder->finish(std::move(sequence)));
    }
    return 0;
  } catch (const std::exception& e) {
    std::cout.flush();
    std::cerr << "\nerror: " << e.what() << '\n';
    return 1;
  }
}
