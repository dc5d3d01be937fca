// MoEConfig validation and the --moe-layer-freq parser. The checks mirror Megatron's (validate_args in
// megatron/training/arguments.py, TransformerConfig.__post_init__, and the asserts in the router and experts), each
// as one line that names the flags involved.
#include "moecore/moe/moe_config.h"

#include <algorithm>
#include <charconv>
#include <string_view>

#include "moecore/model/config.h"

namespace moecore {
namespace {

void require(const bool ok, const std::string& message) {
  if (!ok) throw ConfigError(message);
}

std::string str(const int64_t value) { return std::to_string(value); }

// Longest list a --moe-layer-freq expression may build on the way (guards "[1]*10**9"-like input).
constexpr int64_t kMaxPatternLength = int64_t{1} << 20;

// A value of the expression language: an int or a list of ints.
struct PatternValue {
  bool is_list = false;
  int64_t number = 0;
  std::vector<int64_t> items;
};

// Evaluates the Python list expressions Megatron's moe_freq_type passes to eval() after checking that only
// digits, ',', '[', ']', '(', ')', '+' and '*' occur: int and list literals, parentheses, '+' (int addition or list
// concatenation), '*' (int product or list repetition, either order) and unary '+', with Python's precedence.
// Whitespace is also accepted (Megatron rejects it). Tuples are rejected, as Megatron rejects a non-list pattern.
class PatternParser {
 public:
  explicit PatternParser(const std::string& text) : text_(text) {}

  PatternValue parse() {
    PatternValue value = sum();
    skip_space();
    if (pos_ != text_.size()) fail("unexpected '" + std::string(1, text_[pos_]) + "' at position " + str(pos_));
    return value;
  }

 private:
  [[noreturn]] void fail(const std::string& reason) const {
    throw ConfigError("invalid --moe-layer-freq '" + text_ + "': " + reason);
  }

  void skip_space() {
    while (pos_ < text_.size() && (text_[pos_] == ' ' || text_[pos_] == '\t')) ++pos_;
  }

  bool peek(const char c) {
    skip_space();
    return pos_ < text_.size() && text_[pos_] == c;
  }

  bool consume(const char c) {
    if (!peek(c)) return false;
    ++pos_;
    return true;
  }

  void expect(const char c) {
    if (consume(c)) return;
    if (pos_ >= text_.size()) fail("expected '" + std::string(1, c) + "' at the end");
    fail("expected '" + std::string(1, c) + "' at position " + str(pos_) + ", found '" + text_[pos_] + "'");
  }

  PatternValue sum() {
    PatternValue value = product();
    while (consume('+')) value = add(value, product());
    return value;
  }

  PatternValue product() {
    PatternValue value = unary();
    while (consume('*')) value = multiply(value, unary());
    return value;
  }

  PatternValue unary() {
    if (!consume('+')) return atom();
    PatternValue value = unary();
    if (value.is_list) fail("unary '+' applied to a list");
    return value;
  }

  PatternValue atom() {
    skip_space();
    if (consume('(')) {
      PatternValue value = sum();
      if (peek(',')) fail("tuples are not a layer pattern (use a list: [...])");
      expect(')');
      return value;
    }
    if (consume('[')) {
      PatternValue list;
      list.is_list = true;
      while (!peek(']')) {
        const PatternValue item = sum();
        if (item.is_list) fail("nested lists are not a layer pattern");
        list.items.push_back(item.number);
        if (!consume(',')) break;
      }
      expect(']');
      return list;
    }
    if (pos_ < text_.size() && text_[pos_] >= '0' && text_[pos_] <= '9') {
      PatternValue value;
      const auto [end, error] = std::from_chars(text_.data() + pos_, text_.data() + text_.size(), value.number);
      if (error != std::errc()) fail("number too large");
      pos_ = static_cast<size_t>(end - text_.data());
      return value;
    }
    if (pos_ >= text_.size()) fail("expression ends early");
    fail("unexpected '" + std::string(1, text_[pos_]) + "' at position " + str(pos_));
  }

