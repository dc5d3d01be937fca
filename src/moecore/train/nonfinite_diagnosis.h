// Why a training iteration produced a non-finite loss or gradient norm, in one line with advice that fits the cause.
//
// Megatron stops on the first NaN / Inf loss or gradient (--check-for-nan-in-loss-and-grad, on by default, off with
// fp16 dynamic loss scaling: megatron/training/arguments.py; the checks are pretrain_gpt.py's loss_func and
// param_and_grad_buffer.py's check_grads, raised by rerun_state_machine.py's validate_result as "Unexpected result
// nan"). moecore stops at the same points and also says what led there, from what is cheap to know: the losses of the
// iterations before, the first weight that is not finite (the last optimizer step made it from finite gradients) and
// the module closest to the loss whose gradient is not finite (where the backward pass overflowed first).
// A norm whose sum of squares overflows (model/norm_overflow.h) outputs zeros and leaves the loss finite (ln V, zero
// gradients): moecore stops on it too, naming the norm, where Megatron would train on.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "moecore/model/gpt_model.h"
#include "moecore/model/norm_overflow.h"
#include "moecore/parallel/process_group.h"
#include "moecore/train/trainer.h"

namespace moecore {

// What train_step knows when it stops: thrown by it (on every rank together), completed by the trainer.
struct NonFiniteStepFacts {
  int64_t iteration = 0;
  double lm_loss = 0.0;             // the iteration's loss, reduced over the global batch
  std::optional<double> grad_norm;  // set when the loss was finite and the norm was not
  double learning_rate = 0.0;       // the rate this iteration's update would have used
  std::optional<NormOverflow> norm_overflow =
      std::nullopt;  // set when a norm's statistics overflowed (the loss may be finite)
};

class NonFiniteStep : public TrainingError {
 public:
  explicit NonFiniteStep(const NonFiniteStepFacts& facts);
  const NonFiniteStepFacts& facts() const { return facts_; }

 private:
  NonFiniteStepFacts facts_;
};

// A tensor holding a non-finite value: "decoder.layers.1.mlp.linear_fc2.weight (NaN at element 17)".
struct NonFiniteTensor {
  int64_t module = 0;  // Param::module: -1 the embedding, 0..L-1 decoder layers, L the final norm and output layer
  std::string description;
};

// Where the model holds non-finite values (collective over `world`: the first weight in model order and the
// gradient closest to the loss over every rank's parameters).
struct NonFiniteScan {
  std::optional<NonFiniteTensor> first_weight;
  std::optional<NonFiniteTensor> last_grad;
  double largest_weight = 0.0;  // the largest finite |weight|
};
NonFiniteScan scan_model_for_nonfinite(const GPTModel& model, const parallel::ProcessGroup& world);

struct NonFiniteDiagnosis {
  NonFiniteStepFacts step;
  std::vector<double> previous_losses;       // lm loss of the iterations of this run before step.iteration
  std::optional<double> previous_grad_norm;  // the grad norm of the last update made
  NonFiniteScan scan;
  int64_t num_layers = 0;         // to name module L "the output layer"
  double lr = 0.0;                // --lr
  double adam_eps = 1e-8;         // --adam-eps
  double weight_decay = 0.0;      // --weight-decay
  double clip_grad = 1.0;         // --clip-grad
  double init_method_std = 0.02;  // --init-method-std
  std::string loaded_from;        // --load, where the run started from a checkpoint or HF folder
  bool fp16 = false;              // --fp16: weights are rounded to fp16
};

// One line: what was not finite (or which norm overflowed) at which iteration with that iteration's values, what led
// there and what to change.
std::string describe_nonfinite(const NonFiniteDiagnosis& diagnosis);

}  // namespace moecore
