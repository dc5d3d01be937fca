#include "moecore/plan/time_model.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <string>

#include "moecore/pipeline/pipeline_layout.h"
#include "moecore/plan/plan_flops.h"

namespace moecore::plan {
namespace {

// Efficiency table: the share of the precision's dense peak a large GEMM reaches (cuBLAS / TransformerEngine on
// Hopper and Blackwell), of the BF16 peak for flash attention (forward + backward), and the share of the link
// bandwidth a collective reaches (NCCL ring / all-to-all; DeepEP and HybridEP on "flex").
struct Efficiency {
  double gemm_bf16 = 0.62;
  double gemm_fp8 = 0.48;  // quantization kernels and scaling overheads included
  double gemm_fp4 = 0.38;
  double dim_half = 192.0;  // a GEMM whose smallest dimension is this reaches half of its large-size efficiency
  double collective = 0.60;
  double alltoall = 0.60;            // NCCL all-to-all
  double alltoall_flex = 0.80;       // DeepEP / HybridEP
  double memory_passes = 8.0;        // elementwise passes over a layer's saved activations (forward + backward)
  double layer_overhead_s = 400e-6;  // launch and synchronisation per MoE layer, forward + backward
};

// One rank's bytes in a collective over `group` ranks laid out `stride` apart in the rank order: the part that
// crosses an NVLink domain goes at the inter-domain rate.
double transfer_seconds(const Cluster& cl, const double bytes, const double group, const double stride,
                        const double efficiency, const int64_t steps) {
  if (group <= 1 || bytes <= 0) return 0.0;
  const double span = group * stride;
  const double domain = static_cast<double>(cl.gpus_per_domain);
  const bool crosses = span > domain;
  const double local_share = crosses ? std::max(0.0, std::min(1.0, (domain / stride) / group)) : 1.0;
  const double intra = bytes * local_share / (cl.intra_domain_gbps * 1e9 * efficiency);
  const double inter = crosses ? bytes * (1.0 - local_share) / (cl.inter_domain_gbps * 1e9 * efficiency) : 0.0;
  const double alpha =
      static_cast<double>(steps) * (crosses ? cl.inter_domain_latency_us : cl.intra_domain_latency_us) * 1e-6;
  return alpha + std::max(intra, inter);
}

double gemm_seconds(const double flops, const double smallest_dim, const double peak_tflops, const double efficiency,
                    const Efficiency& e) {
  if (flops <= 0) return 0.0;
  const double size_factor = smallest_dim / (smallest_dim + e.dim_half);
  return flops / (peak_tflops * 1e12 * efficiency * size_factor);
}

struct LayerWork {
  double gemm_flops = 0;       // forward GEMM FLOPs on this rank per micro-batch
  double expert_flops = 0;     // of which routed experts (grouped GEMMs)
  double attention_flops = 0;  // forward core attention
  double recompute_gemm_flops = 0;
  double recompute_attention_flops = 0;
  double saved_bytes = 0;      // activations touched by elementwise work
  double tp_bytes = 0;         // per TP collective
  int64_t tp_collectives = 0;  // forward + backward
  double a2a_bytes = 0;        // per all-to-all, leaving this rank
  int64_t a2a_count = 0;       // forward + backward (recompute of the MoE layer adds two)
  double cp_bytes = 0;         // key / value bytes a CP ring step sends (forward + backward)
  bool moe = false;
};

// moecore's CPU engine: the probe's GEMM rate is already an achieved rate, collectives are shared-memory copies, and
// there are no kernel launches.
Efficiency cpu_efficiency() {
  Efficiency e;
  e.gemm_bf16 = e.gemm_fp8 = e.gemm_fp4 = 1.0;
  e.dim_half = 32.0;
  e.collective = e.alltoall = e.alltoall_flex = 1.0;
  e.layer_overhead_s = 0.0;
  return e;
}

// Megatron-FSDP's data-parallel collectives of one step (megatron/core/distributed/fsdp/src/megatron_fsdp/: the
// pre-forward and pre-backward all-gathers of a unit's weights with the next unit's prefetch, the post-backward
// reduce-scatter of its gradients). Dense elements go over dp-cp, routed experts over expert-DP.
struct FsdpCollectives {
  const Cluster& cluster;
  const Efficiency& efficiency;
  StageMemory::FsdpElements elements;  // on the slowest rank, before FSDP's shard
  double dense_group = 1, dense_stride = 1, expert_group = 1, expert_stride = 1;
  double gather_bytes = 2, grad_bytes = 2;  // per element all-gathered / reduced
};

// Seconds to all-gather (or reduce-scatter) `dense` and `expert` elements of `bytes` each over their groups.
double fsdp_collective_seconds(const FsdpCollectives& f, const double dense, const double expert, const double bytes) {
  const auto one = [&](const double elements, const double group, const double stride) {
    return transfer_seconds(f.cluster, elements * bytes * (group - 1.0) / group, group, stride, f.efficiency.collective,
                            1);
  };
  return one(dense, f.dense_group, f.dense_stride) + one(expert, f.expert_group, f.expert_stride);
}

// The exposed seconds: units' collectives run every micro-batch behind the compute (the gather of the next unit during
// this one's forward or backward, the reduce-scatter during the next unit's backward), except the first gather of each
// pass and the last reduce-scatter, and what the compute cannot cover. The rest (no_shard's all-reduce, optim's
// reduce-scatter, the parameters outside units, the all-gather of the updated weights after the step) runs once per
// step like the distributed optimizer's, hidden as much as --overlap-grad-reduce / --overlap-param-gather allow
// (Megatron-FSDP turns the first on for optim_grads and both for optim_grads_params).
double fsdp_exposed_seconds(const FsdpCollectives& f, const TrainingArgs& t, const double microbatches,
                            const double compute_s) {
  const std::string& strategy = t.data_parallel_sharding_strategy;
  const StageMemory::FsdpElements& e = f.elements;
  const bool zero3 = strategy == "optim_grads_params";
  const bool sharded_grads = zero3 || strategy == "optim_grads";
  const double rest_dense = e.dense - e.unit_dense, rest_expert = e.expert - e.unit_expert;
  double per_step = 0, units = 0, unit_edges = 0;
  if (strategy == "no_shard") {
    per_step = 2.0 * fsdp_collective_seconds(f, e.dense, e.expert, f.grad_bytes);  // all-reduce
  } else if (!sharded_grads) {
    per_step = fsdp_collective_seconds(f, e.dense, e.expert, f.grad_bytes) +
               fsdp_collective_seconds(f, e.dense, e.expert, f.gather_bytes);
  } else {
    per_step = fsdp_collective_seconds(f, rest_dense, rest_expert, f.grad_bytes) +
               (zero3 ? fsdp_collective_seconds(f, rest_dense, rest_expert, f.gather_bytes)
                      : fsdp_collective_seconds(f, e.dense, e.expert, f.gather_bytes));
    const double share = e.unit_dense + e.unit_expert > 0 ? e.unit_dense / (e.unit_dense + e.unit_expert) : 1.0;
    const double largest_dense = e.largest_unit * share, largest_expert = e.largest_unit * (1.0 - share);
    units = microbatches * fsdp_collective_seconds(f, e.unit_dense, e.unit_expert, f.grad_bytes);
    unit_edges = microbatches * fsdp_collective_seconds(f, largest_dense, largest_expert, f.grad_bytes);
    if (zero3) {
      units += 2.0 * microbatches * fsdp_collective_seconds(f, e.unit_dense, e.unit_expert, f.gather_bytes);
      unit_edges += 2.0 * microbatches * fsdp_collective_seconds(f, largest_dense, largest_expert, f.gather_bytes);
    }
  }
  const double hidden =
      (t.overlap_grad_reduce || sharded_grads ? 0.5 : 0.0) + (t.overlap_param_gather || zero3 ? 0.4 : 0.0);
  const double exposed_units = std::min(units, unit_edges + std::max(0.0, units - compute_s));
  return per_step * (1.0 - hidden) + exposed_units;
}

}  // namespace

StepTime estimate_step_time(const PlanArgs& args, const MemoryPlan& memory) {
  const Efficiency e = args.cluster.moecore_cpu_engine ? cpu_efficiency() : Efficiency{};
  const TrainingArgs& t = args.train;
  const PlanModel& model = args.model;
  const ModelConfig& c = model.config;
  const Cluster& cl = args.cluster;
  const PipelineLayout layout = pipeline_layout(t);
  const LayoutSizes sizes = layout_sizes(args);
  const int pp = sizes.pp, vpp = sizes.vpp;
  const double tp = sizes.tp(), cp = sizes.cp(), ep = sizes.ep(), etp = sizes.etp(), world = sizes.world();
  const double seq = static_cast<double>(c.seq_length);
  const double tokens = seq * static_cast<double>(t.micro_batch_size);  // per micro-batch and model replica
  const double h = static_cast<double>(c.hidden_size);
  const double a = c.params_dtype != DType::kF32 ? 2.0 : 4.0;
  const double glu_gemms = c.activation == Activation::kSwiGLU ? 3.0 : 2.0;
  const bool fp8 = t.fp8_format.has_value(), fp4 = t.fp4_format.has_value();
  const double linear_peak = fp4 ? cl.peak_tflops_fp4 : fp8 ? cl.peak_tflops_fp8 : cl.peak_tflops_bf16;
  const double linear_eff = fp4 ? e.gemm_fp4 : fp8 ? e.gemm_fp8 : e.gemm_bf16;
  const double local_tokens = tokens / (tp * cp);  // each rank's share of one micro-batch's token work
  const Recompute& r = args.recompute;

  // Forward work of one layer on one rank. The FLOPs are Megatron's per-token terms (the FLOPs formula / 3), split
  // evenly over the TP x CP ranks of a model replica (routed experts too, under balanced routing).
  const auto layer_work = [&](const bool moe_layer) {
    LayerWork w;
    w.moe = moe_layer;
    double attn_linear = 0, attn_core = 0, up_proj = 0;
    if (c.mla) {
      const MlaConfig& m = *c.mla;
      const double n = static_cast<double>(c.num_attention_heads);
      const double qk = static_cast<double>(m.qk_head_dim + m.qk_pos_emb_head_dim);
      const double q_term = m.q_lora_rank > 0 ? static_cast<double>(m.q_lora_rank) * (h + n * qk + 1.0) : h * n * qk;
      const double kv = static_cast<double>(m.kv_lora_rank);
      attn_linear = 2.0 * (q_term + kv * (h + n * static_cast<double>(m.qk_head_dim + m.v_head_dim) + 1.0) +
                           h * static_cast<double>(m.qk_pos_emb_head_dim) + n * static_cast<double>(m.v_head_dim) * h);
      up_proj = 2.0 * ((m.q_lora_rank > 0 ? static_cast<double>(m.q_lora_rank) * n * qk : 0.0) +
                       kv * n * static_cast<double>(m.qk_head_dim + m.v_head_dim));
      attn_core = (n * qk + n * static_cast<double>(m.v_head_dim)) * seq;  // causal: QK^T and PV over s/2 keys
    } else {
      const double q = static_cast<double>(c.num_attention_heads * c.kv_channels);
      const double kv = static_cast<double>(c.num_query_groups * c.kv_channels);
      attn_linear = 2.0 * (h * (q + 2.0 * kv) + q * h);
      attn_core = 2.0 * q * seq;
    }
    double mlp = 0, experts = 0;
    if (moe_layer) {
      const MoEConfig& moe = c.moe;
      // LatentMoE: the experts on the latent width, plus the replicated down and up projections.
      const double latent = static_cast<double>(moe.latent_size);
      experts = 2.0 * glu_gemms * (latent > 0 ? latent : h) * static_cast<double>(moe.ffn_hidden_size * moe.topk);
      mlp = 2.0 * glu_gemms * h * static_cast<double>(moe.shared_expert_intermediate_size) +
            2.0 * h * static_cast<double>(moe.num_experts) + 2.0 * 2.0 * h * latent;
    } else {
      mlp = 2.0 * glu_gemms * h * static_cast<double>(c.ffn_hidden_size);
    }
    w.gemm_flops = (attn_linear + mlp + experts) * local_tokens;
    w.expert_flops = experts * local_tokens;
    w.attention_flops = attn_core * local_tokens;
    // Recomputation repeats forward work in backward.
    if (r.granularity == Recompute::Granularity::kFull) {
      w.recompute_gemm_flops = w.gemm_flops;
      w.recompute_attention_flops = w.attention_flops;
    } else {
      if (r.has("mla_up_proj")) w.recompute_gemm_flops += up_proj * local_tokens;
      if (r.has("mlp") && !moe_layer) w.recompute_gemm_flops += mlp * local_tokens;
      if (r.has("moe") && moe_layer) w.recompute_gemm_flops += (mlp + experts) * local_tokens;
      if (r.has("shared_experts") && moe_layer && !r.has("moe")) {
        w.recompute_gemm_flops +=
            2.0 * glu_gemms * h * static_cast<double>(c.moe.shared_expert_intermediate_size) * local_tokens;
      }
      if (r.has("core_attn")) w.recompute_attention_flops += w.attention_flops;
    }
    // Elementwise and data-movement work: about the layer's saved activations, several passes.
    const double per_token_saved =
        (moe_layer ? (6.0 * h +
                      static_cast<double>(c.moe.topk) * (2.0 * h + 3.0 * static_cast<double>(c.moe.ffn_hidden_size)))
                   : (6.0 * h + 3.0 * static_cast<double>(c.ffn_hidden_size) / 1.0)) *
        a;
    w.saved_bytes = per_token_saved * local_tokens;
    // Tensor parallelism: with sequence parallelism an all-gather and a reduce-scatter around each of the two
    // blocks, in forward and in backward; without it an all-reduce (twice the bytes) per block and direction.
    if (tp > 1) {
      w.tp_bytes = tokens / cp * h * a * (tp - 1.0) / tp;
      w.tp_collectives = t.sequence_parallel ? 8 : 8;
    }
    if (moe_layer && ep * etp > 1) {
      // Dispatch and combine, forward and backward: each rank's k copies of its tokens, the share leaving it.
      const double dispatched_width = c.moe.latent_size > 0 ? static_cast<double>(c.moe.latent_size) : h;
      w.a2a_bytes = tokens / (tp * cp) * static_cast<double>(c.moe.topk) * dispatched_width * a * (ep - 1.0) / ep;
      w.a2a_count = 4 + ((r.has("moe") || r.granularity == Recompute::Granularity::kFull) ? 2 : 0);
    }
    if (cp > 1) {
      const double kv_width =
          c.mla ? static_cast<double>(c.num_attention_heads) *
                      static_cast<double>(c.mla->qk_head_dim + c.mla->qk_pos_emb_head_dim + c.mla->v_head_dim)
                : 2.0 * static_cast<double>(c.num_query_groups * c.kv_channels);
      w.cp_bytes = tokens / cp * kv_width / tp * a;
    }
    return w;
  };
  const LayerWork dense_work = layer_work(false);
  const LayerWork moe_work = c.moe.enabled() ? layer_work(true) : dense_work;

  const double dispatch_eff = args.dispatcher == "flex" ? e.alltoall_flex : e.alltoall;
  // Seconds of one micro-batch's forward + backward of one layer on a rank (compute, and exposed communication).
  struct LayerSeconds {
    double compute = 0, recompute = 0, tp = 0, ep = 0, cp = 0;
  };
  const auto layer_seconds = [&](const LayerWork& w) {
    LayerSeconds s;
    const double expert_tokens = tokens / (tp * cp) * static_cast<double>(c.moe.topk) * etp /
                                 std::max(1.0, static_cast<double>(c.moe.num_experts) / ep);
    // The smallest GEMM dimension: tensor parallelism splits the weights' hidden / ffn side, expert-TP the
    // experts' ffn side; the tokens per expert bound the grouped GEMMs.
    const double dense_dim = std::min(h / tp, local_tokens * tp);
    const double expert_dim =
        std::min({std::max(1.0, expert_tokens), static_cast<double>(c.moe.ffn_hidden_size) / etp, h});
    const double gemm = gemm_seconds(w.gemm_flops - w.expert_flops, dense_dim, linear_peak, linear_eff, e) +
                        gemm_seconds(w.expert_flops, expert_dim, linear_peak, linear_eff, e);
    const double attention = w.attention_flops / (cl.peak_tflops_bf16 * 1e12 * cl.attention_efficiency);
    const double memory_bound = e.memory_passes * w.saved_bytes / (cl.hbm_tbps * 1e12);
    const double overhead = w.moe ? e.layer_overhead_s : e.layer_overhead_s / 3.0;
    // Backward runs the GEMMs twice (input and weight gradients) and the attention about 2.5 times.
    s.compute = 3.0 * gemm + 3.5 * attention + memory_bound + overhead;
    s.recompute = gemm_seconds(w.recompute_gemm_flops, dense_dim, linear_peak, linear_eff, e) +
                  w.recompute_attention_flops / (cl.peak_tflops_bf16 * 1e12 * cl.attention_efficiency);
    s.compute += s.recompute;
    // TP group: consecutive ranks. Exposed in full (Megatron overlaps it only with --tp-comm-overlap).
    s.tp = static_cast<double>(w.tp_collectives) *
           transfer_seconds(cl, w.tp_bytes, tp, 1.0, e.collective, static_cast<int64_t>(tp - 1.0));
    // EP group of the expert grid: ETP-strided ranks; EP x ETP within a domain stays on NVLink.
    const double a2a = transfer_seconds(cl, w.a2a_bytes, ep, etp, dispatch_eff, 1);
    double exposed_share = 1.0;
    if (args.overlap_moe_expert_parallel_comm)
      exposed_share = 0.35;  // hidden behind another micro-batch
    else if (c.moe.shared_expert_overlap)
      exposed_share = 0.85;
    s.ep = static_cast<double>(w.a2a_count) * a2a * exposed_share;
    if (etp > 1 && w.moe) {
      // Expert-TP all-gather before the experts and reduce-scatter after them, forward and backward.
      s.ep += 4.0 * transfer_seconds(cl, tokens / (tp * cp) * static_cast<double>(c.moe.topk) * h * a * (etp - 1.0),
                                     etp, 1.0, e.collective, static_cast<int64_t>(etp - 1.0));
    }
    // CP ring: key / value blocks travel CP - 1 steps forward and twice that backward, behind the attention.
    if (cp > 1) {
      const double ring = 3.0 * (cp - 1.0) * transfer_seconds(cl, w.cp_bytes, 2.0, tp, e.collective, 1);
      s.cp = std::max(0.0, ring - 3.5 * attention);
    }
    return s;
  };
  const LayerSeconds dense_s = layer_seconds(dense_work);
  const LayerSeconds moe_s = layer_seconds(moe_work);

  // Embedding, output layer and MTP heads.
  const double vocab = static_cast<double>(c.vocab_size);
  const double logits_s = 3.0 * gemm_seconds(2.0 * h * vocab * local_tokens, std::min(h, local_tokens * tp),
                                             cl.peak_tflops_bf16, e.gemm_bf16, e) +
                          3.0 * local_tokens * vocab / tp * 4.0 / (cl.hbm_tbps * 1e12);

  StepTime out;
  const std::map<int64_t, int64_t> mtp_at = mtp_layers_by_stage(args, pp, vpp);
  const bool mtp_moe = c.moe.enabled() && c.moe.is_moe_layer(c.num_layers - 1);
  const LayerSeconds& mtp_s = mtp_moe ? moe_s : dense_s;
  double slowest = -1, all_ranks = 0;
  LayerSeconds slowest_parts;
  for (int rank = 0; rank < pp; ++rank) {
    LayerSeconds parts;
    const auto add = [&](const LayerSeconds& ls, const double times) {
      parts.compute += times * ls.compute;
      parts.recompute += times * ls.recompute;
      parts.tp += times * ls.tp;
      parts.ep += times * ls.ep;
      parts.cp += times * ls.cp;
    };
    for (int v = 0; v < vpp; ++v) {
      const PipelineStage& s = layout.stage(rank, v);
      for (int64_t l = s.first_layer; l < s.end_layer(); ++l)
        add(c.moe.enabled() && c.moe.is_moe_layer(l) ? moe_s : dense_s, 1.0);
      if (s.has_loss) parts.compute += logits_s;
      if (const auto it = mtp_at.find(static_cast<int64_t>(v) * pp + rank); it != mtp_at.end()) {
        add(mtp_s, static_cast<double>(it->second));
        parts.compute += static_cast<double>(it->second) * logits_s;
      }
    }
    const double per_mb = parts.compute + parts.tp + parts.ep + parts.cp;
    all_ranks += per_mb;
    if (per_mb > slowest) {
      slowest = per_mb;
      slowest_parts = parts;
      out.slowest_pp_rank = rank;
    }
  }
  const double m = static_cast<double>(sizes.microbatches);
  out.compute_s = m * slowest_parts.compute;
  out.recompute_s = m * slowest_parts.recompute;
  out.tp_comm_s = m * slowest_parts.tp;
  out.ep_comm_s = m * slowest_parts.ep;
  out.cp_comm_s = m * slowest_parts.cp;
  if (pp > 1) {
    // Pipeline p2p: one activation (and one gradient) per micro-batch and chunk boundary, mostly overlapped; the
    // pp group's ranks are world / PP apart.
    const double p2p_bytes = tokens / (cp * (t.sequence_parallel ? tp : 1.0)) * h * a;
    out.pp_comm_s = 0.2 * 2.0 * m * static_cast<double>(vpp) *
                    transfer_seconds(cl, p2p_bytes, 2.0, world / static_cast<double>(pp), e.collective, 1);
    // Bubble: the fill and drain of the other ranks around the slowest one's M micro-batches (with equal ranks
    // Megatron's (PP - 1) x t for 1F1B); the interleaved schedule fills and drains one chunk (1 / VPP) at a time.
    out.bubble_s = (all_ranks - slowest) / static_cast<double>(vpp);
  }
  // Data parallelism: gradients reduce-scattered (distributed optimizer) or all-reduced, parameters all-gathered;
  // overlapped with backward / the next forward when asked for, except about the last chunk's share.
  const StageMemory& worst = memory.stages[static_cast<size_t>(out.slowest_pp_rank)];
  const double grad_bytes = worst.grads;
  const double param_bytes = worst.weights;
  const double dp_group = world / (tp * static_cast<double>(pp));  // dense data-parallel x context-parallel ranks
  double dp_s = 0;
  if (dp_group > 1) {
    const double factor = (dp_group - 1.0) / dp_group;
    if (t.use_distributed_optimizer) {
      dp_s = transfer_seconds(cl, grad_bytes * factor, dp_group, tp, e.collective, 1) +
             transfer_seconds(cl, param_bytes * factor, dp_group, tp, e.collective, 1);
    } else {
      dp_s = transfer_seconds(cl, 2.0 * grad_bytes * factor, dp_group, tp, e.collective, 1);
    }
  }
  const double dp_hidden = (t.overlap_grad_reduce ? 0.5 : 0.0) + (t.overlap_param_gather ? 0.4 : 0.0);
  out.dp_comm_s = dp_s * (1.0 - std::min(0.9, dp_hidden));
  if (t.use_megatron_fsdp) {
    const FsdpCollectives f{.cluster = cl,
                            .efficiency = e,
                            .elements = worst.fsdp,
                            .dense_group = dp_group,
                            .dense_stride = tp,
                            .expert_group = sizes.edp(),
                            .expert_stride = ep * etp,
                            .gather_bytes = args.cluster.moecore_cpu_engine ? 4.0 : a,
                            .grad_bytes = a};
    out.dp_comm_s = fsdp_exposed_seconds(f, t, m, out.compute_s);
  }
  // Optimizer: reads and writes the main weights, both moments and the gradients of this rank's shard.
  out.optimizer_s = 3.0 * (worst.main_weights_and_optimizer + grad_bytes + param_bytes) / (cl.hbm_tbps * 1e12);
  out.total_s = out.compute_s + out.tp_comm_s + out.ep_comm_s + out.cp_comm_s + out.pp_comm_s + out.bubble_s +
                out.dp_comm_s + out.optimizer_s;
  out.flops_per_step = flops_per_step(model, t.global_batch_size);
  out.tflops_per_gpu = out.flops_per_step / (out.total_s * 1e12 * world);
  out.tokens_per_s_per_gpu = static_cast<double>(t.global_batch_size) * seq / (out.total_s * world);
  return out;
}

StepTime estimate_step_time(const PlanArgs& args) { return estimate_step_time(args, estimate_plan_memory(args)); }

}  // namespace moecore::plan
