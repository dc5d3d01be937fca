// The activations one micro-batch's backward needs, produced by GPTModel::forward. Several can be alive at
// once (gradient accumulation, pipeline schedules).
#pragma once

#include <cstdint>
#include <vector>

#include "moecore/model/multi_token_prediction.h"
#include "moecore/model/norm_module.h"
#include "moecore/model/parallel_linear.h"
#include "moecore/model/sequence_info.h"
#include "moecore/model/token_rows.h"
#include "moecore/model/transformer_layer.h"
#include "moecore/tensor/tensor.h"

namespace moecore {

class MicroBatchContext {
 public:
  int64_t S = 0, B = 0;
  std::vector<int32_t> tokens_SB, labels_SB;
  std::vector<float> loss_weight_SB;  // mask / number of unmasked tokens
  double loss_tokens = 0.0;           // this rank's unmasked tokens
  bool per_token_loss = false;        // ForwardOptions::per_token_loss
  uint64_t dropout_seed = 0;
  uint64_t dropout_stream = 0;
  bool training = false;
  int chunk = 0;                         // the model chunk that ran
  TokenRows rows;                        // where the local sequence's rows sit in the one-process micro-batch
  SequenceInfo sequence;                 // positions, documents and the context-parallel split, for attention
  std::vector<LayerActivations> layers;  // the chunk's layers
  Tensor output_TH;                      // the last layer's output: this stage's result without post-process
  Tensor final_out_TH;                   // final norm output (post-process)
  NormStats final_stats;
  LinearActivations output_layer;
  // Unfused output layer (when the caller asks for the logits): the logits, overwritten by dlogits in backward.
  Tensor logits_TV;
  Tensor lse_T;
  // Fused output layer + loss: the loss's gradient w.r.t. the output layer's input (every token), made during forward
  // (its weight gradient went into the main gradient then), scaled by output_grad_seed.
  Tensor output_dinput_TH;
  double output_grad_seed = 1.0;  // the backward seed of the forward: the backward's loss scale must equal it
  MtpActivations mtp;             // --mtp-num-layers (post-process)
};

}  // namespace moecore
