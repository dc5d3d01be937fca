#include "moecore/plan/plan_args.h"

#include <algorithm>
#include <charconv>
#include <functional>
#include <map>
#include <set>

#include "moecore/config/flag_catalog.h"
#include "moecore/pipeline/pipeline_layout.h"
#include "moecore/plan/hf_flags.h"
#include "moecore/util/flag_suggest.h"

namespace moecore::plan {
namespace {

void require(const bool ok, const std::string& message) {
  if (!ok) throw ConfigError(message);
}

int64_t to_integer(const std::string& flag, const std::string& text, const int64_t min, const int64_t max) {
  int64_t value = 0;
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  require(!text.empty() && error == std::errc() && end == text.data() + text.size(),
          "invalid value '" + text + "' for " + flag + ": expected an integer");
  require(value >= min && value <= max,
          flag + " must be in [" + std::to_string(min) + ", " + std::to_string(max) + "], got " + text);
  return value;
}

double to_real(const std::string& flag, const std::string& text, const double max) {
  size_t used = 0;
  double value = 0;
  try {
    value = std::stod(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  require(used == text.size() && used > 0, "invalid value '" + text + "' for " + flag + ": expected a number");
  require(value > 0 && value <= max,
          flag + " must be in (0, " + std::to_string(static_cast<int64_t>(max)) + "], got " + text);
  return value;
}

constexpr int64_t kMaxWidth = int64_t{1} << 24;
constexpr int64_t kMaxGpus = int64_t{1} << 20;

// Layout flags: the search replaces them; the rest of train's flags describe the model and the batch.
const std::set<std::string> kLayoutValueFlags = {"--tensor-model-parallel-size",
                                                 "--pipeline-model-parallel-size",
                                                 "--context-parallel-size",
                                                 "--expert-model-parallel-size",
                                                 "--expert-tensor-parallel-size",
                                                 "--pipeline-model-parallel-layout",
                                                 "--decoder-first-pipeline-num-layers",
                                                 "--decoder-last-pipeline-num-layers",
                                                 "--num-virtual-stages-per-pipeline-rank",
                                                 "--num-layers-per-virtual-pipeline-stage"};

const std::vector<std::string> kRecomputeModules = {"core_attn", "moe_act", "layernorm",     "mla_up_proj",
                                                    "mlp",       "moe",     "shared_experts"};

struct Parser {
  explicit Parser(PlanArgs& o) : out(o) {}
  PlanArgs& out;
  std::vector<std::string> rest;              // for train's parser, in order
  std::map<std::string, std::string> layout;  // layout flag -> value (last wins)
  std::vector<std::string> layout_switches;   // --account-for-* as given
  bool have_tokenizer = false, have_mbs = false, have_iters = false, have_lr = false, have_data = false;
  bool have_mla_field = false;
  bool vocab_given = false;
  std::string tokenizer;
  std::optional<int64_t> mtp;
  MlaShape mla;
  bool mla_on = false;
  std::optional<std::string> granularity, method;
  std::optional<int64_t> recompute_layers;
  std::optional<std::vector<std::string>> modules;
  bool recompute_activations = false;
};

std::vector<std::string> planner_flags() {
  return {"--hf-config",
          "--vocab-size",
          "--multi-latent-attention",
          "--q-lora-rank",
          "--kv-lora-rank",
          "--qk-head-dim",
          "--qk-pos-emb-head-dim",
          "--v-head-dim",
          "--mtp-num-layers",
          "--recompute-granularity",
          "--recompute-method",
          "--recompute-num-layers",
          "--recompute-modules",
          "--recompute-activations",
          "--no-moe-memory-efficient-permutation",
          "--moe-token-dispatcher-type",
          "--overlap-moe-expert-parallel-comm",
          "--num-gpus",
          "--gpu",
          "--gpu-memory-gib",
          "--peak-tflops-bf16",
          "--peak-tflops-fp8",
          "--peak-tflops-fp4",
          "--hbm-tbps",
          "--gpus-per-domain",
          "--intra-domain-gbps",
          "--inter-domain-gbps",
          "--search",
          "--top",
          "--json",
          "--help"};
}

// Splits "--flag=value" and walks the tokens, taking the planner's flags and passing the others on.
void parse_tokens(Parser& p, const std::vector<std::string>& tokens, const bool from_hf) {
  std::optional<std::string> gpu;
  std::vector<std::pair<std::string, std::string>> overrides;
  for (size_t i = 0; i < tokens.size(); ++i) {
    std::string flag = tokens[i];
    std::optional<std::string> inline_value;
    if (flag.rfind("--", 0) == 0) {
      if (const size_t eq = flag.find('='); eq != std::string::npos) {
        inline_value = flag.substr(eq + 1);
        flag = flag.substr(0, eq);
      }
    }
    const auto value = [&]() -> std::string {
      if (inline_value) return *inline_value;
      require(i + 1 < tokens.size() && !looks_like_train_flag(tokens[i + 1]), flag + " expects a value");
      return tokens[++i];
    };
    const auto switch_only = [&] { require(!inline_value, flag + " takes no value"); };
    if (flag == "--hf-config") {
      require(!from_hf, "--hf-config: nested --hf-config");
      parse_tokens(p, megatron_flags_from_hf_config(value()), true);
    } else if (flag == "--vocab-size") {
      p.out.vocab_size = to_integer(flag, value(), 1, INT32_MAX);
      p.vocab_given = true;
    } else if (flag == "--multi-latent-attention") {
      switch_only();
      p.mla_on = true;
      p.rest.push_back(flag);  // train builds multi-latent attention too (its memory on --gpu cpu)
    } else if (flag == "--q-lora-rank" || flag == "--kv-lora-rank" || flag == "--qk-head-dim" ||
               flag == "--qk-pos-emb-head-dim" || flag == "--v-head-dim") {
      const std::string text = value();
      const int64_t number = to_integer(flag, text, flag == "--qk-pos-emb-head-dim" ? 0 : 1, kMaxWidth);
      if (flag == "--q-lora-rank") p.mla.q_lora_rank = number;
      if (flag == "--kv-lora-rank") p.mla.kv_lora_rank = number;
      if (flag == "--qk-head-dim") p.mla.qk_head_dim = number;
      if (flag == "--qk-pos-emb-head-dim") p.mla.qk_pos_emb_head_dim = number;
      if (flag == "--v-head-dim") p.mla.v_head_dim = number;
      p.have_mla_field = true;
      p.rest.insert(p.rest.end(), {flag, text});
    } else if (flag == "--mtp-num-layers") {
      const std::string text = value();
      p.mtp = to_integer(flag, text, 0, 1 << 16);
      p.rest.insert(p.rest.end(), {flag, text});  // train builds the depths too (their memory on --gpu cpu)
    } else if (flag == "--recompute-granularity") {
      p.granularity = value();
      require(*p.granularity == "full" || *p.granularity == "selective",
              "invalid choice '" + *p.granularity + "' for --recompute-granularity (choose from full, selective)");
    } else if (flag == "--recompute-method") {
      p.method = value();
      require(*p.method == "uniform" || *p.method == "block",
              "invalid choice '" + *p.method + "' for --recompute-method (choose from uniform, block)");
    } else if (flag == "--recompute-num-layers") {
      p.recompute_layers = to_integer(flag, value(), 1, 1 << 16);
    } else if (flag == "--recompute-modules") {
      std::vector<std::string> list;
      if (inline_value) list.push_back(*inline_value);
      while (i + 1 < tokens.size() && !looks_like_train_flag(tokens[i + 1])) list.push_back(tokens[++i]);
      require(!list.empty(), "--recompute-modules expects at least one module");
      for (const std::string& m : list) {
        std::string known;
        for (const std::string& k : kRecomputeModules) known += (known.empty() ? "" : ", ") + k;
        require(std::find(kRecomputeModules.begin(), kRecomputeModules.end(), m) != kRecomputeModules.end(),
                "invalid choice '" + m + "' for --recompute-modules (choose from " + known + ")");
      }
      p.modules = list;
    } else if (flag == "--recompute-activations") {
      switch_only();
      p.recompute_activations = true;
    } else if (flag == "--no-moe-memory-efficient-permutation") {
      switch_only();
      p.out.memory_efficient_permutation = false;
    } else if (flag == "--moe-token-dispatcher-type") {
      const std::string type = value();
      require(type == "allgather" || type == "alltoall" || type == "flex",
              "invalid choice '" + type + "' for --moe-token-dispatcher-type (choose from allgather, alltoall, flex)");
      p.out.dispatcher = type;
    } else if (flag == "--overlap-moe-expert-parallel-comm") {
      switch_only();
      p.out.overlap_moe_expert_parallel_comm = true;
    } else if (flag == "--num-gpus") {
      p.out.num_gpus = to_integer(flag, value(), 1, kMaxGpus);
    } else if (flag == "--gpu") {
      gpu = value();
    } else if (flag == "--gpu-memory-gib" || flag == "--peak-tflops-bf16" || flag == "--peak-tflops-fp8" ||
               flag == "--peak-tflops-fp4" || flag == "--hbm-tbps" || flag == "--intra-domain-gbps" ||
               flag == "--inter-domain-gbps" || flag == "--gpus-per-domain") {
      overrides.emplace_back(flag, value());
    } else if (flag == "--search") {
      switch_only();
      p.out.search = true;
    } else if (flag == "--top") {
      p.out.top = to_integer(flag, value(), 1, 1 << 20);
    } else if (flag == "--json") {
      switch_only();
      p.out.json = true;
    } else if (flag == "--help" || flag == "-h") {
      p.out.help_requested = true;
    } else if (kLayoutValueFlags.count(flag)) {
      p.layout[flag] = value();
    } else if (flag == "--account-for-embedding-in-pipeline-split" || flag == "--account-for-loss-in-pipeline-split") {
      switch_only();
      p.layout_switches.push_back(flag);
    } else {
      if (flag == "--tokenizer-type") {
        p.have_tokenizer = true;
        p.tokenizer = inline_value ? *inline_value : (i + 1 < tokens.size() ? tokens[i + 1] : "");
      }
      if (flag == "--micro-batch-size") p.have_mbs = true;
      if (flag == "--train-iters") p.have_iters = true;
      if (flag == "--lr") p.have_lr = true;
      if (flag == "--data-path" || flag == "--mock-data") p.have_data = true;
      p.rest.push_back(tokens[i]);
    }
  }
  if (gpu) p.out.cluster = cluster_preset(*gpu);
  for (const auto& [flag, text] : overrides) {
    Cluster& c = p.out.cluster;
    if (flag == "--gpus-per-domain") {
      c.gpus_per_domain = to_integer(flag, text, 1, kMaxGpus);
      continue;
    }
    const double v = to_real(flag, text, 1e9);
    if (flag == "--gpu-memory-gib") c.memory_gib = v;
    if (flag == "--peak-tflops-bf16") c.peak_tflops_bf16 = v;
    if (flag == "--peak-tflops-fp8") c.peak_tflops_fp8 = v;
    if (flag == "--peak-tflops-fp4") c.peak_tflops_fp4 = v;
    if (flag == "--hbm-tbps") c.hbm_tbps = v;
    if (flag == "--intra-domain-gbps") c.intra_domain_gbps = v;
    if (flag == "--inter-domain-gbps") c.inter_domain_gbps = v;
  }
}

Recompute make_recompute(const Parser& p, const PlanArgs& out) {
  Recompute r;
  std::optional<std::string> granularity = p.granularity;
  if (p.recompute_activations) {
    require(!granularity || *granularity == "selective",
            "--recompute-activations sets --recompute-granularity selective; it cannot be combined with full");
    granularity = "selective";
  }
  // Megatron's validate_args / TransformerConfig.__post_init__ checks.
  if (!granularity) {
    require(!p.method && !p.recompute_layers,
            "--recompute-method and --recompute-num-layers require --recompute-granularity full");
    require(!p.modules, "--recompute-modules requires --recompute-granularity selective");
    return r;
  }
  if (*granularity == "full") {
    require(p.method.has_value(), "--recompute-granularity full requires --recompute-method (uniform or block)");
    require(p.recompute_layers.has_value(), "--recompute-granularity full requires --recompute-num-layers");
    require(!p.modules, "--recompute-modules requires --recompute-granularity selective");
    r.granularity = Recompute::Granularity::kFull;
    r.method = *p.method == "uniform" ? Recompute::Method::kUniform : Recompute::Method::kBlock;
    r.num_layers = *p.recompute_layers;
    return r;
  }
  require(!p.method && !p.recompute_layers,
          "--recompute-method and --recompute-num-layers must not be set with --recompute-granularity selective");
  r.granularity = Recompute::Granularity::kSelective;
  r.modules = p.modules.value_or(std::vector<std::string>{"core_attn"});
  const MoEConfig& moe = out.train.model.moe;
  if (r.has("moe_act")) require(moe.grouped_gemm, "--recompute-modules moe_act requires --moe-grouped-gemm");
  if (r.has("mla_up_proj")) {
    require(out.model.mla.has_value(), "--recompute-modules mla_up_proj requires --multi-latent-attention");
  }
  if (r.has("shared_experts")) {
    require(!moe.shared_expert_overlap,
            "--recompute-modules shared_experts cannot be combined with --moe-shared-expert-overlap");
  }
  if (r.has("moe_act") || r.has("layernorm")) {
    require(!(out.train.fp8_format && out.train.fp8_recipe.value_or("delayed") == "delayed"),
            "--recompute-modules moe_act / layernorm cannot be used with the delayed FP8 recipe");
  }
  return r;
}

std::string join_cells(const std::vector<std::string>& cells) {
  std::string text;
  for (size_t i = 0; i < cells.size(); ++i) text += (i ? "|" : "") + cells[i];
  return text;
}

// train's flags for one layout: the model flags plus the layout's.
std::vector<std::string> train_tokens(const PlanArgs& args, const LayoutChoice& layout,
                                      const std::vector<std::string>& split_switches,
                                      const std::map<std::string, std::string>& split_values) {
  std::vector<std::string> tokens = args.model_flags;
  const auto add = [&](const std::string& flag, const int64_t v) {
    tokens.push_back(flag);
    tokens.push_back(std::to_string(v));
  };
  add("--tensor-model-parallel-size", layout.tp);
  add("--pipeline-model-parallel-size", layout.pp);
  add("--context-parallel-size", layout.cp);
  add("--expert-model-parallel-size", layout.ep);
  add("--expert-tensor-parallel-size", layout.etp);
  if (layout.pipeline_layout) {
    // The MTP cells are placed by the planner (mtp_layers_by_stage), which models Megatron's standalone MTP stages
    // too; train's split gets the layout without them, and so no MTP depths of its own.
    std::vector<std::string> cells = parallel::parse_pipeline_layout(*layout.pipeline_layout);
    for (std::string& cell : cells) cell.erase(std::remove(cell.begin(), cell.end(), 'm'), cell.end());
    tokens.push_back("--pipeline-model-parallel-layout=" + join_cells(cells));
    tokens.insert(tokens.end(), {"--mtp-num-layers", "0"});
  } else {
    if (layout.vpp > 1) add("--num-virtual-stages-per-pipeline-rank", layout.vpp);
    for (const auto& [flag, value] : split_values) {
      tokens.push_back(flag);
      tokens.push_back(value);
    }
    for (const std::string& s : split_switches) tokens.push_back(s);
  }
  return tokens;
}

void finish(PlanArgs& out, const LayoutChoice& layout, const std::vector<std::string>& split_switches,
            const std::map<std::string, std::string>& split_values) {
  out.train = parse_train_args(train_tokens(out, layout, split_switches, split_values), static_cast<int>(out.num_gpus));
  // NullTokenizer's vocabulary is --vocab-size + 1 (EOD): the planner's --vocab-size is the whole vocabulary.
  out.model.config = out.train.model;
  out.model.config.vocab_size = padded_vocab_size(out.vocab_size, out.train);
  out.layout = layout;
  out.layout.vpp = out.train.virtual_pipeline_model_parallel_size;
  out.mtp_stages.clear();
  if (layout.pipeline_layout) {
    const std::vector<std::string> cells = parallel::parse_pipeline_layout(*layout.pipeline_layout);
    int64_t total = 0;
    for (size_t s = 0; s < cells.size(); ++s) {
      const auto count = static_cast<int64_t>(std::count(cells[s].begin(), cells[s].end(), 'm'));
      if (count > 0) out.mtp_stages.emplace_back(static_cast<int64_t>(s), count);
      total += count;
    }
    require(total == 0 || total == out.model.mtp_num_layers,
            "--pipeline-model-parallel-layout places " + std::to_string(total) + " MTP layers ('m') but " +
                "--mtp-num-layers is " + std::to_string(out.model.mtp_num_layers));
  }
}

}  // namespace

bool Recompute::has(const std::string& module) const {
  return granularity == Granularity::kSelective && std::find(modules.begin(), modules.end(), module) != modules.end();
}

std::string LayoutChoice::describe() const {
  return "TP" + std::to_string(tp) + " PP" + std::to_string(pp) + " VPP" + std::to_string(vpp) + " CP" +
         std::to_string(cp) + " EP" + std::to_string(ep) + " ETP" + std::to_string(etp);
}

PlanArgs parse_plan_args(const std::vector<std::string>& args) {
  PlanArgs out;
  out.cluster = cluster_preset("H100");
  Parser p(out);
  parse_tokens(p, args, false);
  if (out.help_requested) return out;
  // Unknown flags first, with suggestions from train's flags and the planner's (train's parser would suggest only
  // its own); Megatron flags moecore does not implement get train's message from its parser.
  std::vector<std::string> known = implemented_train_flags();
  const std::vector<std::string> planner = planner_flags();
  known.insert(known.end(), planner.begin(), planner.end());
  for (const std::string& token : p.rest) {
    if (!looks_like_train_flag(token)) continue;
    const std::string flag = token.substr(0, token.find('='));
    if (std::find(known.begin(), known.end(), flag) != known.end() || is_unimplemented_megatron_flag(flag)) continue;
    const std::string closest = closest_flag(flag, known);
    throw ConfigError("unknown flag " + flag + (closest.empty() ? "" : " (did you mean " + closest + "?)"));
  }
  require(out.num_gpus > 0, "missing required flag: --num-gpus");
  // train's required flags that do not shape a plan.
  if (!p.have_mbs) p.rest.insert(p.rest.end(), {"--micro-batch-size", "1"});
  if (!p.have_iters) p.rest.insert(p.rest.end(), {"--train-iters", "1"});
  if (!p.have_lr) p.rest.insert(p.rest.end(), {"--lr", "1e-4"});
  if (!p.have_data) p.rest.push_back("--mock-data");
  if (!p.have_tokenizer) {
    p.rest.insert(p.rest.end(),
                  {"--tokenizer-type", "NullTokenizer", "--vocab-size", std::to_string(out.vocab_size - 1)});
  } else {
    // With train's --tokenizer-type NullTokenizer, --vocab-size means what it means to train: the vocabulary
    // before the end-of-document token.
    require(p.tokenizer == "NullTokenizer",
            "moecore plan reads the vocabulary from --vocab-size (or --tokenizer-type NullTokenizer --vocab-size), "
            "not from tokenizer files");
    require(p.vocab_given, "--tokenizer-type NullTokenizer needs --vocab-size");
    p.rest.insert(p.rest.end(), {"--vocab-size", std::to_string(out.vocab_size)});
    out.vocab_size += 1;
  }
  // train implements the allgather and alltoall dispatchers; flex (DeepEP / HybridEP) moves the same bytes.
  p.rest.insert(p.rest.end(),
                {"--moe-token-dispatcher-type", out.dispatcher == "allgather" ? "allgather" : "alltoall"});
  if (p.mla_on) {
    out.model.mla = p.mla;
  } else {
    require(!p.have_mla_field,
            "--q-lora-rank / --kv-lora-rank / --qk-head-dim / --qk-pos-emb-head-dim / "
            "--v-head-dim require --multi-latent-attention");
  }
  out.model.mtp_num_layers = p.mtp.value_or(0);
  out.model_flags = p.rest;

  LayoutChoice layout;
  const auto take = [&](const std::string& flag, int64_t& field) {
    if (const auto it = p.layout.find(flag); it != p.layout.end()) field = to_integer(flag, it->second, 1, kMaxGpus);
  };
  take("--tensor-model-parallel-size", layout.tp);
  take("--pipeline-model-parallel-size", layout.pp);
  take("--context-parallel-size", layout.cp);
  take("--expert-model-parallel-size", layout.ep);
  layout.etp = layout.tp;  // Megatron's default: the tensor-parallel size
  take("--expert-tensor-parallel-size", layout.etp);
  std::map<std::string, std::string> split_values;
  for (const char* flag : {"--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers",
                           "--num-layers-per-virtual-pipeline-stage"}) {
    if (const auto it = p.layout.find(flag); it != p.layout.end()) split_values[flag] = it->second;
  }
  if (const auto it = p.layout.find("--pipeline-model-parallel-layout"); it != p.layout.end()) {
    layout.pipeline_layout = it->second;
  }
  take("--num-virtual-stages-per-pipeline-rank", layout.vpp);
  finish(out, layout, p.layout_switches, split_values);
  out.recompute = make_recompute(p, out);
  if (out.model.mla) {
    require(!out.train.group_query_attention,
            "--multi-latent-attention cannot be combined with --group-query-attention");
  }
  return out;
}

PlanArgs with_layout(const PlanArgs& base, const LayoutChoice& layout) {
  PlanArgs out = base;
  finish(out, layout, {}, {});
  return out;
}

LayoutSizes layout_sizes(const PlanArgs& args) {
  const TrainingArgs& t = args.train;
  const parallel::PipelineLayout pipeline = pipeline_layout(t);
  LayoutSizes l;
  l.pp = pipeline.pipeline_size();
  l.vpp = pipeline.virtual_pipeline_size();
  l.tp = static_cast<double>(t.parallel.tensor_model_parallel_size);
  l.cp = static_cast<double>(t.parallel.context_parallel_size);
  l.ep = static_cast<double>(t.parallel.expert_model_parallel_size);
  l.etp = static_cast<double>(t.parallel.expert_tensor_parallel());
  l.world = static_cast<double>(t.parallel.world_size);
  l.dp = static_cast<double>(t.data_parallel_size);
  l.microbatches = t.global_batch_size / (t.micro_batch_size * t.data_parallel_size);
  return l;
}

std::map<int64_t, int64_t> mtp_layers_by_stage(const PlanArgs& args, const int pp, const int vpp) {
  std::map<int64_t, int64_t> at;
  for (const auto& [stage, count] : args.mtp_stages) at[stage] += count;
  if (at.empty() && args.model.mtp_num_layers > 0) {
    at[static_cast<int64_t>(vpp) * pp - 1] = args.model.mtp_num_layers;
  }
  return at;
}

std::string plan_flags_help() {
  std::string text =
      "usage: moecore plan --num-gpus N [--gpu NAME] <train's model, batch, precision and layout flags> "
      "[--hf-config CONFIG_JSON_OR_FOLDER] [--search] [--json]\n\nGPU presets:\n";
  for (const std::string& name : cluster_preset_names()) text += "  " + describe_cluster(cluster_preset(name)) + "\n";
  text += "\nplanner flags: ";
  for (const std::string& flag : planner_flags()) text += flag + " ";
  return text + "\n";
}

}  // namespace moecore::plan
