#include "moecore/pipeline/pipeline_layout.h"

#include <algorithm>
#include <cstddef>
#include <limits>
#include <string_view>
#include <tuple>
#include <utility>

namespace moecore {
namespace {

constexpr const char* kLayoutFlag = "--pipeline-model-parallel-layout";
constexpr const char* kFirstFlag = "--decoder-first-pipeline-num-layers";
constexpr const char* kLastFlag = "--decoder-last-pipeline-num-layers";
constexpr const char* kEmbeddingFlag = "--account-for-embedding-in-pipeline-split";
constexpr const char* kLossFlag = "--account-for-loss-in-pipeline-split";
constexpr const char* kLayersPerStageFlag = "--num-layers-per-virtual-pipeline-stage";
constexpr const char* kStagesPerRankFlag = "--num-virtual-stages-per-pipeline-rank";
constexpr const char* kPipelineSizeFlag = "--pipeline-model-parallel-size";

// Bounds that keep every count inside int / int64 (moecore's, not Megatron's: Python's integers have none).
constexpr size_t kMaxLayoutChars = size_t{1} << 20;
constexpr int64_t kMaxChunks = int64_t{1} << 20;
constexpr int64_t kMaxLayers = int64_t{1} << 40;

void require(const bool ok, const std::string& message) {
  if (!ok) throw LayoutError(message);
}

std::string str(const int64_t value) { return std::to_string(value); }

bool is_digit(const char c) { return c >= '0' && c <= '9'; }

// The repeat count of "*n" starting at text[begin] (a digit): its value and where its digits end. A count past
// kMaxLayoutChars saturates there (the expansion is then too long anyway).
std::pair<size_t, size_t> read_count(const std::string& text, size_t begin) {
  size_t value = 0;
  size_t end = begin;
  for (; end < text.size() && is_digit(text[end]); ++end) {
    value = std::min(kMaxLayoutChars + 1, value * 10 + static_cast<size_t>(text[end] - '0'));
  }
  return {value, end};
}

void append_repeated(std::string& out, const std::string_view unit, const size_t count) {
  if (!unit.empty() && count > (kMaxLayoutChars - out.size()) / unit.size()) {
    throw LayoutError(std::string(kLayoutFlag) + " expands to more than " + str(kMaxLayoutChars) + " characters");
  }
  for (size_t i = 0; i < count; ++i) out.append(unit);
}

// Bytes of the UTF-8 character starting at text[i] (1 for ASCII or a stray byte), so "x*n" repeats one character
// as Python's '.' does.
size_t utf8_length(const std::string& text, const size_t i) {
  const auto lead = static_cast<unsigned char>(text[i]);
  size_t length = lead >= 0xF0 ? 4 : lead >= 0xE0 ? 3 : lead >= 0xC0 ? 2 : 1;
  length = std::min(length, text.size() - i);
  for (size_t k = 1; k < length; ++k) {
    if ((static_cast<unsigned char>(text[i + k]) & 0xC0) != 0x80) return 1;
  }
  return length;
}

// re.sub(r'\(([^)]+)\)\*(\d+)', group * n, text): leftmost matches, one pass; the group ends at the first ')'.
std::string expand_groups(const std::string& text) {
  std::string out;
  size_t i = 0;
  while (i < text.size()) {
    if (text[i] == '(') {
      const size_t close = text.find(')', i + 1);
      if (close != std::string::npos && close > i + 1 && close + 2 < text.size() && text[close + 1] == '*' &&
          is_digit(text[close + 2])) {
        const auto [count, end] = read_count(text, close + 2);
        append_repeated(out, std::string_view(text).substr(i + 1, close - i - 1), count);
        i = end;
        continue;
      }
    }
    append_repeated(out, std::string_view(text).substr(i, 1), 1);
    ++i;
  }
  return out;
}

// re.sub(r'(.)\*(\d+)', x * n, text): one pass; '.' is any character but a newline.
std::string expand_characters(const std::string& text) {
  std::string out;
  size_t i = 0;
  while (i < text.size()) {
    const size_t length = utf8_length(text, i);
    const size_t star = i + length;
    if (text[i] != '\n' && star + 1 < text.size() && text[star] == '*' && is_digit(text[star + 1])) {
      const auto [count, end] = read_count(text, star + 1);
      append_repeated(out, std::string_view(text).substr(i, length), count);
      i = end;
      continue;
    }
    append_repeated(out, std::string_view(text).substr(i, length), 1);
    i += length;
  }
  return out;
}

std::string layer_name(const char c) {
  switch (c) {
    case 'E': return "embedding";
    case 'L': return "loss";
    case 't': return "decoder";
    default: return "mtp";
  }
}

// "--num-layers 7 + 1 (embedding) = 8": the layer count the uniform split divides, as Megatron's num_layers there.
std::string counted_layers(const PipelineShape& shape, const PipelineSplitFlags& flags, const int64_t counted) {
  std::string text = "--num-layers " + str(shape.num_layers);
  if (flags.account_for_embedding_in_pipeline_split) text += " + 1 (embedding)";
  if (flags.account_for_loss_in_pipeline_split) text += " + 1 (loss)";
  if (counted != shape.num_layers) text += " = " + str(counted);
  return text;
}

int64_t counted_layer_total(const PipelineShape& shape, const PipelineSplitFlags& flags) {
  return shape.num_layers + (flags.account_for_embedding_in_pipeline_split ? 1 : 0) +
         (flags.account_for_loss_in_pipeline_split ? 1 : 0);
}

// The flag that set the virtual pipeline size, for error messages.
std::string vpp_source(const PipelineSplitFlags& flags) {
  if (flags.pipeline_model_parallel_layout) return kLayoutFlag;
  if (flags.num_layers_per_virtual_pipeline_stage) return kLayersPerStageFlag;
  return kStagesPerRankFlag;
}

}  // namespace

std::vector<std::string> parse_pipeline_layout(const std::string& layout) {
  std::string text;
  for (const char c : layout) {
    if (c != ',') text += c;  // commas are cosmetic
  }
  text = expand_characters(expand_groups(text));
  std::vector<std::string> stages(1);
  for (size_t i = 0; i < text.size();) {
    const size_t length = utf8_length(text, i);
    const char c = text[i];
    if (c == '|') {
      stages.emplace_back();
    } else if (length == 1 && (c == 'E' || c == 'L' || c == 't' || c == 'm')) {
      stages.back() += c;
    } else {
      const size_t stage_begin = text.rfind('|', i) == std::string::npos ? 0 : text.rfind('|', i) + 1;
      const size_t stage_end = std::min(text.find('|', i), text.size());
      throw LayoutError(std::string(kLayoutFlag) + ": Invalid layer character: " + text.substr(i, length) +
                        " (stage='" + text.substr(stage_begin, stage_end - stage_begin) + "', layout_str='" + text +
                        "'), known layer characters: ['E', 'L', 't', 'm']");
    }
    i += length;
  }
  return stages;
}

PipelineLayout::PipelineLayout(const PipelineShape& shape, const PipelineSplitFlags& flags)
    : shape_(shape), flags_(flags) {
  const int64_t pp = shape.pipeline_model_parallel_size;
  require(pp >= 1, std::string(kPipelineSizeFlag) + " must be positive (got " + str(pp) + ")");
  require(pp <= kMaxChunks,
          std::string(kPipelineSizeFlag) + " " + str(pp) + " is more than moecore supports (" + str(kMaxChunks) + ")");
  require(shape.num_layers >= 1, "--num-layers must be positive (got " + str(shape.num_layers) + ")");
  require(shape.mtp_num_layers >= 0, "--mtp-num-layers must not be negative (got " + str(shape.mtp_num_layers) + ")");
  require(shape.num_layers <= kMaxLayers,
          "--num-layers " + str(shape.num_layers) + " is more than moecore supports (" + str(kMaxLayers) + ")");
  const bool first_set = flags.decoder_first_pipeline_num_layers.has_value();
  const bool last_set = flags.decoder_last_pipeline_num_layers.has_value();
  const bool accounts = flags.account_for_embedding_in_pipeline_split || flags.account_for_loss_in_pipeline_split;

  // megatron/training/arguments.py validate_args: the virtual pipeline size from at most one source.
  std::vector<std::string> vpp_sources;
  if (flags.num_layers_per_virtual_pipeline_stage) vpp_sources.emplace_back(kLayersPerStageFlag);
  if (flags.num_virtual_stages_per_pipeline_rank) vpp_sources.emplace_back(kStagesPerRankFlag);
  if (flags.pipeline_model_parallel_layout) vpp_sources.emplace_back(kLayoutFlag);
  if (vpp_sources.size() > 1) {
    std::string given;
    for (const std::string& source : vpp_sources) given += (given.empty() ? "" : " and ") + source;
    throw LayoutError(
        "No more than one of the following arguments can be set at the same time: " + std::string(kLayersPerStageFlag) +
        ", " + kStagesPerRankFlag + ", " + kLayoutFlag + " (got " + given + ")");
  }
  for (const auto& [flag, value] : {std::pair{kLayersPerStageFlag, flags.num_layers_per_virtual_pipeline_stage},
                                    std::pair{kStagesPerRankFlag, flags.num_virtual_stages_per_pipeline_rank}}) {
    require(!value || *value >= 1, std::string(flag) + " must be positive (got " + str(value.value_or(0)) + ")");
  }

  const int64_t counted = counted_layer_total(shape, flags);
  int64_t vpp = 1;
  std::vector<std::string> cells;
  if (flags.pipeline_model_parallel_layout) {
    cells = parse_pipeline_layout(*flags.pipeline_model_parallel_layout);
    const auto num_stages = static_cast<int64_t>(cells.size());
    require(num_stages % pp == 0, "The length of " + std::string(kLayoutFlag) + " must be divisible by " +
                                      kPipelineSizeFlag + " (num_stages=" + str(num_stages) +
                                      ", pipeline_model_parallel_size=" + str(pp) + ")");
    vpp = num_stages / pp;
  } else if (flags.num_layers_per_virtual_pipeline_stage) {
    require(!first_set && !last_set, "please use " + std::string(kStagesPerRankFlag) +
                                         " to specify virtual pipeline parallel degree when enable uneven pipeline "
                                         "parallelism (" +
                                         kLayersPerStageFlag + " cannot be used with " + kFirstFlag + " / " +
                                         kLastFlag + ")");
    require(counted % pp == 0, std::string(kLayersPerStageFlag) +
                                   ": number of layers of the model must be divisible pipeline model parallel size (" +
                                   counted_layers(shape, flags, counted) + ", " + kPipelineSizeFlag + " " + str(pp) +
                                   ")");
    const int64_t per_rank = counted / pp;
    const int64_t per_chunk = *flags.num_layers_per_virtual_pipeline_stage;
    require(per_rank % per_chunk == 0, std::string(kLayersPerStageFlag) +
                                           ": number of layers per pipeline stage must be divisible number of layers "
                                           "per virtual pipeline stage (" +
                                           str(per_rank) + " per pipeline stage, " + str(per_chunk) +
                                           " per virtual stage)");
    vpp = per_rank / per_chunk;
  } else if (flags.num_virtual_stages_per_pipeline_rank) {
    vpp = *flags.num_virtual_stages_per_pipeline_rank;
  } else if (!first_set && !last_set) {
    require(counted % pp == 0, "Number of layers should be divisible by the pipeline-model-parallel size (" +
                                   counted_layers(shape, flags, counted) + ", " + kPipelineSizeFlag + " " + str(pp) +
                                   ")");
  }
  require(vpp <= kMaxChunks / pp, std::string(kPipelineSizeFlag) + " " + str(pp) + " x " + str(vpp) +
                                      " virtual stages is more model chunks than moecore supports (" + str(kMaxChunks) +
                                      ")");
  if (vpp > 1) {
    if (flags.overlap_p2p_comm) {
      require(pp > 1, vpp_source(flags) +
                          ": When interleaved schedule is used, pipeline-model-parallel size should "
                          "be greater than 1 (" +
                          kPipelineSizeFlag + " " + str(pp) + ", " + str(vpp) + " virtual stages per rank)");
    } else {
      require(pp > 2, vpp_source(flags) +
                          ": When interleaved schedule is used and p2p communication overlap is disabled, "
                          "pipeline-model-parallel size should be greater than 2 to avoid having multiple p2p sends "
                          "and recvs between same 2 ranks per communication batch (" +
                          kPipelineSizeFlag + " " + str(pp) + ")");
    }
  }
  pipeline_size_ = static_cast<int>(pp);
  virtual_pipeline_size_ = static_cast<int>(vpp);
  stages_.resize(static_cast<size_t>(pp * vpp));
  for (int r = 0; r < pipeline_size_; ++r) {
    for (int v = 0; v < virtual_pipeline_size_; ++v) {
      PipelineStage& chunk = stages_[static_cast<size_t>(r) * static_cast<size_t>(vpp) + static_cast<size_t>(v)];
      chunk.pp_rank = r;
      chunk.virtual_stage = v;
    }
  }

  // megatron/core/transformer/transformer_config.py __post_init__: the modes exclude each other.
  require(!((first_set || last_set) && accounts), std::string(kFirstFlag) + " and " + kLastFlag +
                                                      " cannot be set at the same time with " + kEmbeddingFlag +
                                                      " and " + kLossFlag);
  if (flags.pipeline_model_parallel_layout) {
    std::string conflicts;
    for (const auto& [flag, given] : {std::pair{kFirstFlag, first_set}, std::pair{kLastFlag, last_set},
                                      std::pair{kEmbeddingFlag, flags.account_for_embedding_in_pipeline_split},
                                      std::pair{kLossFlag, flags.account_for_loss_in_pipeline_split}}) {
      if (given) conflicts += (conflicts.empty() ? "" : ", ") + std::string(flag);
    }
    require(conflicts.empty(),
            std::string(kLayoutFlag) + " cannot be set with other pipeline layout arguments (got " + conflicts + ")");
    split_by_layout(cells);
  } else if (first_set || last_set) {
    split_uneven();
  } else {
    split_uniform();
  }
  stages_.front().has_embedding = true;
  stages_.back().has_loss = true;
  if (!flags.pipeline_model_parallel_layout) stages_.back().mtp_layers = shape.mtp_num_layers;
  for (const PipelineStage& chunk : stages_) {
    require(chunk.mtp_layers == 0 || chunk.has_loss,
            std::string(kLayoutFlag) +
                ": Multi-Token Prediction layers on a stage without the loss (Megatron's "
                "standalone MTP stage) are not supported by moecore yet: put the 'm's beside "
                "the 'L'");
  }
}

// PipelineParallelLayerLayout.validate_layer_layout, get_layer_offset and get_num_layers_to_build.
void PipelineLayout::split_by_layout(const std::vector<std::string>& cells) {
  std::string flat;
  for (const std::string& cell : cells) flat += cell;
  const std::string prefix = std::string(kLayoutFlag) + ": ";
  require(!flat.empty() && flat.front() == 'E',
          prefix + "The first layer must be embedding, but got " + (flat.empty() ? "nothing" : layer_name(flat[0])));
  require(flat.back() == 'L', prefix + "The last layer must be loss, but got " + layer_name(flat.back()));
  require(std::count(flat.begin(), flat.end(), 'E') == 1, prefix + "Embedding must be specified exactly once");
  require(std::count(flat.begin(), flat.end(), 'L') == 1, prefix + "Loss must be specified exactly once");
  const auto decoders = static_cast<int64_t>(std::count(flat.begin(), flat.end(), 't'));
  require(decoders == shape_.num_layers,
          prefix + "Number of decoder layers " + str(decoders) + " must match --num-layers " + str(shape_.num_layers));
  // The MTP checks of validate_layer_layout, in its order.
  const auto mtps = static_cast<int64_t>(std::count(flat.begin(), flat.end(), 'm'));
  require(mtps == shape_.mtp_num_layers, prefix + "Number of mtp layers in layout must match mtp_num_layers (" +
                                             str(mtps) + " in the layout, --mtp-num-layers " +
                                             str(shape_.mtp_num_layers) + ")");
  require(flat.find('m') == std::string::npos || flat.find('t', flat.find('m')) == std::string::npos,
          prefix + "decoder layers must be placed before MTP layers");
  const auto cell_of = [&](const int r, const int v) {
    return cells[static_cast<size_t>(v) * static_cast<size_t>(pipeline_size_) + static_cast<size_t>(r)];
  };
  for (int r = 0; r < pipeline_size_; ++r) {
    for (int v = 0; v + 1 < virtual_pipeline_size_; ++v) {
      require(cell_of(r, v).find('m') == std::string::npos,
              prefix +
                  "Currently we restrict that the MTP should be always in the last virtual pipeline stage of "
                  "that rank. But got '" +
                  cell_of(r, v) + "' (pipeline rank " + str(r) + ", virtual stage " + str(v) + ")");
    }
  }
  for (int r = 0; r < pipeline_size_; ++r) {
    const std::string& last = cell_of(r, virtual_pipeline_size_ - 1);
    require(last.find('m') == std::string::npos || std::count(last.begin(), last.end(), 'm') == shape_.mtp_num_layers,
            prefix + "All of the MTP layers must be in the same one virtual pipeline stage");
  }
  // Stage i is (pp = i % PP, virtual stage = i / PP); layers are numbered in stage order.
  int64_t next_layer = 0;
  for (size_t i = 0; i < cells.size(); ++i) {
    const int r = static_cast<int>(i % static_cast<size_t>(pipeline_size_));
    const int v = static_cast<int>(i / static_cast<size_t>(pipeline_size_));
    PipelineStage& chunk = stages_[static_cast<size_t>(r * virtual_pipeline_size_ + v)];
    chunk.first_layer = next_layer;
    chunk.num_layers = static_cast<int64_t>(std::count(cells[i].begin(), cells[i].end(), 't'));
    chunk.mtp_layers = static_cast<int64_t>(std::count(cells[i].begin(), cells[i].end(), 'm'));
    next_layer += chunk.num_layers;
  }
}

// TransformerConfig's uneven checks, get_num_layers_to_build and get_transformer_layer_offset.
void PipelineLayout::split_uneven() {
  const int64_t pp = pipeline_size_, vpp = virtual_pipeline_size_, num_layers = shape_.num_layers;
  const bool first_set = flags_.decoder_first_pipeline_num_layers.has_value();
  const bool last_set = flags_.decoder_last_pipeline_num_layers.has_value();
  const int64_t first = flags_.decoder_first_pipeline_num_layers.value_or(0);
  const int64_t last = flags_.decoder_last_pipeline_num_layers.value_or(0);
  for (const auto& [flag, set, count, where] :
       {std::tuple{kFirstFlag, first_set, first, "first"}, std::tuple{kLastFlag, last_set, last, "last"}}) {
    if (!set) continue;
    require(count > 0, std::string(flag) + " must be larger than 0 (got " + str(count) + ")");
    require(count % vpp == 0, std::string(flag) + ": number of layers at " + where + " stage: " + str(count) +
                                  " must be divisible by virtual pipeline parallel degree " + str(vpp));
  }
  // moecore's: Megatron goes on with a negative middle count, or, in one stage, silently builds only the last count.
  require(first <= num_layers && last <= num_layers - first,
          std::string(kFirstFlag) + " (" + str(first) + ") and " + kLastFlag + " (" + str(last) +
              ") hold more layers than --num-layers (" + str(num_layers) + ")");
  require(!(first_set && last_set) || pp >= 2, std::string(kFirstFlag) + " and " + kLastFlag + " together need " +
                                                   kPipelineSizeFlag +
                                                   " >= 2 (with one stage the first stage is also the last)");
  const int64_t middle_ranks = pp - (first_set ? 1 : 0) - (last_set ? 1 : 0);
  const int64_t middle_layers = num_layers - first - last;
  require((middle_layers != 0) == (middle_ranks != 0),
          "Mismatch: " + str(middle_layers) + " middle layers remaining but " + str(middle_ranks) +
              " middle PP stages available (" + kFirstFlag + " / " + kLastFlag + ", --num-layers " + str(num_layers) +
              ", " + kPipelineSizeFlag + " " + str(pp) + ")");
  if (middle_ranks > 0) {
    require(middle_layers % middle_ranks == 0, "number of layers at middle stage: " + str(middle_layers) +
                                                   " must be divisible by the middle pipeline model parallel size " +
                                                   str(middle_ranks) + " (" + kFirstFlag + " / " + kLastFlag + ")");
    require((middle_layers / middle_ranks) % vpp == 0,
            "number of layers on each middle pipeline rank: " + str(middle_layers / middle_ranks) +
                " must be divisible by virtual pipeline parallel degree " + str(vpp) + " (" + vpp_source(flags_) + ")");
  }
  // Layers per chunk on the first, middle and last ranks; a chunk set of all ranks holds `per_round` layers.
  const int64_t first_chunk = first / vpp, last_chunk = last / vpp;
  // Megatron divides by the middle rank count here even when it is 0 (PP 2 with both counts set); nothing is
  // in the middle then.
  const int64_t middle_chunk = middle_ranks > 0 ? middle_layers / middle_ranks / vpp : 0;
  const int64_t per_round = first_chunk + middle_layers / vpp + last_chunk;
  for (PipelineStage& chunk : stages_) {
    const int64_t r = chunk.pp_rank;
    if (r == 0 && first_set) {
      chunk.num_layers = first_chunk;
    } else if (r == pp - 1 && last_set) {
      chunk.num_layers = last_chunk;
    } else {
      chunk.num_layers = middle_chunk;
    }
    const int64_t middle_rank = first_set ? r - 1 : r;
    chunk.first_layer = chunk.virtual_stage * per_round + (r == 0 ? 0 : first_chunk + middle_rank * middle_chunk);
  }
}

// The uniform split, with the embedding / loss optionally counted as layers: TransformerConfig's account_for checks,
// get_num_layers_to_build and get_transformer_layer_offset.
void PipelineLayout::split_uniform() {
  const int64_t pp = pipeline_size_, vpp = virtual_pipeline_size_;
  const bool embedding = flags_.account_for_embedding_in_pipeline_split;
  const bool loss = flags_.account_for_loss_in_pipeline_split;
  const int64_t counted = counted_layer_total(shape_, flags_);
  if (embedding || loss) {
    const std::string accounted = std::string(kEmbeddingFlag) + " or " + kLossFlag;
    require(counted % pp == 0, "num_layers: " + str(counted) + " after enable " + accounted + " must be divisible by " +
                                   kPipelineSizeFlag + " " + str(pp) + " (" + counted_layers(shape_, flags_, counted) +
                                   ")");
    require((counted / pp) % vpp == 0, "number of layers on each pipeline rank: " + str(counted / pp) +
                                           " (after enable " + accounted +
                                           ") must be divisible by virtual_pipeline_model_parallel_size " + str(vpp) +
                                           " (" + vpp_source(flags_) + ")");
  } else {
    require(counted % pp == 0,
            "--num-layers " + str(counted) + " should be divisible by " + kPipelineSizeFlag + " " + str(pp));
    require((counted / pp) % vpp == 0, "num_layers_per_pipeline_rank " + str(counted / pp) +
                                           " should be divisible by vp_size " + str(vpp) + " (" + vpp_source(flags_) +
                                           ")");
  }
  const int64_t per_chunk = counted / pp / vpp;
  for (PipelineStage& chunk : stages_) {
    const bool first_chunk = chunk.pp_rank == 0 && chunk.virtual_stage == 0;
    const bool last_chunk = chunk.pp_rank == pp - 1 && chunk.virtual_stage == vpp - 1;
    chunk.num_layers = per_chunk - (embedding && first_chunk ? 1 : 0) - (loss && last_chunk ? 1 : 0);
    // Chunk (r, v) starts after v full rounds of PP chunks and r chunks of its round; the embedding's place, when
    // counted, is no layer.
    chunk.first_layer = (chunk.virtual_stage * pp + chunk.pp_rank) * per_chunk - (embedding && !first_chunk ? 1 : 0);
  }
}

const PipelineStage& PipelineLayout::stage(const int pp_rank, const int virtual_stage) const {
  require(pp_rank >= 0 && pp_rank < pipeline_size_ && virtual_stage >= 0 && virtual_stage < virtual_pipeline_size_,
          "no pipeline stage (pp rank " + str(pp_rank) + ", virtual stage " + str(virtual_stage) + ") in PP " +
              str(pipeline_size_) + " x VPP " + str(virtual_pipeline_size_));
  return stages_[static_cast<size_t>(pp_rank * virtual_pipeline_size_ + virtual_stage)];
}

const PipelineStage& PipelineLayout::stage_of_layer(const int64_t layer) const {
  for (const PipelineStage& chunk : stages_) {
    if (layer >= chunk.first_layer && layer < chunk.end_layer()) return chunk;
  }
  throw LayoutError("no pipeline stage holds decoder layer " + str(layer) + " (--num-layers " + str(shape_.num_layers) +
                    ")");
}

}  // namespace moecore
