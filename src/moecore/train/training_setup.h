// Building what a training run needs before its first iteration: the vocabulary (tokenizer, padded size), the
// datasets with Megatron's sample counts, the model and its optimizer.
#pragma once

#include <cstdint>
#include <iosfwd>
#include <memory>

#include "moecore/config/arguments.h"
#include "moecore/data/data_loader.h"
#include "moecore/model/gpt_model.h"
#include "moecore/optim/ddp.h"
#include "moecore/optim/distributed_optimizer.h"
#include "moecore/parallel/parallel_state.h"
#include "moecore/tokenizer/tokenizer.h"

namespace moecore {

struct Vocabulary {
  std::unique_ptr<Tokenizer> tokenizer;  // null with --vocab-size and no --tokenizer-type
  int32_t eod_id = 0;
  int64_t unpadded_size = 0;
  int64_t padded_size = 0;  // padded_vocab_size(): the model's vocabulary
};

// The tokenizer of --tokenizer-type, or --vocab-size alone (EOD = the last id); ConfigError when neither is given.
Vocabulary build_vocabulary(const TrainingArgs& args);

// `args` with the model's vocabulary set to the padded size, validated.
TrainingArgs with_padded_vocabulary(const TrainingArgs& args, const Vocabulary& vocabulary);

// Samples asked of each split, as Megatron's get_train_valid_test_num_samples: train = train_iters x gbs,
// valid = (train_iters // eval_interval + 1) x eval_iters x gbs (the periodic evaluations and the one after training;
// without --eval-interval only the one after training, where Megatron's formula is undefined), test = eval_iters x
// gbs.
struct SplitSampleCounts {
  int64_t train = 0;
  int64_t valid = 0;
  int64_t test = 0;
};
SplitSampleCounts split_sample_counts(const TrainingArgs& args);

// The datasets of `run_args` (its padded vocabulary) with split_sample_counts; one log line.
GPTDataProvider build_data(const TrainingArgs& run_args, int32_t eod_id, std::ostream& log);

// The model with its data-parallel gradient buffers and (distributed) AdamW, wired together.
struct ModelAndOptimizer {
  std::unique_ptr<GPTModel> model;
  std::unique_ptr<DistributedDataParallel> ddp;
  std::unique_ptr<DistributedAdamW> optimizer;
};
ModelAndOptimizer build_model_and_optimizer(const TrainingArgs& run_args, const parallel::ParallelState& parallel);

// Parameters of the one-process model: every shard's full tensor, every EP rank's experts, every pipeline stage's
// layers (a collective over the pipeline).
double one_process_parameter_count(const GPTModel& model);

}  // namespace moecore
