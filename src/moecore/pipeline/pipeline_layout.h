// Megatron's pipeline split: which global decoder layers each pipeline rank and virtual stage (model chunk) holds,
// and which chunk holds the embedding and which the loss. Pure logic, no MPI.
//
// Sources (Megatron-LM): megatron/training/arguments.py validate_args (at most one VPP source, the VPP size, the
// divisibility checks, the interleaved schedule's PP rule), megatron/core/transformer/transformer_config.py
// __post_init__ (the modes are exclusive, the uneven split's checks), transformer_block.py get_num_layers_to_build,
// transformer_layer.py get_transformer_layer_offset, pipeline_parallel_layer_layout.py (the layout string).
//
// Modes (exclusive):
//   uniform   num_layers (+1 with --account-for-embedding-in-pipeline-split, +1 with
//             --account-for-loss-in-pipeline-split) split evenly over PP ranks, then over the VPP chunks of each
//             rank; the accounted embedding / loss takes one layer's place in the first / last chunk.
//   uneven    --decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers fix the first / last rank's
//             count, the middle ranks share the rest evenly; with VPP every count splits evenly over the chunks.
//   layout    --pipeline-model-parallel-layout, e.g. "Et|(tt|)*2,tL": one '|'-separated stage per chunk, stage i
//             on (pp = i % PP, virtual stage = i / PP); 't' a decoder layer, 'E' / 'L' mark the embedding / loss.
// Decoder layers are numbered virtual-stage-major, then pp rank: chunk (r, v) holds the layers after every chunk
// (r', v') with v' < v, or v' == v and r' < r.
//
// The embedding is always on (pp 0, virtual stage 0) and the loss (final norm, output layer, cross-entropy) on
// (PP-1, VPP-1), layout or not: Megatron builds each chunk with pre_process = first pp rank and first virtual stage,
// post_process = last and last (megatron/training/training.py get_model, models/gpt.py). A layout's E and L only
// count in the split; validation makes E the first and L the last entry in layer order, so they sit in those chunks
// unless the chunks before E (after L) are empty, as in "|Et|tL".
//
// Every error is a LayoutError with one line naming the flag, with Megatron's message where it has one.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "moecore/parallel/rank_generator.h"

namespace moecore {

// What is split: the model's decoder layers (and Multi-Token Prediction depths) over the pipeline ranks.
struct PipelineShape {
  int64_t num_layers = 0;                    // --num-layers
  int64_t pipeline_model_parallel_size = 1;  // --pipeline-model-parallel-size
  int64_t mtp_num_layers = 0;  // --mtp-num-layers: every depth on the loss stage, or where a layout's 'm's are
};

// The flags that choose the split (Megatron's names and defaults).
struct PipelineSplitFlags {
  std::optional<int64_t> decoder_first_pipeline_num_layers;      // --decoder-first-pipeline-num-layers
  std::optional<int64_t> decoder_last_pipeline_num_layers;       // --decoder-last-pipeline-num-layers
  bool account_for_embedding_in_pipeline_split = false;          // --account-for-embedding-in-pipeline-split
  bool account_for_loss_in_pipeline_split = false;               // --account-for-loss-in-pipeline-split
  std::optional<std::string> pipeline_model_parallel_layout;     // --pipeline-model-parallel-layout
  std::optional<int64_t> num_layers_per_virtual_pipeline_stage;  // --num-layers-per-virtual-pipeline-stage
  std::optional<int64_t> num_virtual_stages_per_pipeline_rank;   // --num-virtual-stages-per-pipeline-rank
  // Megatron's overlap_p2p_comm (default true; --no-overlap-p2p-communication clears it). Here it only selects the
  // interleaved schedule's size rule: VPP > 1 needs PP > 1 with it, PP > 2 without.
  bool overlap_p2p_comm = true;
};

// One model chunk: the decoder layers [first_layer, first_layer + num_layers) of pipeline rank pp_rank, virtual
// stage virtual_stage.
struct PipelineStage {
  int pp_rank = 0;
  int virtual_stage = 0;
  int64_t first_layer = 0;     // global number of its first decoder layer (where it would start if it has none)
  int64_t num_layers = 0;      // 0 for an empty stage of a layout
  bool has_embedding = false;  // Megatron's pre_process
  bool has_loss = false;       // Megatron's post_process: final norm, output layer and loss
  int64_t mtp_layers = 0;      // Multi-Token Prediction depths (all of them, or none)

  int64_t end_layer() const { return first_layer + num_layers; }
};

class PipelineLayout {
 public:
  // Validates the flags as Megatron does and computes every chunk; throws LayoutError (one line) otherwise.
  PipelineLayout(const PipelineShape& shape, const PipelineSplitFlags& flags);

  const PipelineShape& shape() const { return shape_; }
  const PipelineSplitFlags& flags() const { return flags_; }
  int64_t num_layers() const { return shape_.num_layers; }
  int pipeline_size() const { return pipeline_size_; }
  // Virtual stages per pipeline rank; 1 without virtual pipelining (Megatron's None).
  int virtual_pipeline_size() const { return virtual_pipeline_size_; }
  // More than one virtual stage per rank: Megatron's interleaved schedule.
  bool interleaved() const { return virtual_pipeline_size_ > 1; }

  // Every chunk, pp rank-major then virtual stage: stages()[pp * VPP + v].
  const std::vector<PipelineStage>& stages() const { return stages_; }
  // Throws LayoutError when (pp_rank, virtual_stage) is outside PP x VPP.
  const PipelineStage& stage(int pp_rank, int virtual_stage) const;
  // Megatron's get_num_layers_to_build / get_transformer_layer_offset for one chunk.
  int64_t num_layers_to_build(const int pp_rank, const int virtual_stage) const {
    return stage(pp_rank, virtual_stage).num_layers;
  }
  int64_t layer_offset(const int pp_rank, const int virtual_stage) const {
    return stage(pp_rank, virtual_stage).first_layer;
  }
  // The chunk holding global decoder layer `layer`; throws LayoutError outside [0, num_layers).
  const PipelineStage& stage_of_layer(int64_t layer) const;

 private:
  void split_by_layout(const std::vector<std::string>& cells);
  void split_uneven();
  void split_uniform();

  PipelineShape shape_;
  PipelineSplitFlags flags_;
  int pipeline_size_ = 1;
  int virtual_pipeline_size_ = 1;
  std::vector<PipelineStage> stages_;
};

// Megatron's PipelineParallelLayerLayout.parse_str_to_list: delete every ',', expand each "(group)*n" (no nesting,
// the group ends at the first ')'), then each "x*n" (one character), one left-to-right pass each as Python's re.sub,
// and split on '|'. Returns one string per stage, each of the characters E (embedding), L (loss), t (decoder layer),
// m (multi-token-prediction layer); an empty stage ("||") is an empty string. Throws LayoutError naming
// --pipeline-model-parallel-layout on any other character, or when the expansion passes 2^20 characters.
std::vector<std::string> parse_pipeline_layout(const std::string& layout);

}  // namespace moecore
