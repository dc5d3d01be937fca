#include "moecore/train/packed_samples.h"

#include <algorithm>
#include <numeric>
#include <random>
#include <string>

namespace moecore {
namespace {

// The dataset order of one epoch: Fisher-Yates over mt19937_64 (the standard fixes its output), keyed by seed and
// epoch.
std::vector<int64_t> epoch_order(const int64_t n, const uint64_t seed, const int64_t epoch) {
  std::vector<int64_t> order(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), 0);
  std::mt19937_64 rng(seed * 0x9E3779B97F4A7C15ULL + static_cast<uint64_t>(epoch) + 1);
  for (int64_t i = n - 1; i > 0; --i) {
    const auto j = static_cast<int64_t>(rng() % static_cast<uint64_t>(i + 1));
    std::swap(order[static_cast<size_t>(i)], order[static_cast<size_t>(j)]);
  }
  return order;
}

}  // namespace

PackedSamplesOptions packed_samples_options(const TrainingArgs& args, const int64_t context_parallel_size) {
  PackedSamplesOptions options;
  options.seq_length = args.model.seq_length;
  options.pack = args.rl_use_sequence_packing;
  options.max_sequences_per_bin = args.rl_sequence_packing_max_sequences_per_bin;
  options.distribution = parse_bin_distribution(args.rl_sequence_packing_algo);
  options.context_parallel_size = context_parallel_size;
  options.serpentine = args.rl_microbatch_order == "serpentine";
  options.seed = static_cast<uint64_t>(args.seed);
  return options;
}

PackedSamples::PackedSamples(const SampleDataset& data, PackedSamplesOptions options) : data_(data), options_(options) {
  for (int64_t i = 0; i < data_.size(); ++i) {
    if (data_.length(i) > options_.seq_length) {
      throw DataError(data_.path() + ": sample " + std::to_string(i) + " has " + std::to_string(data_.length(i)) +
                      " tokens, more than --seq-length " + std::to_string(options_.seq_length) +
                      " (a sample is never cut)");
    }
  }
}

int64_t PackedSamples::sample_index(const int64_t k) const {
  const int64_t n = data_.size(), epoch = k / n;
  if (epoch != cached_epoch_) {  // a step reads one epoch, or the end of one and the start of the next
    cached_order_ = epoch_order(n, options_.seed, epoch);
    cached_epoch_ = epoch;
  }
  return cached_order_[static_cast<size_t>(k % n)];
}

PackedStep PackedSamples::step(const int64_t consumed, const int64_t global_batch, const int dp_size,
                               const int dp_rank) const {
  PackedStep step;
  step.samples = step_samples(consumed, global_batch);
  std::vector<int64_t> lengths;
  for (const int64_t index : step.samples) {
    lengths.push_back(data_.length(index));
    step.real_tokens += lengths.back();
    step.squared_lengths += lengths.back() * lengths.back();
  }
  if (options_.pack) {
    SequencePackingOptions packing;
    packing.bin_size = options_.seq_length;
    packing.max_sequences_per_bin = options_.max_sequences_per_bin;
    packing.context_parallel_size = options_.context_parallel_size;
    step.bins = pack_sequences(lengths, packing);
  } else {
    // Without packing each sample is a bin of its own, in the order the samples come (Megatron-RL's unpacked rows).
    const int64_t align = packing_alignment(options_.context_parallel_size);
    for (size_t i = 0; i < lengths.size(); ++i) {
      PackedBin bin;
      bin.sample_ids = {static_cast<int64_t>(i)};
      bin.offsets = {0};
      bin.slot_lengths = {(lengths[i] + align - 1) / align * align};
      bin.lengths = {lengths[i]};
      step.bins.push_back(std::move(bin));
    }
  }
  const std::vector<RankBins> ranks =
      distribute_packed_bins(static_cast<int64_t>(step.bins.size()), dp_size, options_.distribution);
  const RankBins& mine = ranks[static_cast<size_t>(dp_rank)];
  step.bins_per_rank = mine.num_bins();
  for (const RankBins& rank : ranks) step.padding_bins += rank.num_padding_bins;
  step.padding_tokens =
      (static_cast<int64_t>(step.bins.size()) + step.padding_bins) * options_.seq_length - step.real_tokens;
  step.local_bins = mine.bin_indices;
  step.local_bins.resize(static_cast<size_t>(step.bins_per_rank), -1);
  if (options_.serpentine) {
    std::vector<std::vector<int64_t>> bin_lengths;
    for (const int64_t b : step.local_bins) {
      bin_lengths.push_back(b < 0 ? std::vector<int64_t>{} : step.bins[static_cast<size_t>(b)].lengths);
    }
    const std::vector<int64_t> order = serpentine_order(bin_lengths);
    std::vector<int64_t> reordered;
    for (const int64_t i : order) reordered.push_back(step.local_bins[static_cast<size_t>(i)]);
    step.local_bins = std::move(reordered);
  }
  return step;
}

std::string PackedSamples::replay_missing(const PackedStep& step, const RoutingReplaySource& replay) const {
  for (const int64_t index : step.samples) {
    if (replay.find_sample(data_.sample(index).tokens) == nullptr) {
      return "routing recording " + replay.path() + " has no record of sample " + std::to_string(index) + " of " +
             data_.path() + " (no record holds exactly its " + std::to_string(data_.length(index)) + " tokens)";
    }
  }
  return "";
}

