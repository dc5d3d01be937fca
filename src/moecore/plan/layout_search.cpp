#include "moecore/plan/layout_search.h"

#include <algorithm>
#include <cstdio>

namespace moecore::plan {
namespace {

std::vector<int64_t> divisors(const int64_t n, const int64_t limit) {
  std::vector<int64_t> out;
  for (int64_t d = 1; d <= std::min(n, limit); ++d) {
    if (n % d == 0) out.push_back(d);
  }
  return out;
}

std::string gib(const double bytes) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.1f GiB", bytes / kGiB);
  return text;
}

// Why each fitting layout ranks where it does: the best against the runner-up, the others against the best, by
// the step-time part that differs most.
void explain_ranking(std::vector<Candidate>& sorted) {
  if (sorted.empty() || !sorted.front().fits) return;
  const auto parts = [](const StepTime& t) {
    return std::vector<std::pair<const char*, double>>{{"compute", t.compute_s},
                                                       {"exposed TP communication", t.tp_comm_s},
                                                       {"exposed CP communication", t.cp_comm_s},
                                                       {"exposed EP communication", t.ep_comm_s},
                                                       {"exposed PP communication", t.pp_comm_s},
                                                       {"exposed DP communication", t.dp_comm_s},
                                                       {"pipeline bubble", t.bubble_s},
                                                       {"optimizer step", t.optimizer_s}};
  };
  // The part that grows most from `faster` to `slower`, and the one that shrinks most, if any.
  const auto largest_difference = [&](const StepTime& slower, const StepTime& faster) {
    const auto a = parts(slower), b = parts(faster);
    size_t most = 0, least = 0;
    for (size_t i = 1; i < a.size(); ++i) {
      if (a[i].second - b[i].second > a[most].second - b[most].second) most = i;
      if (a[i].second - b[i].second < a[least].second - b[least].second) least = i;
    }
    char text[200];
    int used = std::snprintf(text, sizeof(text), "%s %.3f s vs %.3f s", a[most].first, a[most].second, b[most].second);
    if (a[least].second < b[least].second && used > 0) {
      std::snprintf(text + used, sizeof(text) - static_cast<size_t>(used), " (it saves %.3f s of %s)",
                    b[least].second - a[least].second, a[least].first);
    }
    return std::string(text);
  };
  const StepTime& best = *sorted.front().time;
  if (sorted.size() > 1 && sorted[1].fits) {
    sorted.front().reason = "fastest that fits; the runner-up loses on " + largest_difference(*sorted[1].time, best);
  } else {
    sorted.front().reason = "the only layout that fits";
  }
  for (size_t i = 1; i < sorted.size() && sorted[i].fits; ++i) {
    char text[64];
    std::snprintf(text, sizeof(text),
                  "%.1f%% slower than the best: ", 100.0 * (sorted[i].time->total_s / best.total_s - 1.0));
    sorted[i].reason = text + largest_difference(*sorted[i].time, best);
  }
}

}  // namespace

std::optional<std::string> balanced_pipeline_layout(const int64_t num_layers, const int64_t mtp_layers,
                                                    const int64_t pp, const int64_t vpp) {
  const int64_t stages = pp * vpp;
  if (stages <= 1 || (num_layers % stages == 0 && mtp_layers == 0)) return std::nullopt;
  // Units: the embedding, every decoder layer, the MTP layers and the loss.
  const int64_t units = num_layers + 2 + mtp_layers;
  if (units < stages + 1) return std::nullopt;
  std::vector<int64_t> per_stage(static_cast<size_t>(stages), units / stages);
  // The remainder goes to the middle stages, away from the embedding and the loss.
  for (int64_t i = 0; i < units % stages; ++i)
    ++per_stage[static_cast<size_t>(1 + i % std::max<int64_t>(1, stages - 2))];
  std::string layout;
  for (int64_t s = 0; s < stages; ++s) {
    int64_t layers = per_stage[static_cast<size_t>(s)];
    std::string cell;
    if (s == 0) {
      cell += "E";
      --layers;
    }
    if (s == stages - 1) layers -= 1 + mtp_layers;
    if (layers < 0) return std::nullopt;
    cell += std::string(static_cast<size_t>(layers), 't');
    if (s == stages - 1) cell += std::string(static_cast<size_t>(mtp_layers), 'm') + "L";
    layout += (s ? "|" : "") + cell;
  }
  return layout;
}

std::vector<Candidate> search_layouts(const PlanArgs& args) {
  const ModelConfig& c = args.model.config;
  const int64_t gpus = args.num_gpus;
  const int64_t domain = args.cluster.gpus_per_domain;
  const int64_t experts = std::max<int64_t>(1, c.moe.num_experts);
  std::vector<Candidate> out;
  for (const int64_t tp : divisors(gpus, std::min<int64_t>(domain, 8))) {
    for (const int64_t pp : divisors(gpus / tp, std::min<int64_t>(c.num_layers, 64))) {
      for (const int64_t cp : divisors(gpus / (tp * pp), 16)) {
        if ((cp & (cp - 1)) != 0) continue;
        const int64_t dp = gpus / (tp * pp * cp);
        (void)dp;
        for (const int64_t etp : tp > 1 ? std::vector<int64_t>{1, tp} : std::vector<int64_t>{1}) {
          for (const int64_t ep : divisors(std::min(experts, gpus / (pp * etp)), gpus)) {
            if (!c.moe.enabled() && ep > 1) continue;
            if ((gpus / pp) % (ep * etp) != 0) continue;
            std::vector<int64_t> vpps{1};
            if (pp > 1) {
              for (int64_t v = 2; v <= 16; ++v) {
                if ((c.num_layers + args.model.config.mtp_num_layers + 2) >= pp * v * 2) vpps.push_back(v);
              }
            }
            for (const int64_t vpp : vpps) {
              LayoutChoice layout;
              layout.tp = tp;
              layout.pp = pp;
              layout.vpp = vpp;
              layout.cp = cp;
              layout.ep = ep;
              layout.etp = etp;
              if (pp > 1)
                layout.pipeline_layout =
                    balanced_pipeline_layout(c.num_layers, args.model.config.mtp_num_layers, pp, vpp);
              Candidate candidate;
              candidate.layout = layout;
              try {
                const PlanArgs plan = with_layout(args, layout);
                const MemoryPlan memory = estimate_plan_memory(plan);
                candidate.memory = memory.worst();
                candidate.time = estimate_step_time(plan, memory);
                const double limit = args.cluster.memory_gib * kGiB;
                candidate.fits = candidate.memory->total() <= limit;
                if (!candidate.fits) {
                  candidate.reason = "out of memory by " + gib(candidate.memory->total() - limit) + " on pp rank " +
                                     std::to_string(candidate.memory->pp_rank) + " (" + gib(candidate.memory->total()) +
                                     " of " + gib(limit) + ")";
                }
              } catch (const std::exception& error) {
                candidate.reason = error.what();
              }
              out.push_back(std::move(candidate));
            }
          }
        }
      }
    }
  }
  // Fitting layouts first, by estimated throughput; then the rest, out-of-memory ones by how close they come.
  std::stable_sort(out.begin(), out.end(), [](const Candidate& a, const Candidate& b) {
    if (a.fits != b.fits) return a.fits;
    if (a.fits) return a.time->total_s < b.time->total_s;
    if (a.memory.has_value() != b.memory.has_value()) return a.memory.has_value();
    if (a.memory) return a.memory->total() < b.memory->total();
    return false;
  });
  explain_ranking(out);
  return out;
}

}  // namespace moecore::plan
