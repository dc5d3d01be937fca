#include "moecore/plan/cluster.h"

#include <algorithm>
#include <cstdio>
#include <thread>

#include "moecore/model/config.h"
#include "moecore/plan/cpu_probe.h"

namespace moecore::plan {
namespace {

// Sources: NVIDIA H100 Tensor Core GPU datasheet (SXM: 80 GB HBM3, 3.35 TB/s, BF16 989 TFLOP/s and FP8 1979
// TFLOP/s dense, NVLink 900 GB/s bidirectional); H200 datasheet (141 GB HBM3e, 4.8 TB/s, same Tensor Cores);
// DGX B200 datasheet (180 GB HBM3e, 8 TB/s; per GPU dense BF16 2.25, FP8 4.5, FP4 9 PFLOP/s);
// GB200 NVL72 (186 GB HBM3e, 8 TB/s, per GPU BF16 2.5, FP8 5, FP4 10 PFLOP/s dense; NVLink 5 1.8 TB/s
// bidirectional; ConnectX-7 400 Gb/s); GB300 NVL72 (288 GB HBM3e, 8 TB/s, BF16 2.5, FP8 5, FP4 15 PFLOP/s dense;
// ConnectX-8 800 Gb/s). The CPU preset's peak is a per-core fp32 figure for moecore's oneDNN GEMMs (bench/RESULTS.md).
Cluster make(const char* name, double memory_gib, double bf16, double fp8, double fp4, double hbm, int64_t domain,
             double intra, double inter) {
  Cluster c;
  c.name = name;
  c.memory_gib = memory_gib;
  c.peak_tflops_bf16 = bf16;
  c.peak_tflops_fp8 = fp8;
  c.peak_tflops_fp4 = fp4;
  c.hbm_tbps = hbm;
  c.gpus_per_domain = domain;
  c.intra_domain_gbps = intra;
  c.inter_domain_gbps = inter;
  c.intra_domain_latency_us = 10.0;
  c.inter_domain_latency_us = 20.0;
  return c;
}

Cluster with_attention(Cluster c, const double efficiency) {
  c.attention_efficiency = efficiency;
  return c;
}

}  // namespace

std::vector<std::string> cluster_preset_names() { return {"H100", "H200", "B200", "GB200", "GB300", "cpu"}; }

Cluster cluster_preset(const std::string& name) {
  // Memory in GiB as the CUDA driver reports it, less about 2 GiB of context and allocator reserve.
  if (name == "H100") return make("H100", 77.0, 989, 1979, 0, 3.35, 8, 450, 50);
  if (name == "H200") return make("H200", 129.0, 989, 1979, 0, 4.8, 8, 450, 50);
  if (name == "B200") return with_attention(make("B200", 166.0, 2250, 4500, 9000, 8.0, 8, 900, 50), 0.33);
  if (name == "GB200") return with_attention(make("GB200", 171.0, 2500, 5000, 10000, 8.0, 72, 900, 50), 0.33);
  if (name == "GB300") return with_attention(make("GB300", 266.0, 2500, 5000, 15000, 8.0, 72, 900, 100), 0.5);
  if (name == "cpu") {
    // One core per rank; its figures measured on this machine (cpu_probe.h). moecore computes in fp32 whatever the
    // precision flags, so every peak is the fp32 GEMM rate; MPI's shared-memory transport copies at memcpy speed.
    const CpuProbe& probe = probe_cpu();
    const double tflops = probe.sgemm_gflops / 1e3;
    Cluster c = make("cpu", probe.memory_gib, tflops, tflops, tflops, probe.copy_gbps / 1e3,
                     static_cast<int64_t>(std::max(1u, std::thread::hardware_concurrency())), probe.copy_gbps / 2.0,
                     probe.copy_gbps / 2.0);
    c.moecore_cpu_engine = true;
    c.attention_efficiency = 0.3;
    c.intra_domain_latency_us = c.inter_domain_latency_us = 10.0;
    return c;
  }
  std::string known;
  for (const std::string& n : cluster_preset_names()) known += (known.empty() ? "" : ", ") + n;
  throw ConfigError("--gpu: unknown GPU '" + name + "' (known: " + known + ")");
}

std::string describe_cluster(const Cluster& c) {
  char line[320];
  std::snprintf(line, sizeof(line),
                "%s: %.0f GiB, BF16 %.4g / FP8 %.4g / FP4 %.4g TFLOP/s, HBM %.3g TB/s, %lld GPUs per NVLink domain at "
                "%.3g GB/s, %.3g GB/s between domains",
                c.name.c_str(), c.memory_gib, c.peak_tflops_bf16, c.peak_tflops_fp8, c.peak_tflops_fp4, c.hbm_tbps,
                static_cast<long long>(c.gpus_per_domain), c.intra_domain_gbps, c.inter_domain_gbps);
  return line;
}

}  // namespace moecore::plan
