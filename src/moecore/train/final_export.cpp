#include "moecore/train/final_export.h"

#include <memory>
#include <ostream>
#include <vector>

#include "moecore/ckpt/hf_checkpoint.h"
#include "moecore/parallel/agreement.h"
#include "moecore/train/gather_model.h"
#include "moecore/train/generate.h"

namespace moecore {
namespace {

void export_to_hf(const TrainingArgs& args, const GPTModel& full_model, const Vocabulary& vocabulary,
                  std::ostream& log) {
  HfExportInfo info;
  info.bos_token_id = vocabulary.eod_id;
  info.eos_token_id = vocabulary.eod_id;
  if (args.tokenizer_type == "GPT2BPETokenizer") {
    info.gpt2_vocab_file = args.vocab_file;
    info.gpt2_merge_file = args.merge_file;
  }
  export_hf(full_model, info, args.export_hf_dir);
  log << "> exported HuggingFace checkpoint to " << args.export_hf_dir << std::endl;
  if (args.model.mtp_num_layers > 0 && !args.model.mla) {  // DeepSeek-V3's format (MLA) carries the depths
    log << "> the export leaves out the " << args.model.mtp_num_layers
        << " Multi-Token Prediction depth(s) (mtp.layers.*): the HF model is the main model" << std::endl;
  }
}

}  // namespace

void finish_training(const TrainingArgs& args, GPTModel& model, DistributedDataParallel& ddp,
                     const Vocabulary& vocabulary, const parallel::ParallelState& parallel,
                     const FullModelCallback& on_full_model, std::ostream& log) {
  ddp.wait_param_gather();
  const FsdpUnshardedScope unsharded(ddp, false);  // Megatron-FSDP: every unit's parameters whole
  std::unique_ptr<GPTModel> gathered;
  if (parallel.world.size() > 1) gathered = gather_full_model(model, static_cast<uint64_t>(args.seed));
  GPTModel& full_model = gathered ? *gathered : model;
  if (parallel.rank == 0 && on_full_model) on_full_model(full_model);
  if (!args.export_hf_dir.empty()) {
    // The export runs on rank 0 alone; its failure (a full disk) ends every rank alike, reported once.
    parallel::run_on_all_ranks(parallel.world, [&] {
      if (parallel.rank == 0) export_to_hf(args, full_model, vocabulary, log);
    });
  }
  if (parallel.rank != 0 || args.sample_prompt.empty()) return;
  if (!vocabulary.tokenizer) throw ConfigError("--sample-prompt needs a text tokenizer (--tokenizer-type)");
  SamplingOptions sampling;
  sampling.max_new_tokens = args.sample_tokens;
  sampling.vocab_limit = vocabulary.unpadded_size;
  const std::vector<int32_t> prompt = vocabulary.tokenizer->tokenize(args.sample_prompt);
  const std::vector<int32_t> out = generate(full_model, prompt, sampling);
  log << "> sample (greedy): " << vocabulary.tokenizer->detokenize(out) << std::endl;
}

}  // namespace moecore
