#include "moecore/config/optimizer_master.h"

namespace moecore {

bool te_holds_master_weights(const TrainingArgs& args) {
  // Megatron, optimizer_config.py (__post_init__, use_precision_aware_optimizer_no_fp8_or_ds_fp8): precision-aware and
  // (main_params_dtype != fp32 or fp8_recipe is None or "delayed" or optimizer CPU offload, not in moecore). Its
  // fp8_recipe comes from the arguments, "delayed" by default even without --fp8-format (FP4 runs included), so only
  // --fp8-recipe tensorwise / blockwise / mxfp8 with fp32 main parameters leave the master to Megatron's distributed
  // optimizer: a full fp32 copy (distrib_optimizer.py, shard_main_param = ...float()), with fp32 copies of the
  // gradients (main_param.grad = main_grad.float()); TE's FusedAdam then gets master_weights=False
  // (optimizer/__init__.py), so store_param_remainders has no effect.
  return args.use_precision_aware_optimizer &&
         (args.main_params_dtype != "fp32" || !args.fp8_format || args.fp8_recipe.value_or("delayed") == "delayed");
}

bool stores_param_remainders(const TrainingArgs& args) {
  // TE's FusedAdam keeps remainders for bf16 params with an fp32 master only (fused_adam.py); quantized weights hold
  // decoded codes, not the high halves of their main values.
  return te_holds_master_weights(args) && args.model.params_dtype == DType::kBF16 && args.main_params_dtype == "fp32" &&
         !args.fp8_param_gather && !args.fp4_param_gather;
}

}  // namespace moecore
