// The activations one micro-batch's backward needs, produced by GPTModel::forward. Several can be alive at
// once (gradient accumulation today, pipeline schedules later).
#pragma once

#include <cstdint>
#include <vector>

#include "moecore/model/norm_module.h"
#include "moecore/model/transformer_layer.h"
#include "moecore/tensor/tensor.h"

namespace moecore {

class MicroBatchContext {
 public:
  int64_t S = 0, B = 0;
  std::vector<int32_t> tokens_SB, labels_SB;
  std::vector<float> loss_weight_SB;  // mask / number of unmasked tokens
  uint64_t dropout_seed = 0;
  uint64_t dropout_stream = 0;
  bool training = false;
  std::vector<LayerActivations> layers;
  Tensor final_in_TH;    // output of the last layer
  Tensor final_out_TH;   // (this rank's sequence shard under sequence parallelism)
  Tensor final_full_TH;  // final_out gathered over TP (sequence parallelism only): the output layer's input
  NormStats final_stats;
  Tensor logits_TV;  // overwritten by dlogits in backward
  Tensor lse_T;
};

}  // namespace moecore
