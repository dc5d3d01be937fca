#include "moecore/optim/scaled_state.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <utility>

#include "moecore/ops/precision.h"

namespace moecore {
namespace {

// Elements per fp32 chunk of scaled_adamw_step (three 1 MiB buffers).
constexpr int64_t kChunk = int64_t{1} << 18;

// max that keeps a NaN (torch.aminmax propagates it into the scale).
float max_keep_nan(const float a, const float b) {
  return std::isnan(a) || std::isnan(b) ? std::nanf("") : std::max(a, b);
}

}  // namespace

ScaledState::ScaledState(Tensor stored, const StateFormat format) : stored_(std::move(stored)), format_(format) {
  if (stored_.ndim() != 1 || stored_.dtype() != ops::state_storage_dtype(format_)) {
    throw std::invalid_argument("ScaledState: a 1-D tensor of the format's storage dtype is needed");
  }
}

void ScaledState::read(const int64_t begin, Tensor& out, const float scale) const {
  ops::decode_state(stored_.slice_rows(begin, begin + out.numel()), format_, scale, out);
}

void ScaledState::write(const int64_t begin, const Tensor& in, const float scale) {
  Tensor part = stored_.slice_rows(begin, begin + in.numel());
  ops::encode_state(in, format_, scale, part);
}

void ScaledState::assign(const Tensor& unscaled) {
  if (unscaled.numel() != numel()) throw std::invalid_argument("ScaledState::assign: sizes differ");
  if (format_ == StateFormat::kF32 && unscaled.defined() && unscaled.data<float>() == stored_.data<float>()) return;
  scale_ = quant::state_scale(format_, ops::abs_max(unscaled));
  ops::encode_state(unscaled, format_, scale_, stored_);
}

Tensor ScaledState::unscaled(const MemCategory category) const {
  Tensor out({numel()}, DType::kF32, category);
  read(0, out);
  return out;
}

void scaled_adamw_step(Tensor& param, const Tensor& grad, ScaledState& exp_avg, ScaledState& exp_avg_sq,
                       ScaledState* main, const DType params_dtype, const ops::AdamWHyper& hyper, Tensor* remainder) {
  const int64_t n = param.numel();
  if (grad.numel() != n || exp_avg.numel() != n || exp_avg_sq.numel() != n || (main && main->numel() != n) ||
      (remainder && remainder->numel() != n)) {
    throw std::invalid_argument("scaled_adamw_step: the piece's tensors differ in size");
  }
  if (main && remainder) throw std::invalid_argument("scaled_adamw_step: main parameters or remainders, not both");
  if (n == 0) return;
  const Tensor param_flat = param.view({n}), grad_flat = grad.view({n});
  const int64_t chunk = std::min(n, kChunk);
  Tensor p_C({chunk}, DType::kF32, MemCategory::kOptimizer);
  Tensor m_C({chunk}, DType::kF32, MemCategory::kOptimizer);
  Tensor v_C({chunk}, DType::kF32, MemCategory::kOptimizer);
  // One pass over the chunks: the old states unscaled with their old scales, the fp32 update; then either the updated
  // states' absmax (measure) or the states, with their new scales, and the weights written (store).
  const float old_m = exp_avg.scale(), old_v = exp_avg_sq.scale(), old_main = main ? main->scale() : 1.0f;
  float absmax_m = 0.0f, absmax_v = 0.0f, absmax_main = 0.0f;
  const auto pass = [&](const bool store) {
    for (int64_t begin = 0; begin < n; begin += chunk) {
      const int64_t k = std::min(chunk, n - begin);
      Tensor p_K = p_C.slice_rows(0, k), m_K = m_C.slice_rows(0, k), v_K = v_C.slice_rows(0, k);
      Tensor param_K = param_flat.slice_rows(begin, begin + k);
      exp_avg.read(begin, m_K, old_m);
      exp_avg_sq.read(begin, v_K, old_v);
      if (main) {
        main->read(begin, p_K, old_main);
      } else if (remainder) {
        ops::join_param_remainders(param_K, remainder->slice_rows(begin, begin + k), p_K);
      } else {
        p_K.copy_from(param_K);
      }
      ops::adamw_step(p_K, grad_flat.slice_rows(begin, begin + k), m_K, v_K, hyper);
      if (!store) {
        absmax_m = max_keep_nan(absmax_m, ops::abs_max(m_K));
        absmax_v = max_keep_nan(absmax_v, ops::abs_max(v_K));
        if (main) absmax_main = max_keep_nan(absmax_main, ops::abs_max(p_K));
        continue;
      }
      exp_avg.write(begin, m_K);
      exp_avg_sq.write(begin, v_K);
      if (remainder) {
        Tensor rem_K = remainder->slice_rows(begin, begin + k);
        ops::split_param_remainders(p_K, param_K, rem_K);
        continue;
      }
      param_K.copy_from(p_K);
      if (main) {
        ops::round_to_dtype_(param_K, params_dtype);
        main->write(begin, p_K);
      }
    }
  };
  if (exp_avg.scaled() || exp_avg_sq.scaled() || (main && main->scaled())) {
    pass(false);
    exp_avg.set_scale(quant::state_scale(exp_avg.format(), absmax_m));
    exp_avg_sq.set_scale(quant::state_scale(exp_avg_sq.format(), absmax_v));
    if (main) main->set_scale(quant::state_scale(main->format(), absmax_main));
  }
  pass(true);
}

}  // namespace moecore