RoutingReplayBatch PackedSamples::replay_batch(const PackedStep& step, const int64_t local,
                                               const RoutingReplaySource& replay) const {
  const RoutingRecording& recording = replay.recording();
  RoutingReplayBatch table;
  table.S = options_.seq_length;
  table.B = 1;
  table.routers = recording.num_routers();
  table.topk = recording.topk;
  const int64_t per_token = table.routers * table.topk;
  table.experts.assign(static_cast<size_t>(table.S * per_token), -1);
  const int64_t b = step.local_bins.at(static_cast<size_t>(local));
  if (b < 0) return table;
  const PackedBin& bin = step.bins[static_cast<size_t>(b)];
  for (size_t i = 0; i < bin.sample_ids.size(); ++i) {
    const Sample sample = data_.sample(step.samples[static_cast<size_t>(bin.sample_ids[i])]);
    const RoutingRecord* record = replay.find_sample(sample.tokens);
    if (record == nullptr) throw ConfigError(replay_missing(step, replay));
    const int64_t routed = std::min<int64_t>(record->routed, static_cast<int64_t>(sample.tokens.size()));
    std::copy_n(record->experts.begin(), routed * per_token, table.experts.begin() + bin.offsets[i] * per_token);
  }
  return table;
}

std::vector<int64_t> PackedSamples::step_samples(const int64_t consumed, const int64_t global_batch) const {
  std::vector<int64_t> samples;
  for (int64_t k = consumed; k < consumed + global_batch; ++k) samples.push_back(sample_index(k));
  return samples;
}

namespace {

// A micro-batch row of S positions that predicts nothing, every position in `document`.
Batch empty_row(const int64_t S, const int32_t document) {
  Batch batch;
  batch.B = 1;
  batch.S = S;
  batch.tokens_BS.assign(static_cast<size_t>(S), 0);
  batch.labels_BS.assign(static_cast<size_t>(S), 0);
  batch.loss_mask_BS.assign(static_cast<size_t>(S), 0.0f);
  batch.position_ids_BS.assign(static_cast<size_t>(S), 0);
  batch.document_ids_BS.assign(static_cast<size_t>(S), document);
  return batch;
}

// `sample` at positions [offset, offset + slot) of `row`, as document `document`: its tokens, each predicting the
// next with the sample's loss mask for that target (the last predicts nothing); the slot's padding after it stays in
// its document (causal: no real token sees it).
void place_sample(Batch& row, const Sample& sample, const int64_t offset, const int64_t slot, const int32_t document) {
  const auto n = static_cast<int64_t>(sample.tokens.size());
  for (int64_t j = 0; j < slot; ++j) {
    const auto at = static_cast<size_t>(offset + j);
    row.document_ids_BS[at] = document;
    if (j >= n) continue;
    row.tokens_BS[at] = sample.tokens[static_cast<size_t>(j)];
    if (j + 1 < n) {
      row.labels_BS[at] = sample.tokens[static_cast<size_t>(j + 1)];
      row.loss_mask_BS[at] = static_cast<float>(sample.loss_mask[static_cast<size_t>(j + 1)]);
    }
  }
}

}  // namespace

Batch PackedSamples::sample_batch(const int64_t index, const int64_t length) const {
  const Sample sample = data_.sample(index);
  const auto n = static_cast<int64_t>(sample.tokens.size());
  if (length < n) throw std::invalid_argument("a sample's micro-batch is shorter than the sample");
  Batch batch = empty_row(length, 1);  // the padding: a document of its own
  place_sample(batch, sample, 0, n, 0);
  for (int64_t j = 0; j < n; ++j) batch.position_ids_BS[static_cast<size_t>(j)] = j;
  return batch;
}

Batch PackedSamples::batch(const PackedStep& step, const int64_t local) const {
  const int64_t S = options_.seq_length;
  Batch batch = empty_row(S, 0);
  const int64_t b = step.local_bins.at(static_cast<size_t>(local));
  if (b < 0) return batch;  // an empty (padding) bin: one padding document, nothing to predict
  const PackedBin& bin = step.bins[static_cast<size_t>(b)];
  const std::vector<int64_t> positions = bin_position_ids(bin, S);
  std::copy(positions.begin(), positions.end(), batch.position_ids_BS.begin());
  const auto samples = static_cast<int64_t>(bin.sample_ids.size());
  for (int64_t i = 0; i < samples; ++i) {
    const Sample sample = data_.sample(step.samples[static_cast<size_t>(bin.sample_ids[static_cast<size_t>(i)])]);
    place_sample(batch, sample, bin.offsets[static_cast<size_t>(i)], bin.slot_lengths[static_cast<size_t>(i)],
                 static_cast<int32_t>(i));
  }
  // The bin's tail after the last slot: a padding document of its own (Megatron's ghost sequence).
  for (int64_t t = bin.padded_end(); t < S; ++t) {
    batch.document_ids_BS[static_cast<size_t>(t)] = static_cast<int32_t>(samples);
  }
  return batch;
}

}  // namespace moecore
