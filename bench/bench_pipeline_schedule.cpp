// The pipeline bubble of Megatron's schedules (1F1B and interleaved) as the simulator measures it, beside the analytic
// (PP - 1) / (VPP * M + PP - 1) of Narayanan et al. 2021: the figures measured pipeline runs are compared with.
// Costs are a whole stage's forward and backward of one micro-batch (a chunk takes 1 / VPP of them) and a latency
// per transfer. "eager" runs the executor's non-blocking sends, "rendezvous" sends that wait for their receiver.
// live(r0): the most micro-batch contexts pp rank 0 holds at once, counted in chunks (a chunk's context holds 1 / VPP
// of a stage's activations). N: the interleaved schedule's micro-batch group size (Megatron's default, PP).
// usage: bench_pipeline_schedule [PP [FORWARD BACKWARD [LATENCY]]]   (defaults: 4, 1 2, 0)
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>
#include <vector>

#include "moecore/pipeline/pipeline_schedule.h"
#include "moecore/pipeline/pipeline_simulator.h"

int main(int argc, char** argv) {
  using namespace moecore;
  if (argc != 1 && argc != 2 && argc != 4 && argc != 5) {
    std::fprintf(stderr, "usage: bench_pipeline_schedule [PP [FORWARD BACKWARD [LATENCY]]]\n");
    return 2;
  }
  const int pp = argc > 1 ? std::atoi(argv[1]) : 4;
  const double forward = argc > 3 ? std::atof(argv[2]) : 1.0;
  const double backward = argc > 3 ? std::atof(argv[3]) : 2.0;
  const double latency = argc > 4 ? std::atof(argv[4]) : 0.0;
  if (pp < 1 || forward <= 0.0 || backward <= 0.0 || latency < 0.0) {
    std::fprintf(stderr, "bench_pipeline_schedule: PP must be >= 1, costs > 0, latency >= 0\n");
    return 2;
  }
  std::printf("# stage forward %g, backward %g per micro-batch, p2p latency %g\n", forward, backward, latency);
  std::printf("%3s %4s %4s %3s %10s %9s %10s %10s %11s %9s\n", "PP", "VPP", "M", "N", "makespan", "live(r0)", "eager",
              "rendezvous", "analytic", "eager-ana");
  try {
    for (const int vpp : {1, 2}) {
      for (const int m : {4, 8, 16}) {
        if (pp == 1 && vpp > 1) continue;
        const std::vector<PipelineSchedule> schedules = make_all_schedules(pp, vpp, m);
        const PipelineCosts costs{forward / vpp, backward / vpp, latency};
        const PipelineSimulation eager = simulate_pipeline(schedules, costs, SendCompletion::kEager);
        const PipelineSimulation rendezvous = simulate_pipeline(schedules, costs, SendCompletion::kRendezvous);
        if (!eager.completed || !rendezvous.completed) {
          std::fprintf(stderr, "PP %d VPP %d M %d: %s%s\n", pp, vpp, m, eager.error.c_str(), rendezvous.error.c_str());
          return 1;
        }
        const double analytic = analytic_bubble_fraction(pp, vpp, m);
        const std::string group = vpp > 1 ? std::to_string(schedules[0].microbatch_group_size) : "-";
        std::printf("%3d %4d %4d %3s %10.4f %9d %10.6f %10.6f %11.6f %+9.6f\n", pp, vpp, m, group.c_str(),
                    eager.makespan, schedules[0].max_live_contexts, eager.bubble_fraction, rendezvous.bubble_fraction,
                    analytic, eager.bubble_fraction - analytic);
      }
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_pipeline_schedule: %s\n", e.what());
    return 1;
  }
  return 0;
}
