#include "moecore/plan/plan_command.h"

#include <cstdio>
#include <nlohmann/json.hpp>

#include "moecore/plan/layout_search.h"
#include "moecore/plan/memory_model.h"
#include "moecore/plan/plan_flops.h"
#include "moecore/plan/time_model.h"

namespace moecore::plan {
namespace {

std::string fixed(const double value, const int digits = 1) {
  char text[64];
  std::snprintf(text, sizeof(text), "%.*f", digits, value);
  return text;
}

std::string sci(const double value) {
  char text[64];
  std::snprintf(text, sizeof(text), "%.4g", value);
  return text;
}

nlohmann::json layout_json(const LayoutChoice& l, const PlanArgs& args) {
  nlohmann::json j{{"tp", l.tp},
                   {"pp", l.pp},
                   {"vpp", l.vpp},
                   {"cp", l.cp},
                   {"ep", l.ep},
                   {"etp", l.etp},
                   {"dp", args.num_gpus / (l.tp * l.pp * l.cp)},
                   {"edp", args.num_gpus / (l.ep * l.etp * l.pp)}};
  if (l.pipeline_layout) j["pipeline_layout"] = *l.pipeline_layout;
  if (args.train.use_megatron_fsdp) j["megatron_fsdp"] = args.train.data_parallel_sharding_strategy;
  return j;
}

nlohmann::json memory_json(const StageMemory& m, const double limit_gib, const bool mib) {
  const double unit = mib ? 1024.0 * 1024.0 : kGiB;
  nlohmann::json j{{"pp_rank", m.pp_rank},
                   {"weights", m.weights / unit},
                   {"grads", m.grads / unit},
                   {"weights_and_grads", m.weights_and_grads() / unit},
                   {"main_weights_and_optimizer", m.main_weights_and_optimizer / unit},
                   {"activations", m.activations / unit},
                   {"comm_buffers", m.comm_buffers / unit},
                   {"total", m.total() / unit}};
  nlohmann::json modules = nlohmann::json::object();
  for (const NamedBytes& part : m.activations_by_module) modules[part.name] = part.bytes / unit;
  j["activations_by_module"] = modules;
  if (mib) {
    // moecore's own log categories: params, grads, optimizer, activations (by model part as the log names them).
    j["params"] = m.weights / unit;
    j["optimizer"] = m.main_weights_and_optimizer / unit;
    j["activations_other_moment"] = m.activations_other_moment / unit;
  } else {
    j["limit"] = limit_gib;
    j["live_microbatch_chunks"] = m.live_chunks_at_peak;
  }
  return j;
}

nlohmann::json time_json(const StepTime& t) {
  return {{"compute", t.compute_s}, {"recompute", t.recompute_s}, {"tp_comm", t.tp_comm_s},
          {"cp_comm", t.cp_comm_s}, {"ep_comm", t.ep_comm_s},     {"pp_comm", t.pp_comm_s},
          {"dp_comm", t.dp_comm_s}, {"bubble", t.bubble_s},       {"optimizer", t.optimizer_s}};
}

nlohmann::json cluster_json(const Cluster& c) {
  return {{"name", c.name},
          {"memory_gib", c.memory_gib},
          {"peak_tflops_bf16", c.peak_tflops_bf16},
          {"peak_tflops_fp8", c.peak_tflops_fp8},
          {"peak_tflops_fp4", c.peak_tflops_fp4},
          {"hbm_tbps", c.hbm_tbps},
          {"gpus_per_domain", c.gpus_per_domain},
          {"intra_domain_gbps", c.intra_domain_gbps},
          {"inter_domain_gbps", c.inter_domain_gbps}};
}

nlohmann::json result_json(const PlanArgs& args, const LayoutChoice& layout, const StageMemory& memory,
                           const StepTime& time, const bool fits) {
  nlohmann::json j;
  j["layout"] = layout_json(layout, args);
  j["fits"] = fits;
  j["memory_gb"] = memory_json(memory, args.cluster.memory_gib, false);
  j["memory_mib"] = memory_json(memory, args.cluster.memory_gib, true);
  j["step_time_s"] = time.total_s;
  j["step_time_parts_s"] = time_json(time);
  j["tflops_per_gpu"] = time.tflops_per_gpu;
  j["tokens_per_s_per_gpu"] = time.tokens_per_s_per_gpu;
  return j;
}

void print_memory(std::ostream& out, const StageMemory& m, const double limit_gib) {
  const auto g = [](const double bytes) { return fixed(bytes / kGiB); };
  out << "memory per GPU, GiB (pipeline rank " << m.pp_rank << ", the one holding the most: " << m.decoder_layers
      << " decoder layers" << (m.mtp_layers ? " + " + std::to_string(m.mtp_layers) + " MTP" : "") << ", "
      << m.live_chunks_at_peak << " micro-batch chunks alive at the peak)\n";
  out << "  weights                      " << g(m.weights) << "\n";
  out << "  gradients                    " << g(m.grads) << "\n";
  out << "  weights and gradients        " << g(m.weights_and_grads()) << "\n";
  out << "  main weights and optimizer   " << g(m.main_weights_and_optimizer) << "\n";
  out << "  activations                  " << g(m.activations) << "\n";
  for (const NamedBytes& part : m.activations_by_module) {
    if (part.bytes > 0)
      out << "    " << part.name << std::string(27 - std::min<size_t>(26, part.name.size()), ' ') << g(part.bytes)
          << "\n";
  }
  out << "  communication buffers        " << g(m.comm_buffers) << "\n";
  out << "  total                        " << g(m.total()) << " of " << fixed(limit_gib) << "\n";
}

void print_time(std::ostream& out, const StepTime& t) {
  out << "step time, s: " << fixed(t.total_s, 3) << " = compute " << fixed(t.compute_s, 3) << " (recompute "
      << fixed(t.recompute_s, 3) << ") + exposed TP " << fixed(t.tp_comm_s, 3) << " + CP " << fixed(t.cp_comm_s, 3)
      << " + EP " << fixed(t.ep_comm_s, 3) << " + PP " << fixed(t.pp_comm_s, 3) << " + DP " << fixed(t.dp_comm_s, 3)
      << " + bubble " << fixed(t.bubble_s, 3) << " + optimizer " << fixed(t.optimizer_s, 3) << "\n";
  out << "throughput: " << fixed(t.tflops_per_gpu) << " TFLOP/s/GPU, " << fixed(t.tokens_per_s_per_gpu, 0)
      << " tokens/s/GPU\n";
}

}  // namespace

int plan_main(const std::vector<std::string>& argv, std::ostream& out) {
  const PlanArgs args = parse_plan_args(argv);
  if (args.help_requested) {
    out << plan_flags_help();
    return 0;
  }
  const PlanModel& model = args.model;
  const double per_token = flops_per_token(model);
  const double per_step = flops_per_step(model, args.train.global_batch_size);
  if (args.search) {
    const std::vector<Candidate> candidates = search_layouts(args);
    if (args.json) {
      nlohmann::json j;
      j["flops_per_token"] = per_token;
      j["flops_per_step"] = per_step;
      j["cluster"] = cluster_json(args.cluster);
      j["layouts"] = nlohmann::json::array();
      for (const Candidate& c : candidates) {
        nlohmann::json entry;
        if (c.memory && c.time) {
          entry = result_json(args, c.layout, *c.memory, *c.time, c.fits);
        } else {
          entry["layout"] = layout_json(c.layout, args);
          entry["fits"] = false;
        }
        entry["reason"] = c.reason;
        j["layouts"].push_back(entry);
      }
      out << j.dump(1) << "\n";
      return 0;
    }
    out << "FLOPs per token " << sci(per_token) << ", per step " << sci(per_step) << "; " << args.num_gpus << " x "
        << describe_cluster(args.cluster) << "\n";
    int64_t shown = 0;
    size_t fitting = 0;
    for (const Candidate& c : candidates) fitting += c.fits ? 1 : 0;
    out << candidates.size() << " layouts, " << fitting << " fit; best first:\n";
    for (const Candidate& c : candidates) {
      if (shown++ >= args.top) break;
      out << "  " << c.layout.describe();
      if (c.memory && c.time) {
        out << ": " << fixed(c.time->tflops_per_gpu) << " TFLOP/s/GPU, step " << fixed(c.time->total_s, 3) << " s, "
            << fixed(c.memory->total() / kGiB) << " GiB";
      }
      if (!c.reason.empty()) out << " -- " << c.reason;
      out << "\n";
    }
    return 0;
  }
  const MemoryPlan memory = estimate_plan_memory(args);
  const StageMemory& worst = memory.worst();
  const StepTime time = estimate_step_time(args, memory);
  const bool fits = worst.total() <= args.cluster.memory_gib * kGiB;
  if (args.json) {
    nlohmann::json j = result_json(args, args.layout, worst, time, fits);
    j["flops_per_token"] = per_token;
    j["flops_per_step"] = per_step;
    j["cluster"] = cluster_json(args.cluster);
    j["parameters"] = memory.total_parameters;
    j["microbatches"] = layout_sizes(args).microbatches;
    out << j.dump(1) << "\n";
    return 0;
  }
  out << "model: " << fixed(memory.total_parameters / 1e9, 2) << " B parameters; " << args.num_gpus << " x "
      << describe_cluster(args.cluster) << "\n";
  out << "layout: " << args.layout.describe() << ", DP " << args.train.data_parallel_size
      << (args.train.use_megatron_fsdp ? ", Megatron-FSDP " + args.train.data_parallel_sharding_strategy : "") << "; "
      << layout_sizes(args).microbatches << " micro-batches of " << args.train.micro_batch_size << " x "
      << model.config.seq_length << " tokens\n";
  out << "FLOPs: " << sci(per_token) << " per token, " << sci(per_step) << " per step (Megatron's count)\n";
  print_memory(out, worst, args.cluster.memory_gib);
  if (!fits) out << "does not fit: " << fixed((worst.total() - args.cluster.memory_gib * kGiB) / kGiB) << " GiB over\n";
  print_time(out, time);
  return 0;
}

}  // namespace moecore::plan
