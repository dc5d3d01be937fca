#include "moecore/train/training_setup.h"

#include <chrono>
#include <iomanip>
#include <ostream>
#include <vector>

#include "moecore/config/optimizer_master.h"
#include "moecore/pipeline/pipeline_layout.h"

namespace moecore {

Vocabulary build_vocabulary(const TrainingArgs& args) {
  Vocabulary vocabulary;
  if (!args.tokenizer_type.empty()) {
    TokenizerOptions options;
    options.type = args.tokenizer_type;
    options.vocab_file = args.vocab_file;
    options.merge_file = args.merge_file;
    options.vocab_size = args.vocab_size.value_or(-1);
    vocabulary.tokenizer = build_tokenizer(options);
    vocabulary.unpadded_size = vocabulary.tokenizer->vocab_size();
    vocabulary.eod_id = vocabulary.tokenizer->eod();
  } else if (args.vocab_size) {
    vocabulary.unpadded_size = *args.vocab_size;
    vocabulary.eod_id = static_cast<int32_t>(vocabulary.unpadded_size - 1);
  } else {
    throw ConfigError("the vocabulary is unknown: give --tokenizer-type (with its files) or --vocab-size");
  }
  vocabulary.padded_size = padded_vocab_size(vocabulary.unpadded_size, args);
  return vocabulary;
}

TrainingArgs with_padded_vocabulary(const TrainingArgs& args, const Vocabulary& vocabulary) {
  TrainingArgs run_args = args;
  run_args.model.vocab_size = vocabulary.padded_size;
  run_args.model.validate();
  return run_args;
}

SplitSampleCounts split_sample_counts(const TrainingArgs& args) {
  const int64_t gbs = args.global_batch_size;
  const int64_t eval_points = args.eval_interval ? args.train_iters / *args.eval_interval + 1 : 1;
  SplitSampleCounts counts;
  counts.train = args.train_iters * gbs;
  counts.valid = eval_points * args.eval_iters * gbs;
  counts.test = args.eval_iters * gbs;
  return counts;
}

GPTDataProvider build_data(const TrainingArgs& run_args, const int32_t eod_id, std::ostream& log) {
  if (!run_args.sample_data_path.empty()) return GPTDataProvider{};  // whole samples: train/packed_samples.h
  DataOptions options;
  options.data_path = run_args.data_path;
  options.mock_data = run_args.mock_data;
  options.mock_max_sequence_length = static_cast<int32_t>(run_args.mock_max_sequence_length);
  if (!run_args.split.empty()) options.split = run_args.split;
  options.seq_length = run_args.model.seq_length;
  options.seed = static_cast<uint64_t>(run_args.seed);
  options.data_cache_path = run_args.data_cache_path;
  options.eod_mask_loss = run_args.eod_mask_loss;
  options.reset_position_ids = run_args.reset_position_ids;
  options.reset_attention_mask = run_args.reset_attention_mask;
  options.eod_id = eod_id;
  options.vocab_size = run_args.model.vocab_size;
  const auto start = std::chrono::steady_clock::now();
  const SplitSampleCounts counts = split_sample_counts(run_args);
  GPTDataProvider data = GPTDataProvider::build(options, counts.train, counts.valid, counts.test);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  log << "> built datasets in " << std::fixed << std::setprecision(2) << seconds << " s: train "
      << data.num_samples(DatasetSplit::kTrain) << " samples, valid " << data.num_samples(DatasetSplit::kValid)
      << " samples" << std::endl;
  log.unsetf(std::ios::floatfield);
  return data;
}

ModelAndOptimizer build_model_and_optimizer(const TrainingArgs& run_args, const parallel::ParallelState& parallel) {
  ModelAndOptimizer out;
  // This pipeline rank's model chunks, one per virtual stage (Megatron's get_model).
  const PipelineLayout pipeline = pipeline_layout(run_args);
  std::vector<StageSpec> chunks;
  for (int v = 0; v < pipeline.virtual_pipeline_size(); ++v) {
    const PipelineStage& stage = pipeline.stage(parallel.pp_rank(), v);
    chunks.push_back(StageSpec{stage.first_layer, stage.num_layers, stage.has_embedding, stage.has_loss});
  }
  out.model = std::make_unique<GPTModel>(run_args.model, static_cast<uint64_t>(run_args.seed), parallel, chunks);
  AdamWOptions adam;
  adam.beta1 = run_args.adam_beta1;
  adam.beta2 = run_args.adam_beta2;
  adam.eps = run_args.adam_eps;
  adam.weight_decay = run_args.weight_decay;
  adam.params_dtype = run_args.model.params_dtype;
  // The precision-aware optimizer's state formats (all fp32 without --use-precision-aware-optimizer).
  adam.exp_avg_format = quant::parse_state_format(run_args.exp_avg_dtype);
  adam.exp_avg_sq_format = quant::parse_state_format(run_args.exp_avg_sq_dtype);
  if (run_args.model.params_dtype != DType::kF32) {
    adam.main_params_format = quant::parse_state_format(run_args.main_params_dtype);
  }
  // Megatron's store_param_remainders (OptimizerConfig default True, no flag) where TE holds the master weights.
  adam.store_param_remainders = stores_param_remainders(run_args);
  adam.decoupled_grads = te_holds_master_weights(run_args);
  DdpOptions ddp_options;
  ddp_options.bucket_size = run_args.ddp_bucket_size;
  ddp_options.overlap_grad_reduce = run_args.overlap_grad_reduce;
  ddp_options.use_distributed_optimizer = run_args.use_distributed_optimizer;
  ddp_options.overlap_param_gather = run_args.overlap_param_gather;
  ddp_options.per_token_loss = run_args.calculate_per_token_loss;
  // Megatron's grad buffer dtype (arguments.py validate_args, distributed_data_parallel.py): fp32 when gradients
  // accumulate and reduce in fp32, else the 16-bit weights' dtype. bf16 accumulates in fp32 unless
  // --grad-reduce-in-bf16 or --main-grads-dtype bf16 (both give one bf16 buffer); fp16 accumulates in fp16 unless
  // --accumulate-allreduce-grads-in-fp32. 16-bit weights are all-gathered in 16 bits.
  const DType params_dtype = run_args.model.params_dtype;
  const bool bf16_grads =
      params_dtype == DType::kBF16 && (run_args.grad_reduce_in_bf16 || run_args.main_grads_dtype == "bf16");
  const bool fp16_grads = params_dtype == DType::kF16 && !run_args.accumulate_allreduce_grads_in_fp32;
  if (bf16_grads || fp16_grads) ddp_options.grad_dtype = params_dtype;
  ddp_options.param_gather_dtype = params_dtype;
  ddp_options.quantized_param_gather = run_args.fp8_param_gather || run_args.fp4_param_gather;
  if (run_args.use_megatron_fsdp) {
    // Megatron-FSDP (optim/fsdp.h): every decoder layer a unit. no_shard keeps Adam states whole on every rank
    // (the distributed optimizer's shards are what optim and above shard).
    FsdpOptions fsdp;
    fsdp.strategy = *parse_sharding_strategy(run_args.data_parallel_sharding_strategy);
    fsdp.num_units = static_cast<int>(run_args.model.num_layers);
    ddp_options.fsdp = fsdp;
    ddp_options.use_distributed_optimizer = fsdp.strategy != ShardingStrategy::kNoShard;
    // Megatron-FSDP's main gradients: --megatron-fsdp-main-grads-dtype auto, the weights' dtype.
    ddp_options.grad_dtype = params_dtype;
  }
  out.ddp = std::make_unique<DistributedDataParallel>(out.model->params(), parallel, ddp_options);
  out.model->set_hooks(out.ddp.get());
  out.optimizer = std::make_unique<DistributedAdamW>(*out.ddp, out.model->params(), adam);
  return out;
}

double one_process_parameter_count(const GPTModel& model) {
  double count = 0.0;
  for (const Param& p : model.params()) {
    if (p.pipeline_copy) continue;  // the first stage counts the tied embedding
    double n = 1.0;
    for (const int64_t d : p.shard.full_shape) n *= static_cast<double>(d);
    count += p.is_expert ? n * model.parallel().ep_size() : n;
  }
  // Each pipeline stage holds its own layers: the sum over the pipeline (a collective over it).
  return model.parallel().pp_size() > 1 ? parallel::sum_double(model.parallel().pp, count) : count;
}

}  // namespace moecore