  PatternValue add(PatternValue left, const PatternValue& right) {
    if (left.is_list != right.is_list) fail("cannot add a list and a number");
    if (left.is_list) {
      if (static_cast<int64_t>(left.items.size() + right.items.size()) > kMaxPatternLength) fail("pattern too long");
      left.items.insert(left.items.end(), right.items.begin(), right.items.end());
    } else if (__builtin_add_overflow(left.number, right.number, &left.number)) {
      fail("number too large");
    }
    return left;
  }

  PatternValue multiply(PatternValue left, PatternValue right) {
    if (left.is_list && right.is_list) fail("cannot multiply two lists");
    if (!left.is_list && !right.is_list) {
      if (__builtin_mul_overflow(left.number, right.number, &left.number)) fail("number too large");
      return left;
    }
    if (right.is_list) std::swap(left, right);  // list * count
    const int64_t count = right.number;
    const auto size = static_cast<int64_t>(left.items.size());
    if (size > 0 && count > kMaxPatternLength / size) fail("pattern too long");
    PatternValue repeated;
    repeated.is_list = true;
    for (int64_t i = 0; i < count; ++i)
      repeated.items.insert(repeated.items.end(), left.items.begin(), left.items.end());
    return repeated;
  }

  const std::string& text_;
  size_t pos_ = 0;
};

std::string_view trimmed(std::string_view text) {
  while (!text.empty() && (text.front() == ' ' || text.front() == '\t')) text.remove_prefix(1);
  while (!text.empty() && (text.back() == ' ' || text.back() == '\t')) text.remove_suffix(1);
  return text;
}

}  // namespace

std::vector<bool> parse_moe_layer_freq(const std::string& text, const int64_t num_layers) {
  const auto fail = [&](const std::string& reason) {
    throw ConfigError("invalid --moe-layer-freq '" + text + "': " + reason);
  };
  std::vector<bool> pattern;
  if (text.find('[') == std::string::npos) {
    // Megatron: int(x). Layer i (0-based) is MoE iff i % N == 0.
    std::string_view digits = trimmed(text);
    if (!digits.empty() && digits.front() == '+') digits.remove_prefix(1);
    int64_t every = 0;
    const auto [end, error] = std::from_chars(digits.data(), digits.data() + digits.size(), every);
    if (digits.empty() || error != std::errc() || end != digits.data() + digits.size()) {
      fail("expected an integer N or a list expression such as ([0]*3+[1]*9)");
    }
    if (every < 1) fail("the frequency must be a positive integer");
    for (int64_t layer = 0; layer < num_layers; ++layer) pattern.push_back(layer % every == 0);
    return pattern;
  }

  const PatternValue value = PatternParser(text).parse();
  if (!value.is_list) fail("the expression gives a number, not a list");
  for (const int64_t item : value.items) {
    if (item != 0 && item != 1) fail("entries must be 0 (dense) or 1 (MoE), found " + str(item));
    pattern.push_back(item == 1);
  }
  if (static_cast<int64_t>(pattern.size()) != num_layers) {
    fail("the pattern has " + str(static_cast<int64_t>(pattern.size())) + " entries but --num-layers is " +
         str(num_layers));
  }
  return pattern;
}

void MoEConfig::validate(const int64_t num_layers) const {
  require(num_experts >= 0, "--num-experts must be positive, or 0 for a dense model (got " + str(num_experts) + ")");
  if (!enabled()) return;

  require(ffn_hidden_size > 0, "--moe-ffn-hidden-size must be positive (got " + str(ffn_hidden_size) + ")");
  require(static_cast<int64_t>(moe_layer_pattern.size()) == num_layers,
          "--moe-layer-freq pattern has " + str(static_cast<int64_t>(moe_layer_pattern.size())) +
              " entries but --num-layers is " + str(num_layers));

  // Routing-map padding for quantization (TransformerConfig.__post_init__).
  require(router_padding_multiple >= 0,
          "the routing-map padding multiple must not be negative (got " + str(router_padding_multiple) + ")");
  require(router_padding_multiple == 0 || dispatcher_type != TokenDispatcherType::kAllGather,
          "the allgather dispatcher does not support --moe-router-padding-for-quantization (use "
          "--moe-token-dispatcher-type alltoall or flex)");
  require(router_padding_multiple == 0 || !pad_expert_input_to_capacity,
          "--moe-router-padding-for-quantization with --moe-pad-expert-input-to-capacity is not implemented yet");

  // Router.
  require(topk >= 1, "--moe-router-topk must be positive (got " + str(topk) + ")");
  require(topk <= num_experts,
          "--moe-router-topk (" + str(topk) + ") must not exceed --num-experts (" + str(num_experts) + ")");
  bool uses_sinkhorn = false;
  for (const LoadBalancingType type : load_balancing_types) uses_sinkhorn |= type == LoadBalancingType::kSinkhorn;
  // Megatron: softmax over the single selected logit is constant 1, so its gradient would be zero.
  require(!(topk == 1 && score_function == RouterScoreFunction::kSoftmax && !pre_softmax && !uses_sinkhorn),
          "--moe-router-topk 1 with softmax scores requires --moe-router-pre-softmax");
  if (topk_scaling_factor.has_value()) {
    require(*topk_scaling_factor > 0.0,
            "--moe-router-topk-scaling-factor must be positive (got " + std::to_string(*topk_scaling_factor) + ")");
  }
  require(input_jitter_eps >= 0.0 && input_jitter_eps < 1.0,
          "--moe-input-jitter-eps must be in [0, 1) (got " + std::to_string(input_jitter_eps) + ")");

  // Group-limited routing.
  if (num_groups != 0 || group_topk != 0) {
    require(group_topk != 0, "--moe-router-num-groups requires --moe-router-group-topk");
    require(num_groups != 0, "--moe-router-group-topk requires --moe-router-num-groups");
    require(num_groups > 0, "--moe-router-num-groups must be positive (got " + str(num_groups) + ")");
    require(group_topk > 0, "--moe-router-group-topk must be positive (got " + str(group_topk) + ")");
    require(num_experts % num_groups == 0, "--num-experts (" + str(num_experts) +
                                               ") must be divisible by --moe-router-num-groups (" + str(num_groups) +
                                               ")");
    require(group_topk <= num_groups, "--moe-router-group-topk (" + str(group_topk) +
                                          ") must not exceed --moe-router-num-groups (" + str(num_groups) + ")");
    // Megatron's group_limited_topk scores a group by its top-(topk // group_topk) experts (floor division: topk need
    // not be a multiple of group_topk); with topk < group_topk that is no expert, every group scores 0 and the kept
    // groups depend on the top-k kernel's tie order, so moecore refuses it.
    require(topk >= group_topk, "--moe-router-topk (" + str(topk) + ") must be at least --moe-router-group-topk (" +
                                    str(group_topk) + "): groups are scored by their top-(topk // group_topk) experts");
    const int64_t reachable = group_topk * (num_experts / num_groups);
    require(topk <= reachable, "--moe-router-topk (" + str(topk) + ") exceeds the " + str(reachable) +
                                   " experts in the --moe-router-group-topk (" + str(group_topk) + ") kept groups");
  }

  // Aux-loss-free balancing.
  require(!enable_expert_bias || score_function != RouterScoreFunction::kSoftmax,
          "--moe-router-enable-expert-bias requires --moe-router-score-function sigmoid or sqrtsoftplus (got softmax)");
  require(bias_update_rate >= 0.0,
          "--moe-router-bias-update-rate must be non-negative (got " + std::to_string(bias_update_rate) + ")");

  // Load-balancing losses.
  require(!load_balancing_types.empty(), "--moe-router-load-balancing-type needs at least one type");
  require(aux_loss_coeffs.size() == load_balancing_types.size(),
          "--moe-aux-loss-coeff has " + str(static_cast<int64_t>(aux_loss_coeffs.size())) +
              " value(s) but --moe-router-load-balancing-type has " +
              str(static_cast<int64_t>(load_balancing_types.size())) + " type(s): give one coefficient per type");
  for (size_t i = 0; i < load_balancing_types.size(); ++i) {
    require(load_balancing_types[i] != LoadBalancingType::kSinkhorn || aux_loss_coeffs[i] == 0.0,
            "--moe-router-load-balancing-type sinkhorn does not use an auxiliary loss: its --moe-aux-loss-coeff must "
            "be 0 (got " +
                std::to_string(aux_loss_coeffs[i]) + ")");
    require(aux_loss_coeffs[i] >= 0.0,
            "--moe-aux-loss-coeff must be non-negative (got " + std::to_string(aux_loss_coeffs[i]) + ")");
  }
  require(z_loss_coeff >= 0.0, "--moe-z-loss-coeff must be non-negative (got " + std::to_string(z_loss_coeff) + ")");

  // Capacity and token dropping.
  if (capacity_factor.has_value()) {
    require(*capacity_factor > 0.0,
            "--moe-expert-capacity-factor must be positive (a negative value means dropless; "
            "got " +
                std::to_string(*capacity_factor) + ")");
    require(!uses_sinkhorn,
            "--moe-expert-capacity-factor works only with aux_loss, seq_aux_loss, global_aux_loss or none load "
            "balancing (got sinkhorn)");
  }
  require(!pad_expert_input_to_capacity || capacity_factor.has_value(),
          "--moe-pad-expert-input-to-capacity requires --moe-expert-capacity-factor");

  // Experts.
  require(memory_efficient_permutation || !apply_probs_on_input,
          "--no-moe-memory-efficient-permutation cannot be combined with --moe-apply-probs-on-input");
  require(!apply_probs_on_input || topk == 1,
          "--moe-apply-probs-on-input requires --moe-router-topk 1 (got " + str(topk) + ")");
  require(shared_expert_intermediate_size >= 0,
          "--moe-shared-expert-intermediate-size must be positive (got " + str(shared_expert_intermediate_size) + ")");
  require(!shared_expert_gate || shared_expert_intermediate_size > 0,
          "--moe-shared-expert-gate requires --moe-shared-expert-intermediate-size");
  // Megatron's TransformerConfig: the overlap runs inside the alltoall or flex dispatcher.
  require(!shared_expert_overlap || shared_expert_intermediate_size > 0,
          "--moe-shared-expert-overlap requires --moe-shared-expert-intermediate-size");
  require(!shared_expert_overlap || dispatcher_type != TokenDispatcherType::kAllGather,
          "moe_shared_expert_overlap only works with alltoall or flex token dispatcher.");
  // LatentMoE (Megatron's arguments.py and MoELayer.preprocess: the shared experts must see the full hidden states,
  // which the overlapped dispatcher's launch point does not have in training).
  require(latent_size >= 0,
          "MoE latent projection dimension has to be greater than zero (--moe-latent-size " + str(latent_size) + ")");
  require(latent_size == 0 || !shared_expert_overlap,
          "Shared expert overlap with MoE latent projections is not supported during training. Disable "
          "--moe-shared-expert-overlap.");
  // Megatron's flex backends (DeepEP's drop_and_pad, NCCL EP's check) do not pad experts to capacity.
  require(!pad_expert_input_to_capacity || dispatcher_type != TokenDispatcherType::kFlex,
          "drop and pad is not supported with --moe-token-dispatcher-type flex");
}

std::string to_string(const RouterScoreFunction value) {
  switch (value) {
    case RouterScoreFunction::kSoftmax: return "softmax";
    case RouterScoreFunction::kSigmoid: return "sigmoid";
    case RouterScoreFunction::kSqrtSoftplus: return "sqrtsoftplus";
  }
  return "?";
}

std::string to_string(const LoadBalancingType value) {
  switch (value) {
    case LoadBalancingType::kAuxLoss: return "aux_loss";
    case LoadBalancingType::kSeqAuxLoss: return "seq_aux_loss";
    case LoadBalancingType::kGlobalAuxLoss: return "global_aux_loss";
    case LoadBalancingType::kSinkhorn: return "sinkhorn";
    case LoadBalancingType::kNone: return "none";
  }
  return "?";
}

double aux_loss_coeff(const MoEConfig& config, const LoadBalancingType type) {
  const auto& types = config.load_balancing_types;
  const auto it = std::find(types.begin(), types.end(), type);
  const auto index = static_cast<size_t>(it - types.begin());
  return it == types.end() || index >= config.aux_loss_coeffs.size() ? 0.0 : config.aux_loss_coeffs[index];
}

bool aux_losses_on(const MoEConfig& config) {
  return aux_loss_coeff(config, LoadBalancingType::kAuxLoss) > 0 ||
         aux_loss_coeff(config, LoadBalancingType::kSeqAuxLoss) > 0 ||
         aux_loss_coeff(config, LoadBalancingType::kGlobalAuxLoss) > 0;
}

}  // namespace moecore
