// Hooks the data-parallel engine hangs on the model's forward and backward, per module (the embedding = -1,
// decoder layer i = i, the final norm and output layer = num_layers): gradient buckets are reduced as soon as
// the backward of their last module is done, and parameter all-gathers are waited on just before first use.
// Megatron-FSDP (optim/fsdp.h) gathers a decoder layer's parameters before its forward and its backward and frees
// them after each.
#pragma once

namespace moecore {

class ModelHooks {
 public:
  virtual ~ModelHooks() = default;
  // Before module `module` reads its parameters in a forward (training or evaluation).
  virtual void before_forward(int module) = 0;
  // After module `module`'s forward (training or evaluation) no longer reads its parameters.
  virtual void after_forward(int /*module*/) {}
  // Before a forward of decoder layer `module` recomputed for its backward (full recomputation), which follows; its
  // parameters stay in use until after_backward. Default: as a forward.
  virtual void before_recompute(int module) { before_forward(module); }
  // Before module `module`'s backward reads its parameters and accumulates into its gradients.
  virtual void before_backward(int /*module*/) {}
  // After module `module`'s backward has accumulated its parameters' gradients.
  virtual void after_backward(int module) = 0;
};

}  // namespace moecore
