#include "moecore/plan/plan_args.h"

#include <algorithm>
#include <charconv>
#include <functional>
#include <map>
#include <set>

#include "moecore/config/flag_catalog.h"
#include "moecore/pipeline/pipeline_layout.h"
#include "moecore/plan/hf_flags.h"
#include "moecore/util/flag_parser.h"
#include "moecore/util/flag_suggest.h"

namespace moecore::plan {
namespace {

void require(const bool ok, const std::string& message) {
  if (!ok) throw ConfigError(message);
}

// A cluster figure: a finite number in (0, 1e9].
double cluster_figure(const FlagValue& v) {
  const double value = v.real_up_to(1e9);
  if (value <= 0) throw FlagError(std::string(v.flag) + " must be positive (got " + v.text() + ")");
  return value;
}

constexpr int64_t kMaxWidth = int64_t{1} << 24;
constexpr int64_t kMaxGpus = int64_t{1} << 20;

struct Parser {
  explicit Parser(PlanArgs& o) : out(o) {}
  PlanArgs& out;
  std::vector<std::string> rest;             // for train's parser, in order
  std::map<std::string, FlagValue> layout;   // layout flag -> value (last wins)
  std::vector<std::string> layout_switches;  // --account-for-* as given
  bool have_tokenizer = false, have_mbs = false, have_iters = false, have_lr = false, have_data = false;
  bool have_mla_field = false;
  bool vocab_given = false;
  std::string tokenizer;
  std::optional<int64_t> mtp;
  bool mla_on = false;
  bool in_hf_config = false;  // parsing the flags of --hf-config
  std::optional<std::string> gpu;
  std::vector<FlagValue> overrides;  // cluster flags, applied over the --gpu preset
};

// An MLA shape flag: checked here, built by train's parser.
void mla_field(Parser& p, const FlagValue& v, const int64_t min) {
  v.integer_in(min, kMaxWidth);
  p.have_mla_field = true;
  p.rest.insert(p.rest.end(), {std::string(v.flag), v.text()});
}

void parse_tokens(Parser& p, const std::vector<std::string>& tokens);

void add_layout_value(Parser& p, const FlagValue& v) { p.layout.insert_or_assign(std::string(v.flag), v); }
void add_cluster_override(Parser& p, const FlagValue& v) { p.overrides.push_back(v); }

// The planner's own flags; the rest go to train's parser. Flags train builds too are passed on as well.
// clang-format off
const std::vector<FlagSpec<Parser>>& planner_flag_table() {
  static const std::vector<FlagSpec<Parser>> table = {
    {"--hf-config", Arity::kOne, "PATH", "the model from a HuggingFace config.json or the folder holding it",
     [](Parser& p, const FlagValue& v) {
       require(!p.in_hf_config, "--hf-config: nested --hf-config");
       p.in_hf_config = true;
       parse_tokens(p, megatron_flags_from_hf_config(v.text()));
       p.in_hf_config = false;
     }},
    {"--vocab-size", Arity::kOne, "N", "the tokenizer's vocabulary (default 32000)",
     [](Parser& p, const FlagValue& v) {
       p.out.vocab_size = v.integer_in(1, INT32_MAX);
       p.vocab_given = true;
     }},
    {"--multi-latent-attention", Arity::kSwitch, "", "multi-latent attention",
     [](Parser& p, const FlagValue& v) {
       p.mla_on = true;
       p.rest.emplace_back(v.flag);  // train builds multi-latent attention too (its memory on --gpu cpu)
     }},
    {"--q-lora-rank", Arity::kOne, "N", "MLA query latent rank",
     [](Parser& p, const FlagValue& v) { mla_field(p, v, 1); }},
    {"--kv-lora-rank", Arity::kOne, "N", "MLA key / value latent rank",
     [](Parser& p, const FlagValue& v) { mla_field(p, v, 1); }},
    {"--qk-head-dim", Arity::kOne, "N", "MLA query / key channels without RoPE",
     [](Parser& p, const FlagValue& v) { mla_field(p, v, 1); }},
    {"--qk-pos-emb-head-dim", Arity::kOne, "N", "MLA query / key RoPE channels",
     [](Parser& p, const FlagValue& v) { mla_field(p, v, 0); }},
    {"--v-head-dim", Arity::kOne, "N", "MLA value channels",
     [](Parser& p, const FlagValue& v) { mla_field(p, v, 1); }},
    {"--mtp-num-layers", Arity::kOne, "N", "Multi-Token Prediction depths",
     [](Parser& p, const FlagValue& v) {
       p.mtp = v.integer_in(0, 1 << 16);
       p.rest.insert(p.rest.end(), {std::string(v.flag), v.text()});  // train builds the depths too
     }},
    {"--moe-token-dispatcher-type", Arity::kOne, "{allgather,alltoall,flex}", "the dispatcher (flex is modelled as "
     "the all-to-all)",
     [](Parser& p, const FlagValue& v) { p.out.dispatcher = v.choice({"allgather", "alltoall", "flex"}); }},
    {"--overlap-moe-expert-parallel-comm", Arity::kSwitch, "", "Megatron's 1F1B all-to-all overlap",
     [](Parser& p, const FlagValue&) { p.out.overlap_moe_expert_parallel_comm = true; }},
    {"--num-gpus", Arity::kOne, "N", "GPUs of the run (required)",
     [](Parser& p, const FlagValue& v) { p.out.num_gpus = v.integer_in(1, kMaxGpus); }},
    {"--gpu", Arity::kOne, "NAME", "GPU preset (default H100)", [](Parser& p, const FlagValue& v) { p.gpu = v.text(); }},
    {"--gpu-memory-gib", Arity::kOne, "X", "override the preset", add_cluster_override},
    {"--peak-tflops-bf16", Arity::kOne, "X", "override the preset", add_cluster_override},
    {"--peak-tflops-fp8", Arity::kOne, "X", "override the preset", add_cluster_override},
    {"--peak-tflops-fp4", Arity::kOne, "X", "override the preset", add_cluster_override},
    {"--hbm-tbps", Arity::kOne, "X", "override the preset", add_cluster_override},
    {"--gpus-per-domain", Arity::kOne, "N", "override the preset", add_cluster_override},
    {"--intra-domain-gbps", Arity::kOne, "X", "override the preset", add_cluster_override},
    {"--inter-domain-gbps", Arity::kOne, "X", "override the preset", add_cluster_override},
    {"--search", Arity::kSwitch, "", "rank every valid layout of --num-gpus GPUs",
     [](Parser& p, const FlagValue&) { p.out.search = true; }},
    {"--top", Arity::kOne, "N", "with --search, print the N best (default 10)",
     [](Parser& p, const FlagValue& v) { p.out.top = v.integer_in(1, 1 << 20); }},
    {"--json", Arity::kSwitch, "", "one JSON object instead of text", [](Parser& p, const FlagValue&) { p.out.json = true; }},
    // Layout flags: the search replaces them (train's parser checks them for each layout).
    {"--tensor-model-parallel-size", Arity::kOne, "N", "TP", add_layout_value},
    {"--pipeline-model-parallel-size", Arity::kOne, "N", "PP", add_layout_value},
    {"--context-parallel-size", Arity::kOne, "N", "CP", add_layout_value},
    {"--expert-model-parallel-size", Arity::kOne, "N", "EP", add_layout_value},
    {"--expert-tensor-parallel-size", Arity::kOne, "N", "expert TP", add_layout_value},
    {"--pipeline-model-parallel-layout", Arity::kOne, "TEXT", "stages by hand", add_layout_value},
    {"--decoder-first-pipeline-num-layers", Arity::kOne, "N", "uneven split", add_layout_value},
    {"--decoder-last-pipeline-num-layers", Arity::kOne, "N", "uneven split", add_layout_value},
    {"--num-virtual-stages-per-pipeline-rank", Arity::kOne, "N", "interleaved schedule", add_layout_value},
    {"--num-layers-per-virtual-pipeline-stage", Arity::kOne, "N", "interleaved schedule", add_layout_value},
    {"--account-for-embedding-in-pipeline-split", Arity::kSwitch, "", "uniform split",
     [](Parser& p, const FlagValue& v) { p.layout_switches.emplace_back(v.flag); }},
    {"--account-for-loss-in-pipeline-split", Arity::kSwitch, "", "uniform split",
     [](Parser& p, const FlagValue& v) { p.layout_switches.emplace_back(v.flag); }},
  };
  return table;
}
// clang-format on

// Walks the tokens, taking the planner's flags and passing the others on to train's parser.
void parse_tokens(Parser& p, const std::vector<std::string>& tokens) {
  FlagParserOptions options;
  options.pass_on = [&p](const std::string& token) { p.rest.push_back(token); };
  if (parse_flags(planner_flag_table(), tokens, p, options).help_requested) p.out.help_requested = true;
}

// What train's flags among the passed-on tokens tell the planner.
void note_train_flags(Parser& p) {
  for (size_t i = 0; i < p.rest.size(); ++i) {
    const std::string& token = p.rest[i];
    const std::string flag = token.substr(0, token.find('='));
    if (flag == "--tokenizer-type") {
      p.have_tokenizer = true;
      p.tokenizer =
          flag.size() < token.size() ? token.substr(flag.size() + 1) : (i + 1 < p.rest.size() ? p.rest[i + 1] : "");
    }
    if (flag == "--micro-batch-size") p.have_mbs = true;
    if (flag == "--train-iters") p.have_iters = true;
    if (flag == "--lr") p.have_lr = true;
    if (flag == "--data-path" || flag == "--mock-data") p.have_data = true;
  }
}

void apply_cluster(Parser& p) {
  if (p.gpu) p.out.cluster = cluster_preset(*p.gpu);
  for (const FlagValue& value : p.overrides) {
    Cluster& c = p.out.cluster;
    const std::string_view flag = value.flag;
    if (flag == "--gpus-per-domain") {
      c.gpus_per_domain = value.integer_in(1, kMaxGpus);
      continue;
    }
    const double v = cluster_figure(value);
    if (flag == "--gpu-memory-gib") c.memory_gib = v;
    if (flag == "--peak-tflops-bf16") c.peak_tflops_bf16 = v;
    if (flag == "--peak-tflops-fp8") c.peak_tflops_fp8 = v;
    if (flag == "--peak-tflops-fp4") c.peak_tflops_fp4 = v;
    if (flag == "--hbm-tbps") c.hbm_tbps = v;
    if (flag == "--intra-domain-gbps") c.intra_domain_gbps = v;
    if (flag == "--inter-domain-gbps") c.inter_domain_gbps = v;
  }
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
    std::vector<std::string> cells = parse_pipeline_layout(*layout.pipeline_layout);
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
  // The flags' MTP depths: train's split gets none where the layout places them on stages of their own ('m'
  // cells, train_tokens), which the planner models as Megatron does.
  const int64_t mtp_num_layers = out.model.config.mtp_num_layers;
  out.model.config = out.train.model;
  out.model.config.mtp_num_layers = mtp_num_layers;
  // NullTokenizer's vocabulary is --vocab-size + 1 (EOD): the planner's --vocab-size is the whole vocabulary.
  out.model.config.vocab_size = padded_vocab_size(out.vocab_size, out.train);
  out.layout = layout;
  out.layout.vpp = out.train.virtual_pipeline_model_parallel_size;
  out.mtp_stages.clear();
  if (layout.pipeline_layout) {
    const std::vector<std::string> cells = parse_pipeline_layout(*layout.pipeline_layout);
    int64_t total = 0;
    for (size_t s = 0; s < cells.size(); ++s) {
      const auto count = static_cast<int64_t>(std::count(cells[s].begin(), cells[s].end(), 'm'));
      if (count > 0) out.mtp_stages.emplace_back(static_cast<int64_t>(s), count);
      total += count;
    }
    require(total == 0 || total == out.model.config.mtp_num_layers,
            "--pipeline-model-parallel-layout places " + std::to_string(total) + " MTP layers ('m') but " +
                "--mtp-num-layers is " + std::to_string(out.model.config.mtp_num_layers));
  }
}

}  // namespace

std::string LayoutChoice::describe() const {
  return "TP" + std::to_string(tp) + " PP" + std::to_string(pp) + " VPP" + std::to_string(vpp) + " CP" +
         std::to_string(cp) + " EP" + std::to_string(ep) + " ETP" + std::to_string(etp);
}

namespace {

PlanArgs parse_plan_flags(const std::vector<std::string>& args) {
  PlanArgs out;
  out.cluster = cluster_preset("H100");
  Parser p(out);
  parse_tokens(p, args);
  if (out.help_requested) return out;
  apply_cluster(p);
  note_train_flags(p);
  // Unknown flags first, with suggestions from train's flags and the planner's (train's parser would suggest only
  // its own); Megatron flags moecore does not implement get train's message from its parser.
  std::vector<std::string> known = implemented_train_flags();
  const std::vector<std::string> planner = flag_names(planner_flag_table());
  known.insert(known.end(), planner.begin(), planner.end());
  for (const std::string& token : p.rest) {
    if (!looks_like_train_flag(token)) continue;
    const std::string flag = token.substr(0, token.find('='));
    if (std::find(known.begin(), known.end(), flag) != known.end() || is_unimplemented_megatron_flag(flag) ||
        !offloading_refusal(flag).empty()) {
      continue;
    }
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
  require(p.mla_on || !p.have_mla_field,
          "--q-lora-rank / --kv-lora-rank / --qk-head-dim / --qk-pos-emb-head-dim / "
          "--v-head-dim require --multi-latent-attention");
  out.model.config.mtp_num_layers = p.mtp.value_or(0);
  out.model_flags = p.rest;

  LayoutChoice layout;
  const auto take = [&](const std::string& flag, int64_t& field) {
    if (const auto it = p.layout.find(flag); it != p.layout.end()) field = it->second.integer_in(1, kMaxGpus);
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
    if (const auto it = p.layout.find(flag); it != p.layout.end()) split_values[flag] = it->second.text();
  }
  if (const auto it = p.layout.find("--pipeline-model-parallel-layout"); it != p.layout.end()) {
    layout.pipeline_layout = it->second.text();
  }
  take("--num-virtual-stages-per-pipeline-rank", layout.vpp);
  finish(out, layout, p.layout_switches, split_values);
  out.recompute = out.train.model.recompute;
  out.memory_efficient_permutation = out.train.model.moe.memory_efficient_permutation;
  if (out.model.config.mla) {
    require(!out.train.group_query_attention,
            "--multi-latent-attention cannot be combined with --group-query-attention");
  }
  return out;
}

}  // namespace

PlanArgs parse_plan_args(const std::vector<std::string>& args) {
  try {
    return parse_plan_flags(args);
  } catch (const FlagError& error) {
    throw ConfigError(error.what());
  }
}

PlanArgs plan_args_of_run(const TrainingArgs& train) {
  PlanArgs out;
  out.train = train;
  out.model.config = train.model;
  out.recompute = train.model.recompute;
  out.memory_efficient_permutation = train.model.moe.memory_efficient_permutation;
  out.dispatcher = train.model.moe.dispatcher_type == TokenDispatcherType::kAllGather ? "allgather"
                   : train.model.moe.dispatcher_type == TokenDispatcherType::kFlex    ? "flex"
                                                                                      : "alltoall";
  out.num_gpus = train.parallel.world_size;
  out.vocab_size = train.model.vocab_size;
  const ParallelSizes& p = train.parallel;
  out.layout.tp = p.tensor_model_parallel_size;
  out.layout.pp = p.pipeline_model_parallel_size;
  out.layout.vpp = train.virtual_pipeline_model_parallel_size;
  out.layout.cp = p.context_parallel_size;
  out.layout.ep = p.expert_model_parallel_size;
  out.layout.etp = p.expert_tensor_parallel();
  return out;
}

PlanArgs with_layout(const PlanArgs& base, const LayoutChoice& layout) {
  PlanArgs out = base;
  finish(out, layout, {}, {});
  return out;
}

LayoutSizes layout_sizes(const PlanArgs& args) {
  const TrainingArgs& t = args.train;
  const PipelineLayout pipeline = pipeline_layout(t);
  LayoutSizes l;
  l.pp = pipeline.pipeline_size();
  l.vpp = pipeline.virtual_pipeline_size();
  l.parallel = t.parallel;
  l.data_parallel = t.data_parallel_size;
  l.microbatches = t.global_batch_size / (t.micro_batch_size * t.data_parallel_size);
  return l;
}

std::map<int64_t, int64_t> mtp_layers_by_stage(const PlanArgs& args, const int pp, const int vpp) {
  std::map<int64_t, int64_t> at;
  for (const auto& [stage, count] : args.mtp_stages) at[stage] += count;
  if (at.empty() && args.model.config.mtp_num_layers > 0) {
    at[static_cast<int64_t>(vpp) * pp - 1] = args.model.config.mtp_num_layers;
  }
  return at;
}

std::string plan_flags_help() {
  std::string text =
      "usage: moecore plan --num-gpus N [--gpu NAME] <train's model, batch, precision and layout flags> "
      "[--hf-config CONFIG_JSON_OR_FOLDER] [--search] [--json]\n\nGPU presets:\n";
  for (const std::string& name : cluster_preset_names()) text += "  " + describe_cluster(cluster_preset(name)) + "\n";
  return text + "\nplanner flags (train's flags describe the model, the batch and the layout):\n" +
         flags_help(planner_flag_table());
}

}  // namespace moecore::plan
