// Trainer-facing data API: builds Megatron's train/valid/test datasets from the data flags and serves
// micro-batches by global sample index. Samples are read sequentially from the (already shuffled) datasets, as
// Megatron's MegatronPretrainingSampler does: the trainer asks for [consumed, consumed + batch) and splits a
// global batch across data-parallel ranks itself.
//
//   --data-path PREFIX                one indexed dataset (PREFIX.bin/.idx)
//   --data-path W1 P1 W2 P2 ...       a blend, weights normalized (P1 P2 ... without weights: by their sizes)
//   --mock-data                       synthetic data (mock_dataset.h); as in Megatron the split is then "1,1,1"
//   --split 969,30,1                  per-dataset train/valid/test ranges (split.h)
//   --data-cache-path DIR             where the index .npy files are cached
//                                     (default: <directory of each prefix>/cache/GPTDataset_indices)
//   --eod-mask-loss, --reset-position-ids, --reset-attention-mask
//                                     per-token loss mask, position ids and document ids of every sample, as
//                                     Megatron's _get_ltor_masks_and_position_ids (packed_sequences.h)
//
// The sample counts come from the trainer (train = train_iters * global_batch_size,
// valid = (train_iters // eval_interval + 1) * eval_iters * global_batch_size, test = eval_iters * gbs).
// A split of weight 0, or one asked for 0 samples, is not built. All problems are DataErrors of one line.
// (Megatron's own default cache is <prefix>/cache/GPTDataset_indices, a directory named after the prefix.)
//
// Ranks: every process may call build(). Cache files are identical whoever writes them and appear atomically
// (temporary + rename, the description last), so concurrent builds are safe; letting rank 0 build first and
// the others load after a barrier, as Megatron does, only saves work. get_batch is const and thread-safe.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "moecore/data/blended_dataset.h"
#include "moecore/data/gpt_dataset.h"
#include "moecore/data/packed_sequences.h"
#include "moecore/data/split.h"

namespace moecore {

struct DataOptions {
  std::vector<std::string> data_path;  // --data-path (entries may also hold several space-separated words)
  bool mock_data = false;              // --mock-data
  std::string split = "969,30,1";      // --split
  int64_t seq_length = 0;              // --seq-length
  uint64_t seed = 1234;                // --seed (must fit uint32, as numpy's RandomState requires)
  std::string data_cache_path;         // --data-cache-path
  bool eod_mask_loss = false;          // --eod-mask-loss: loss_mask = 0 where the input token is EOD
  bool reset_position_ids = false;     // --reset-position-ids: positions restart at 0 after every EOD
  bool reset_attention_mask = false;   // --reset-attention-mask: a new document id after every EOD
  int32_t eod_id = 0;                  // the tokenizer's end-of-document id
  int64_t vocab_size = 0;              // the model's (padded) vocabulary: every token id must be below it
  int64_t mock_num_sequences = 10000;  // --mock-data sizes (mock_dataset.h)
  int32_t mock_max_sequence_length = 4096;
};

// One micro-batch, row-major B x S. Position and document ids are always filled (packed_sequences.h): 0..S-1 and
// all 0 unless --reset-position-ids / --reset-attention-mask; cu_seqlens_from_document_ids / packed_cu_seqlens turn
// the document ids into Megatron's THD cu_seqlens.
struct Batch {
  std::vector<int32_t> tokens_BS;
  std::vector<int32_t> labels_BS;  // tokens shifted left by one
  std::vector<float> loss_mask_BS;
  std::vector<int64_t> position_ids_BS;
  std::vector<int32_t> document_ids_BS;  // token q attends to k <= q of its own document only
  int64_t B = 0;
  int64_t S = 0;
};

class GPTDataProvider {
 public:
  // Builds (or loads from the cache) every split with a positive weight and a positive sample count.
  static GPTDataProvider build(const DataOptions& options, int64_t num_samples_train, int64_t num_samples_valid,
                               int64_t num_samples_test);

  bool has_split(DatasetSplit split) const;
  int64_t num_samples(DatasetSplit split) const;  // samples available (>= the number asked for); 0 if not built
  // Samples [sample_begin, sample_begin + batch_size) of the split; DataError when out of range.
  Batch get_batch(DatasetSplit split, int64_t sample_begin, int64_t batch_size) const;

  // The datasets behind a split (exactly one is non-null for a built split), for inspection and tests.
  const GPTDataset* gpt_dataset(DatasetSplit split) const;
  const BlendedDataset* blended_dataset(DatasetSplit split) const;

 private:
  struct SplitData {
    std::shared_ptr<const GPTDataset> single;
    std::shared_ptr<const BlendedDataset> blended;
  };
  DataOptions options_;
  SplitData splits_[kNumDatasetSplits];
};

}  // namespace moecore
