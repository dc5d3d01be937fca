// moecore's MemoryTracker categories per pipeline rank (see moecore_engine_memory.h). The terms follow what moecore's
// modules allocate as owned Tensors (std::vectors are not tracked): parameters and DDP buffers
// (src/moecore/optim/ddp.cpp), the optimizers (AdamWOptimizer, DistributedAdamW), and the activations saved
// per micro-batch context by transformer_layer.cpp, attention.cpp, mlp.cpp, moe_layer.cpp, grouped_mlp.cpp and
// gpt_model.cpp, with the live contexts of pipeline/pipeline_schedule.cpp.
#include "moecore/plan/moecore_engine_memory.h"

#include <algorithm>
#include <cmath>
#include <optional>

#include "moecore/config/arguments.h"
#include "moecore/config/optimizer_master.h"
#include "moecore/ops/linear.h"
#include "moecore/ops/linear_cross_entropy.h"
#include "moecore/pipeline/pipeline_layout.h"
#include "moecore/plan/pipeline_peak.h"
#include "moecore/util/checked_math.h"

namespace moecore::plan {
namespace {

// The model's sizes as doubles (products of them exceed 64-bit integers on the largest configurations) and its
// switches, read from the config.
struct Shape {
  const ModelConfig& config;
  double h = 0, n = 0, g = 0, d = 0, f = 0, fm = 0, k = 0, sh = 0, experts = 0, vocab = 0;
  double glu = 1, nrm = 1, bias = 1;
  double latent = 0, xw = 0;  // --moe-latent-size (0: none); the routed experts' width (latent, else h)
  bool learned_pos = false;
  double max_pos = 0;
  // Multi-latent attention (model/mla_attention.h): q latent (0: none), kv latent, query / key and value head widths,
  // rope channels.
  bool mla = false;
  double q_rank = 0, kv_rank = 0, dqk = 0, dv = 0, dr = 0;
};

struct Layout : LayoutSizes {
  bool sp = false;  // sequence parallelism in effect (TP > 1)
};

Shape shape_of(const PlanModel& model) {
  const ModelConfig& c = model.config;
  Shape s{c};
  if (c.mla) {
    s.mla = true;
    s.q_rank = static_cast<double>(c.mla->q_lora_rank);
    s.kv_rank = static_cast<double>(c.mla->kv_lora_rank);
    s.dr = static_cast<double>(c.mla->qk_pos_emb_head_dim);
    s.dqk = static_cast<double>(c.mla->qk_head_dim) + s.dr;
    s.dv = static_cast<double>(c.mla->v_head_dim);
  }
  s.h = static_cast<double>(c.hidden_size);
  s.n = static_cast<double>(c.num_attention_heads);
  s.g = static_cast<double>(c.num_query_groups);
  s.d = static_cast<double>(c.kv_channels);
  s.f = static_cast<double>(c.ffn_hidden_size);
  s.fm = static_cast<double>(c.moe.ffn_hidden_size);
  s.k = static_cast<double>(c.moe.topk);
  s.sh = static_cast<double>(c.moe.shared_expert_intermediate_size);
  s.latent = static_cast<double>(c.moe.latent_size);
  s.xw = s.latent > 0 ? s.latent : s.h;
  s.experts = static_cast<double>(c.moe.num_experts);
  s.vocab = static_cast<double>(c.vocab_size);
  s.glu = c.activation == Activation::kSwiGLU ? 2.0 : 1.0;
  s.nrm = c.normalization == Normalization::kLayerNorm ? 2.0 : 1.0;  // weight (+bias); rstd (+mean)
  s.bias = c.add_bias_linear ? 1.0 : 0.0;
  s.learned_pos = c.position_embedding_type == PositionEmbedding::kLearnedAbsolute;
  s.max_pos = static_cast<double>(c.max_position_embeddings);
  return s;
}

// Parameter elements of one decoder layer on one rank: the dense group (TP-sharded or replicated), the expert group
// and the params-category buffers without gradients (the router's expert bias).
struct LayerParams {
  double dense = 0, expert = 0, buffers = 0;
};

// The attention's parameter elements on one rank (standard or multi-latent).
double attention_params(const Shape& s, const Layout& l) {
  if (!s.mla) {
    double p = (s.n + 2 * s.g) * s.d * (s.h + s.bias) / l.tp();  // linear_qkv
    if (s.config.qk_layernorm) p += 2 * s.nrm * s.d;             // q / k norms
    return p + s.h * s.n * s.d / l.tp() + s.bias * s.h;          // linear_proj (bias replicated)
  }
  // Down projections and latent norms replicated over TP, up projections and linear_proj split by heads.
  double p = s.q_rank > 0 ? s.q_rank * s.h + s.n * s.dqk * s.q_rank / l.tp() : s.n * s.dqk * s.h / l.tp();
  p += (s.kv_rank + s.dr) * s.h + s.n * (s.dqk - s.dr + s.dv) * s.kv_rank / l.tp();
  if (s.config.qk_layernorm) p += s.nrm * (s.kv_rank + s.q_rank);
  return p + s.h * s.n * s.dv / l.tp() + s.bias * s.h;
}

LayerParams layer_params(const Shape& s, const Layout& l, const bool moe) {
  LayerParams p;
  p.dense = s.nrm * s.h;  // input norm
  p.dense += attention_params(s, l);
  p.dense += s.nrm * s.h;  // pre-MLP norm
  if (!moe) {
    p.dense += s.glu * s.f / l.tp() * (s.h + s.bias) + s.h * s.f / l.tp() + s.bias * s.h;
    return p;
  }
  p.dense += s.experts * s.h + s.bias * s.experts;  // router (replicated over TP)
  if (s.sh > 0)
    p.dense += s.glu * s.sh / l.tp() * s.h + s.h * s.sh / l.tp() + (s.config.moe.shared_expert_gate ? s.h : 0);
  const double fml = s.fm / l.etp();
  p.expert = s.experts / l.ep() * (s.glu * fml * (s.xw + s.bias) + s.xw * fml + s.bias * s.xw);
  if (s.latent > 0) p.dense += s.latent * (2 * s.h + s.bias) + s.bias * s.h;  // LatentMoE's projections (replicated)
  if (s.config.moe.enable_expert_bias) p.buffers = s.experts;
  return p;
}

// Megatron-FSDP (optim/fsdp.h): the elements of the decoder layers on a rank, its units, and the last two (the first
// unit to run backward and the one its backward prefetches).
struct FsdpUnits {
  double dense = 0, expert = 0, largest = 0, last = 0, previous = 0;
  double largest_dense = 0, largest_expert = 0;  // of one unit
  int64_t count = 0;
  void add(const LayerParams& p) {
    ++count;
    dense += p.dense;
    expert += p.expert;
    largest_dense = std::max(largest_dense, p.dense);
    largest_expert = std::max(largest_expert, p.expert);
    previous = last;
    last = p.dense + p.expert;
    largest = std::max(largest, last);
  }
};

// What the strategy takes off a rank's whole parameters and gradients (elements), and its transient unit buffers
// (bytes, kComm): gathered parameters (fp32) and whole unit gradient buffers.
struct FsdpSharding {
  double dense_params_saved = 0, expert_params_saved = 0, params_saved = 0;
  double grads_saved = 0;
  double whole_grads_units = 0;    // unit elements whose gradients are reduced per unit (no standing 16-bit wire)
  double first_backward_comm = 0;  // while the first unit's backward runs
  double comm_peak = 0;            // the most at any moment
};

FsdpSharding fsdp_sharding(const TrainingArgs& t, const Layout& l, const FsdpUnits& u) {
  FsdpSharding f;
  if (!t.use_megatron_fsdp) return f;
  const bool zero3 = t.data_parallel_sharding_strategy == "optim_grads_params";
  const bool sharded_grads = zero3 || t.data_parallel_sharding_strategy == "optim_grads";
  // Dense unit parameters are sharded over dp-cp, routed experts over expert-DP.
  const double dense_saved = u.dense * (1 - 1 / (l.dp() * l.cp())), expert_saved = u.expert * (1 - 1 / l.edp());
  if (zero3) {
    f.dense_params_saved = dense_saved;
    f.expert_params_saved = expert_saved;
    f.params_saved = dense_saved + expert_saved;
  }
  if (sharded_grads) {
    f.grads_saved = dense_saved + expert_saved;
    f.whole_grads_units = u.dense + u.expert;
  }
  // The first backward holds its unit's gathered parameters, the previous unit's (prefetched, when this rank holds
  // it) and its own whole gradient buffer. A later unit's backward also holds the next unit's buffer while its
  // reduce-scatter runs (in the gradients' dtype once rounded to it).
  const double wire = t.model.params_dtype == DType::kF32 ? 4.0 : 2.0;
  f.first_backward_comm = (zero3 ? 4 * (u.last + u.previous) : 0) + (sharded_grads ? 4 * u.last : 0);
  const double gathered = u.count >= 3 ? 2 : 1;
  f.comm_peak = std::max(f.first_backward_comm, (zero3 ? 4 * gathered * u.largest : 0) +
                                                    (sharded_grads && u.count >= 2 ? (4 + wire) * u.largest : 0));
  return f;
}

double dtype_bytes(const std::string& dtype) { return dtype == "fp32" ? 4.0 : dtype == "fp8" ? 1.0 : 2.0; }

// Rows of one micro-batch on one rank, and the bytes of a stored activation element. The functions below give bytes:
// activations, saved tensors and activation gradients take `a` bytes an element (fp32: 4; under --bf16 / --fp16: 2,
// ops/precision.h's 16-bit storage), what stays fp32 takes 4 (norm statistics, log-sum-exps, the router's input copy
// and probabilities, probability gradients, losses, weight gradients, the logits chunk).
struct Tokens {
  double a = 4;   // bytes of an activation element
  double t = 0;   // local (CP) sequence tokens of the TP group
  double ta = 0;  // residual-stream rows (T / TP under sequence parallelism)
  double tm = 0;  // MoE rows: moecore always sequence-shards the MoE layer under TP (TransformerLayer::moe_forward)
  double r = 0;   // rows reaching this rank's local experts (dropless, balanced routing)
  // FP8 / FP4: bytes of a linear input kept quantized for the weight gradient (0: high precision). Set per layer.
  double q = 0;
  // The bytes of an element of a linear input the layer keeps quantized (x.a where it keeps it in high precision).
  double in() const { return q > 0 ? q : a; }
};

// Bytes an element of a linear input saved quantized takes (ops/linear.h, quant/packed_quantized_tensor.h): the code
// (1 byte FP8, half a byte E2M1) and its share of the block scales (fp32 per 1x128 block for blockwise, an E8M0 byte
// per 32 for MXFP8, an E4M3 byte per 16 for NVFP4; per-tensor: one fp32 for the whole tensor).
double quantized_input_bytes(const quant::Recipe recipe) {
  switch (recipe) {
    case quant::Recipe::kBlockwise: return 1.0 + 4.0 / 128.0;
    case quant::Recipe::kMxfp8: return 1.0 + 1.0 / 32.0;
    case quant::Recipe::kNvfp4: return 0.5 + 1.0 / 16.0;
    default: return 1.0;
  }
}

// The saved-input element bytes of global decoder layer `layer` (0 when its linear layers run in high precision).
double layer_quantized_input_bytes(const ModelConfig& c, const int64_t layer) {
  const quant::QuantizedLinearConfig* q = c.layer_quantization(layer);
  return q != nullptr && q->save_quantized_input ? quantized_input_bytes(q->recipe) : 0.0;
}

// Recomputation (model/transformer_layer.cpp): what the selected modules drop from a layer's saved tensors.
double attention_dropped(const Shape& s, const Layout& l, const Tokens& x, const Recompute& r) {
  const double nl = s.n / l.tp();
  double dropped = 0;
  if (r.has("core_attn")) dropped += 4 * x.t * nl;  // the log-sum-exp
  if (r.has("layernorm")) dropped += x.a * x.ta * s.h;
  if (s.mla && r.has("mla_up_proj")) dropped += x.a * (x.t * nl * (2 * s.dqk + s.dv) - x.t * s.dr);  // rope key kept
  return dropped;
}

double attention_saved(const Shape& s, const Layout& l, const Tokens& x, const Recompute& r) {
  const double nl = s.n / l.tp(), gl = s.g / l.tp();
  double a = x.ta * (x.a * s.h + 4 * s.nrm) - attention_dropped(s, l, x, r);  // input norm output + stats
  if (x.q > 0 && !r.has("layernorm")) {
    // Under FP8 / FP4 the norm output is kept only as its projections' quantized inputs (TransformerLayer::forward):
    // linear_qkv's, or MLA's kv_down_proj and q_down_proj (linear_q_proj's without a q latent); gathered under
    // sequence parallelism (counted below). linear_q_proj recomputed by mla_up_proj keeps it in high precision.
    const bool q_proj_reads_it = s.mla && s.q_rank == 0;
    const bool kept = q_proj_reads_it && r.has("mla_up_proj") && !l.sp;
    double copies = 0;
    if (!s.mla) copies = l.sp ? 0 : 1;
    if (s.mla) copies = 1 + (s.q_rank > 0 ? 1 : (!l.sp && !r.has("mla_up_proj") ? 1 : 0));
    a += x.ta * s.h * (x.q * copies - (kept ? 0 : x.a));
  }
  if (s.mla) {
    // The up projections keep their (all-gathered) normed latents, the norms their inputs and statistics; the core
    // attention q, k (dq + dr wide), v and its output (dv wide), the log-sum-exp.
    // Under FP8 / FP4 the up projections keep their inputs quantized, unless mla_up_proj recomputes from them.
    const double up_in = r.has("mla_up_proj") ? x.a : x.in();
    const double latents = s.q_rank + s.kv_rank;
    a += up_in * (l.sp ? x.t : x.ta) * latents;
    if (s.config.qk_layernorm) a += x.a * x.ta * latents + 4 * x.ta * s.nrm * ((s.q_rank > 0 ? 1 : 0) + 1);
    if (s.q_rank == 0 && l.sp) a += up_in * x.t * s.h;  // linear_q_proj's all-gathered input
    a += x.a * x.t * nl * (2 * s.dqk + 2 * s.dv) + 4 * x.t * nl;
    return a + x.a * x.ta * s.h;  // x_mid
  }
  if (l.sp) a += x.in() * x.t * s.h;     // ColumnParallelLinear keeps the all-gathered input
  a += x.a * x.t * (nl + 2 * gl) * s.d;  // q, k, v as core attention sees them
  if (s.config.qk_layernorm) a += x.t * (x.a * (nl + gl) * s.d + 4 * (nl + gl) * s.nrm);
  a += x.a * x.t * nl * s.d + 4 * x.t * nl;  // core attention output, log-sum-exp
  a += x.a * x.ta * s.h;                     // x_mid
  return a;
}

double ffn_saved(const Shape& s, const Layout& l, const Tokens& x, const bool moe, const Recompute& r) {
  double a = x.ta * (x.a * s.h + 4 * s.nrm) + x.a * x.ta * s.h;  // pre-MLP norm output + stats, layer output
  if (r.has("layernorm")) a -= x.a * x.ta * s.h;
  if (!moe) {
    if (r.has("mlp")) return a;
    // Under FP8 / FP4 the norm output is kept only as fc1's quantized input (gathered under SP: counted below).
    if (x.q > 0 && !r.has("layernorm")) a += x.ta * s.h * ((l.sp ? 0 : x.q) - x.a);
    // fc1's all-gathered input and fc2's input are the linears' own: kept quantized under FP8 / FP4.
    return a + x.in() * (l.sp ? x.t * s.h : 0) + x.a * x.t * s.glu * s.f / l.tp() + x.in() * x.t * s.f / l.tp();
  }
  if (r.has("moe")) return a;
  const double fml = s.fm / l.etp();
  // The router (moe/router.h): its input copy (fp32), logits (the router dtype), top-k selection (int32), aux scores
  // (fp64, with an aux loss on) and log-sum-exps (fp64, with the z-loss); the routing's probabilities (fp32) and map
  // (one byte).
  const MoEConfig& moe_config = s.config.moe;
  const double logits_bytes = moe_config.router_dtype == RouterDType::kFP64 ? 8 : 4;
  a += 4 * x.tm * s.h + logits_bytes * x.tm * s.experts + 4 * x.tm * s.k + 5 * x.tm * s.experts;
  if (aux_losses_on(moe_config)) a += 8 * x.tm * s.experts;
  if (moe_config.z_loss_coeff > 0) a += 8 * x.tm;
  // Under FP8 / FP4 the experts keep fc1's input (the dispatched rows) and, with weighted SwiGLU, fc2's input
  // quantized.
  const bool probs_on_input = moe_config.apply_probs_on_input;
  const double fc1_in = probs_on_input ? x.a : x.in();
  const double fc2_in = s.glu == 2 && !probs_on_input ? x.in() : x.a;
  a += x.r * (fc1_in * s.xw + x.a * s.glu * fml + fc2_in * fml + 4);  // dispatched rows, fc1 output, fc2 input; probs
  if (r.has("moe_act")) a -= fc2_in * x.r * fml;
  // Without memory-efficient permutation the experts keep their output before the probability, and ones (fp32) for
  // their own probabilities.
  if (!s.config.moe.memory_efficient_permutation) a += x.r * (x.a * s.xw + 4);
  a += x.in() * x.tm * s.latent;  // LatentMoE: fc2_latent_proj's input, the combined output
  if (s.sh > 0 && !r.has("shared_experts")) {
    a += x.in() * (l.tp() > 1 ? x.t * s.h : 0) + x.a * x.t * s.glu * s.sh / l.tp() + x.in() * x.t * s.sh / l.tp();
    if (s.config.moe.shared_expert_gate) a += x.a * (x.tm + x.tm * s.h);
  }
  return a;
}

// The largest transient of a layer's backward (the first layer of the chunk to run backward). fused_experts: the
// grouped-MLP op runs the experts (--moe-grouped-gemm, not under FP8 / FP4): its d(fc1 output) workspace is fp32.
double backward_transient(const Shape& s, const Layout& l, const Tokens& x, const bool moe, const bool fused_experts) {
  if (moe) {  // the MoE layer's input gradient stays fp32 (the router adds to it unrounded)
    const double dfc1_bytes = fused_experts ? 4 : x.a;
    double t = x.a * (3 * x.ta * s.h + 2 * x.r * s.xw) + dfc1_bytes * x.r * s.glu * s.fm / l.etp() + 4 * x.tm * s.h;
    if (!s.config.moe.memory_efficient_permutation) t += x.a * x.r * s.xw;  // the gradient of the output before p
    if (l.tp() > 1 && !l.sp) t += x.a * 2 * x.tm * s.h;
    if (s.config.moe.dispatcher_type != TokenDispatcherType::kAllGather && l.ep() * l.etp() > 1) {
      // The all-to-all dispatcher's backward of the dispatch (moe/token_dispatcher_alltoall.cpp; the flex one's
      // holds about as much) sums the rows'
      // gradients over ETP in fp32 buffers, the rows unsorted [R, H], this rank's reduced share [R / ETP, H] and the
      // rows sent back [tokens x k, H], while the experts' input gradient [R, H] is still held.
      const double rows_back = x.tm * s.k;
      const double dispatch = x.a * (3 * x.ta * s.h + x.r * s.xw) + 4 * (x.r + x.r / l.etp() + rows_back) * s.xw +
                              4 * x.tm * s.h + (l.tp() > 1 && !l.sp ? x.a * 2 * x.tm * s.h : 0);
      t = std::max(t, dispatch);
    }
    return t;
  }
  return x.a * (3 * x.ta * s.h + x.t * s.f / l.tp() + x.t * s.glu * s.f / l.tp() + (l.tp() > 1 ? x.t * s.h : 0) +
                (l.sp ? x.t * s.h : 0));
}

struct Owners {
  double attention = 0, mlp = 0, moe = 0, embedding = 0, output = 0, other = 0;
  double total() const { return attention + mlp + moe + embedding + output + other; }
  std::vector<NamedBytes> named(const double bytes_per_element) const {
    std::vector<NamedBytes> out;
    const auto add = [&](const char* name, const double elements) {
      if (elements != 0) out.push_back({name, elements * bytes_per_element});
    };
    add("attention", attention);
    add("mlp", mlp);
    add("moe", moe);
    add("embedding", embedding);
    add("output layer + loss", output);
    add("other", other);
    return out;
  }
};

}  // namespace

MemoryPlan moecore_engine_memory(const PlanArgs& args) {
  const TrainingArgs& t = args.train;
  const ModelConfig& c = args.model.config;
  const Shape s = shape_of(args.model);
  const PipelineLayout pipeline = pipeline_layout(t);
  const int pp = pipeline.pipeline_size(), vpp = pipeline.virtual_pipeline_size();

  const std::map<int64_t, int64_t> mtp_at = mtp_layers_by_stage(args, pp, vpp);  // virtual stage v * pp + r
  Layout l{layout_sizes(args)};
  l.sp = t.sequence_parallel && t.parallel.tensor_model_parallel_size > 1;

  Tokens x;
  x.t = static_cast<double>(c.seq_length) * static_cast<double>(t.micro_batch_size) / l.cp();
  x.ta = l.sp ? x.t / l.tp() : x.t;
  x.tm = l.tp() > 1 ? x.t / l.tp() : x.t;
  x.r = l.etp() * x.tm * s.k;
  x.a = c.params_dtype == DType::kF32 ? 4.0 : 2.0;  // 16-bit activation storage under --bf16 / --fp16

  const Recompute& rc = args.recompute;
  const bool low_precision = c.params_dtype != DType::kF32;
  // Megatron-FSDP's no_shard keeps whole Adam states (optim/fsdp.h); every other strategy shards them as the
  // distributed optimizer does.
  const bool distopt =
      t.use_distributed_optimizer && !(t.use_megatron_fsdp && t.data_parallel_sharding_strategy == "no_shard");
  const bool pa = t.use_precision_aware_optimizer;
  const int64_t microbatches = l.microbatches;
  const double vocab_local = s.vocab / l.tp();

  MemoryPlan plan;
  StageMemory worst;
  worst.pp_rank = -1;
  for (int r = 0; r < pp; ++r) {
    const bool first = r == 0, last = r == pp - 1;
    // ---- parameters, gradients, optimizer, communication buffers ----
    double dense = 0, expert = 0, buffers = 0;
    FsdpUnits units;  // the decoder layers: Megatron-FSDP's units (MTP depths and the rest stay whole)
    int64_t layers = 0;
    std::optional<bool> last_layer_moe;
    bool last_layer_quantized = false;
    int64_t last_layer = -1;
    int64_t mtp_depths = 0;
    for (int v = 0; v < vpp; ++v) {
      const PipelineStage& chunk = pipeline.stage(r, v);
      for (int64_t layer = chunk.first_layer; layer < chunk.end_layer(); ++layer) {
        const bool moe = c.moe.is_moe_layer(layer);
        const LayerParams p = layer_params(s, l, moe);
        dense += p.dense;
        expert += p.expert;
        buffers += p.buffers;
        units.add(p);
        last_layer_moe = moe;
        last_layer_quantized = c.layer_quantization(layer) != nullptr;
        last_layer = layer;
        ++layers;
      }
      if (const auto it = mtp_at.find(static_cast<int64_t>(v) * pp + r); it != mtp_at.end()) mtp_depths += it->second;
    }
    // Multi-Token Prediction depths (model/multi_token_prediction.h): each a layer like the last decoder layer,
    // enorm, hnorm and final_layernorm, eh_proj [H, 2H] column-parallel; a stage without the embedding keeps its own
    // copy of the word embedding for their input where it has none for the output layer (untied).
    const bool last_moe = c.num_layers > 0 && c.moe.is_moe_layer(c.num_layers - 1);
    double mtp_dense = 0;
    for (int64_t k = 0; k < mtp_depths; ++k) {
      const LayerParams p = layer_params(s, l, last_moe);
      mtp_dense += p.dense + 3 * s.nrm * s.h + 2 * s.h * s.h / l.tp();
      dense += p.dense + 3 * s.nrm * s.h + 2 * s.h * s.h / l.tp();
      expert += p.expert;
      buffers += p.buffers;
    }
    if (mtp_depths > 0 && !first && s.config.untie_embeddings_and_output_weights) dense += vocab_local * s.h;
    if (first) dense += vocab_local * s.h + (s.learned_pos ? s.max_pos * s.h : 0);
    if (last) dense += s.nrm * s.h + (s.config.untie_embeddings_and_output_weights || !first ? vocab_local * s.h : 0);
    const double params = dense + expert;
    const FsdpSharding fsdp = fsdp_sharding(t, l, units);
    // The 16-bit casts the step keeps of the weights its native GEMMs read (ops/weight_casts.h), from their first
    // use in forward to the end of backward, and under --bf16 with the replicated optimizer on to the next step:
    // every parameter but the embedding tables' lookups (the word embedding is cast where it is also the output
    // layer); the norms and the fp32 router count with them (a small over-count).
    // FSDP's gathered units are not kept.
    // Under FP8 / FP4 the decoder layers' linear layers quantize their weights instead: the output layer's only.
    double cast_params = params;
    if (first)
      cast_params -= (s.config.untie_embeddings_and_output_weights || !last ? vocab_local * s.h : 0) +
                     (s.learned_pos ? s.max_pos * s.h : 0);
    if (c.num_layers > 0 && c.layer_quantization(0) != nullptr) cast_params = last ? vocab_local * s.h : 0;
    const bool kept_casts = low_precision && ops::gemm_lowp_native(c.params_dtype) && !t.use_megatron_fsdp;
    const double params_current = 4 * (params - fsdp.params_saved + buffers) + (kept_casts ? 2 * cast_params : 0);
    // ddp.cpp builds each group's flat parameter buffer (dense, then expert) while the parameters still exist; under
    // ZeRO-3 a unit's buffer takes its shard only.
    const double dense_buffer = dense - fsdp.dense_params_saved, expert_buffer = expert - fsdp.expert_params_saved;
    const double params_peak =
        4 * (params + buffers) + (distopt ? 4 * (dense_buffer + std::max(0.0, expert_buffer - dense)) : 0);
    // fp32 main gradients always; the model's whole gradients exist until DDP's build, so they are the peak.
    const double grads = 4 * params;
    const double grads_current = 4 * (params - fsdp.grads_saved);
    const double shard = distopt ? dense / (l.dp() * l.cp()) + expert / l.edp() : params;
    const double exp_avg = pa ? dtype_bytes(t.exp_avg_dtype) : 4.0;
    const double exp_avg_sq = pa ? dtype_bytes(t.exp_avg_sq_dtype) : 4.0;
    const std::string main_dtype = pa ? t.main_params_dtype : "fp32";
    double optimizer = (exp_avg + exp_avg_sq) * shard;
    if (low_precision) {
      // 16-bit parameters: fp32 main parameters, fp16 ones, or int16 remainders of bf16 (the precision-aware
      // optimizer's store_param_remainders, where Megatron stores them).
      const bool two_bytes = stores_param_remainders(t) || main_dtype == "fp16";
      optimizer += (two_bytes ? 2.0 : 4.0) * shard;
    }
    double optimizer_peak = optimizer;
    if (pa && (exp_avg != 4 || exp_avg_sq != 4 || main_dtype != "fp32" || low_precision)) {
      // scaled_adamw_step: three fp32 chunks of at most 2^18 elements of one parameter's piece of the shard.
      const double experts_local = std::max(1.0, s.experts / l.ep());
      double embedding_piece = vocab_local * s.h, qkv_piece = s.h * (s.n + 2 * s.g) * s.d / l.tp();
      double expert_piece = s.experts * s.glu * s.fm * s.h / (l.ep() * l.etp()) / experts_local;
      if (t.use_megatron_fsdp) {
        // Each module's parameters are buckets of their own, so a parameter's piece of a shard is at most its
        // bucket's shard: the embedding alone, the output layer with the MTP depths, a unit's dense parameters, a
        // unit's experts.
        const double dp_cp = l.dp() * l.cp();
        embedding_piece = std::max(first ? embedding_piece / dp_cp : 0.0,
                                   last ? std::min(embedding_piece, (embedding_piece + mtp_dense) / dp_cp) : 0.0);
        qkv_piece = std::min(qkv_piece, units.largest_dense / dp_cp);
        expert_piece = std::min(expert_piece, units.largest_expert / l.edp());
      }
      const double piece = std::max({embedding_piece, qkv_piece, expert_piece});
      optimizer_peak += 12 * std::min(piece, 262144.0);
    }
    double comm = distopt ? 4 * shard : 0;  // DistributedAdamW's fp32 comm shard
    const bool wire16 = t.grad_reduce_in_bf16 || t.main_grads_dtype == "bf16" ||
                        (c.params_dtype == DType::kF16 && !t.accumulate_allreduce_grads_in_fp32) ||
                        (distopt && low_precision) || (t.use_megatron_fsdp && low_precision);
    // A unit with sharded gradients takes its 16-bit wire only while its reduce-scatter runs (fsdp.cpp).
    if (wire16) comm += 2 * (params - fsdp.whole_grads_units) + (distopt ? 2 * shard : 0);
    if (distopt && (t.fp8_param_gather || t.fp4_param_gather)) {
      const double code = t.fp4_param_gather ? 0.5 : 1.0;  // quantized parameter codes + their shard
      comm += code * (params + shard);
    }

    // ---- activations (bytes: x.a an activation element, 4 what stays fp32) ----
    // Contexts alive at the first backward: the schedule's warm-up forwards and one more; one more again under the
    // combined 1F1B of --overlap-moe-expert-parallel-comm (a forward runs ahead of each backward).
    const int64_t combined = t.model.moe.overlap_ep_comm ? 1 : 0;
    const int64_t live = std::min<int64_t>(warmup_microbatches({.pp = pp,
                                                                .rank = r,
                                                                .vpp = vpp,
                                                                .microbatches = microbatches,
                                                                .group = t.microbatch_group_size_per_vp_stage}) +
                                               1 + combined,
                                           checked_mul(microbatches, vpp, "virtual micro-batches"));
    // The largest context of one chunk: its input, its layers' saved tensors, less the output sent on; with full
    // recomputation also the largest checkpoint, whose activations its backward rebuilds (`rerun`).
    Owners context, context_rerun;
    for (int v = 0; v < vpp; ++v) {
      const PipelineStage& chunk = pipeline.stage(r, v);
      Owners o, rerun, checkpoint;
      (chunk.has_embedding ? o.embedding : o.other) += x.a * x.ta * s.h;
      for (int64_t layer = chunk.first_layer; layer < chunk.end_layer(); ++layer) {
        const bool moe = c.moe.is_moe_layer(layer);
        const int64_t index = layer - chunk.first_layer, n = chunk.num_layers;
        Tokens xl = x;
        xl.q = layer_quantized_input_bytes(c, layer);
        const double attention = attention_saved(s, l, xl, rc), ffn = ffn_saved(s, l, xl, moe, rc);
        if (!rc.checkpointed(index)) {
          o.attention += attention;
          (moe ? o.moe : o.mlp) += ffn;
          continue;
        }
        // A checkpointed layer keeps nothing; its output survives as the next checkpoint's (or the next layer's)
        // input, or as the chunk's output.
        if (index + 1 == n || !rc.checkpointed(index + 1) || rc.checkpoint_begin(index + 1) == index + 1) {
          (moe ? o.moe : o.mlp) += x.a * x.ta * s.h;
        }
        checkpoint.attention += attention;
        (moe ? checkpoint.moe : checkpoint.mlp) += ffn;
        if (rc.checkpoint_end(index, n) == index + 1) {
          if (checkpoint.total() > rerun.total()) rerun = checkpoint;
          checkpoint = Owners{};
        }
      }
      const auto mtp_here = mtp_at.find(static_cast<int64_t>(v) * pp + r);
      const int64_t chunk_mtp = mtp_here == mtp_at.end() ? 0 : mtp_here->second;
      for (int64_t k = 0; k < chunk_mtp; ++k) {
        // Per depth: the embedding, the previous hidden state, the layer's output, the loss's input gradient, the
        // norms' statistics, eh_proj's (gathered) input [2H], and the layer's own saved tensors (full
        // recomputation: a checkpoint of the projection and the layer).
        o.output += x.ta * (x.a * 4 * s.h + 4 * 3 * s.nrm);
        Owners depth;
        depth.output = x.a * (l.sp ? x.t : x.ta) * 2 * s.h;
        depth.attention = attention_saved(s, l, x, rc);
        (last_moe ? depth.moe : depth.mlp) = ffn_saved(s, l, x, last_moe, rc);
        if (!rc.full()) {
          o.output += depth.output;
          o.attention += depth.attention;
          o.moe += depth.moe;
          o.mlp += depth.mlp;
        } else if (depth.total() > rerun.total()) {
          rerun = depth;
        }
      }
      if (!(last && vpp == 1)) o.other -= x.a * x.ta * s.h;
      if (o.total() > context.total()) {
        context = o;
        context_rerun = rerun;
      }
    }
    Owners backward;
    backward.output = static_cast<double>(live) * context.output;
    backward.attention = static_cast<double>(live) * context.attention;
    backward.mlp = static_cast<double>(live) * context.mlp;
    backward.moe = static_cast<double>(live) * context.moe;
    backward.embedding = static_cast<double>(live) * context.embedding;
    backward.other = static_cast<double>(live) * context.other;
    if (last_layer_moe) {
      (*last_layer_moe ? backward.moe : backward.mlp) +=
          backward_transient(s, l, x, *last_layer_moe, c.moe.grouped_gemm && !last_layer_quantized);
      // Selective recomputation rebuilds what the first layer to run backward dropped, before its backward.
      const Recompute none;
      Tokens xb = x;
      xb.q = layer_quantized_input_bytes(c, last_layer);
      double rebuilt = ffn_saved(s, l, xb, *last_layer_moe, none) - ffn_saved(s, l, xb, *last_layer_moe, rc);
      // moe_act rebuilds fc2's input in high precision (its forward kept it in no form).
      if (*last_layer_moe && rc.has("moe_act") && xb.in() != x.a && s.glu == 2 && !s.config.moe.apply_probs_on_input) {
        rebuilt += (x.a - xb.in()) * x.r * s.fm / l.etp();
      }
      (*last_layer_moe ? backward.moe : backward.mlp) += rebuilt;
    }
    backward.output += context_rerun.output;
    backward.attention += context_rerun.attention;
    backward.mlp += context_rerun.mlp;
    backward.moe += context_rerun.moe;
    backward.other += x.a * x.ta * s.h;  // dprev
    if (last) {
      backward.output += x.ta * (2 * x.a * s.h + 4 * s.nrm);  // the output's dx, the final norm's saved output
    } else {
      backward.other += x.a * 2 * x.ta * s.h;  // received gradient + its clone
    }
    Owners peak = backward;
    double other_moment = 0;
    double at_loss = 0;  // activations and op scratch (the "other" category) at the loss's forward
    if (last) {
      // Forward at the loss: the fused linear-cross-entropy keeps the final norm output and the input gradient, plus
      // its logits chunk (64 MiB of fp32 rows, 32 MiB under 16-bit activations: model/vocab_parallel.h; on the
      // native 16-bit GEMMs without a vocabulary split the rows are 16-bit, ops/linear_cross_entropy.h) and loss
      // vectors; its weight gradient goes to the main gradient.
      Owners forward = backward;
      forward.mlp = static_cast<double>(live) * context.mlp;
      forward.moe = static_cast<double>(live) * context.moe;
      forward.other = static_cast<double>(live) * context.other;
      const bool native = low_precision && ops::gemm_lowp_native(c.params_dtype);
      const bool split_vocab = l.tp() > 1;
      const double logit_bytes = native && !split_vocab ? 2 : 4;
      const double chunk_budget = 67108864.0 * x.a / 4;
      const auto chunk_rows = static_cast<double>(ops::linear_cross_entropy_chunk_rows(
          std::llround(x.t), std::llround(vocab_local), std::llround(chunk_budget), std::llround(logit_bytes)));
      forward.output = static_cast<double>(live) * context.output + x.ta * (x.a * s.h + 4 * s.nrm) + x.a * x.t * s.h +
                       logit_bytes * chunk_rows * vocab_local + x.a * (l.sp ? x.t * s.h : 0) + 4 * 3 * x.t;
      if (forward.total() > backward.total()) peak = forward;
      other_moment = std::min(forward.total(), backward.total());
      // The op's scratch under 16-bit activations: its input gradient staged in fp32; its input staged in fp32, or
      // where the CPU runs bf16 / fp16 GEMMs on its 16-bit kernels read as the 16-bit activation it is (fp32 storage:
      // narrowed to 16 bits), with the 16-bit bits of the weight and (vocabulary split) of a chunk's logit
      // gradients.
      double scratch = 0;
      if (low_precision) {
        scratch = 4 * x.t * s.h;
        if (native) {
          scratch +=
              (x.a == 2 ? 0 : 2 * x.t * s.h) + 2 * vocab_local * s.h + (split_vocab ? 2 * chunk_rows * vocab_local : 0);
        } else {
          scratch += 4 * x.t * s.h;
        }
      }
      at_loss = forward.total() + scratch;
    }

    StageMemory stage;
    stage.pp_rank = r;
    stage.weights = std::max(params_peak, params_current);
    stage.grads = grads;
    stage.main_weights_and_optimizer = optimizer_peak;
    stage.activations = peak.total();
    stage.comm_buffers = comm + fsdp.comm_peak;
    stage.activations_by_module = peak.named(1.0);
    stage.activations_other_moment = other_moment;
    stage.live_chunks_at_peak = live;
    stage.decoder_layers = layers;
    stage.fsdp = {.dense = dense,
                  .expert = expert,
                  .unit_dense = units.dense,
                  .unit_expert = units.expert,
                  .largest_unit = units.largest};
    // The log's total peak: the categories at one moment (parameters after DDP's build, no optimizer step chunks).
    // Megatron-FSDP's units in use count from the first backward on (no unit is gathered at the loss's forward); the
    // next unit's backward holds the most of them, with the first one's saved tensors gone (full recomputation
    // rebuilds each layer's, so its activations stay near their peak).
    double at_backward = backward.total() + fsdp.first_backward_comm;
    if (layers > 1 && last_layer_moe) {
      const PipelineStage& chunk = pipeline.stage(r, vpp - 1);
      const bool checkpointed = chunk.num_layers > 0 && rc.checkpointed(chunk.num_layers - 1);
      const double last_kept =
          checkpointed ? 0 : attention_saved(s, l, x, rc) + ffn_saved(s, l, x, *last_layer_moe, rc);
      at_backward = std::max(at_backward, backward.total() - last_kept + fsdp.comm_peak);
    }
    stage.total_override =
        params_current + grads_current + optimizer + comm + std::max({stage.activations, at_backward, at_loss});

    // moecore's log: each category the maximum over the ranks, the total peak the maximum of the ranks' totals, and
    // each model part's activations at the peak the maximum over the ranks' peaks.
    if (worst.pp_rank < 0 || stage.activations > worst.activations) {
      worst.activations = stage.activations;
      worst.activations_other_moment = stage.activations_other_moment;
      worst.live_chunks_at_peak = stage.live_chunks_at_peak;
    }
    for (const NamedBytes& part : stage.activations_by_module) {
      auto same = std::find_if(worst.activations_by_module.begin(), worst.activations_by_module.end(),
                               [&](const NamedBytes& p) { return p.name == part.name; });
      if (same == worst.activations_by_module.end()) {
        worst.activations_by_module.push_back(part);
      } else {
        same->bytes = std::max(same->bytes, part.bytes);
      }
    }
    worst.weights = std::max(worst.weights, stage.weights);
    worst.grads = std::max(worst.grads, stage.grads);
    worst.main_weights_and_optimizer = std::max(worst.main_weights_and_optimizer, stage.main_weights_and_optimizer);
    worst.comm_buffers = std::max(worst.comm_buffers, stage.comm_buffers);
    if (worst.pp_rank < 0 || stage.total() > worst.total()) {
      worst.pp_rank = r;
      worst.decoder_layers = layers;
    }
    worst.total_override = std::max(worst.total_override.value_or(0), stage.total());
    plan.stages.push_back(stage);
  }
  plan.total_parameters = count_parameters(args.model);
  plan.worst_over_ranks = worst;
  return plan;
}

}  // namespace moecore::plan
