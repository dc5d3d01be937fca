// Hooks the data-parallel engine hangs on the model's forward and backward, per module (the embedding = -1,
// decoder layer i = i, the final norm and output layer = num_layers): gradient buckets are reduced as soon as
// the backward of their last module is done, and parameter all-gathers are waited on just before first use.
#pragma once

namespace moecore {

class ModelHooks {
 public:
  virtual ~ModelHooks() = default;
  // Before module `module` reads its parameters in a forward (training or evaluation).
  virtual void before_forward(int module) = 0;
  // After module `module`'s backward has accumulated its parameters' gradients.
  virtual void after_backward(int module) = 0;
};

}  // namespace moecore
