// Who holds a run's main parameters under the precision-aware optimizer, and how (Megatron's OptimizerConfig): TE's
// FusedAdam (moments and master in their --*-dtype formats, the gradient buffer read as it is, bf16 weights' fp32
// master as 16-bit remainders) or Megatron's distributed optimizer (a full fp32 master, fp32 gradient copies).
#pragma once

#include "moecore/config/arguments.h"

namespace moecore {

// Megatron's OptimizerConfig.use_precision_aware_optimizer_no_fp8_or_ds_fp8: --use-precision-aware-optimizer, and
// TransformerEngine holds the master weights (fp16 main parameters, no --fp8-format, or --fp8-recipe delayed).
bool te_holds_master_weights(const TrainingArgs& args);

// True where Megatron stores bf16 weights' fp32 main parameters as the weights plus 16-bit remainders
// (store_param_remainders): TE holds the master weights, --bf16 with fp32 main parameters, and the weights are plain
// bf16 copies of their main values (no --fp8-param-gather / --fp4-param-gather). Elsewhere a full fp32 master.
bool stores_param_remainders(const TrainingArgs& args);

}  // namespace moecore
