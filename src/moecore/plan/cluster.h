// The machines a plan is for: per-GPU memory, peak FLOP/s per precision, HBM bandwidth, the NVLink domain and the
// network between domains. Presets carry NVIDIA's published per-GPU figures (dense Tensor Core peaks, no
// sparsity); every figure can be overridden by a flag.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace moecore::plan {

struct Cluster {
  std::string name;
  double memory_gib = 0;               // usable device memory per GPU
  double peak_tflops_bf16 = 0;         // dense BF16 Tensor Core peak
  double peak_tflops_fp8 = 0;          // dense FP8 (E4M3 / MXFP8) peak
  double peak_tflops_fp4 = 0;          // dense NVFP4 peak (0: no FP4 Tensor Cores)
  double hbm_tbps = 0;                 // device memory bandwidth, TB/s
  int64_t gpus_per_domain = 1;         // GPUs sharing one NVLink domain
  double intra_domain_gbps = 0;        // NVLink bandwidth per GPU and direction, GB/s
  double inter_domain_gbps = 0;        // network bandwidth per GPU and direction between domains, GB/s
  double intra_domain_latency_us = 0;  // alpha of the alpha-beta model inside a domain
  double inter_domain_latency_us = 0;  // and across domains
  // Flash attention (forward + backward) as a share of the BF16 peak: the softmax's exponentials run on the
  // special-function units, which Blackwell Ultra (GB300) doubles over Blackwell (GB200, B200).
  double attention_efficiency = 0.45;
  bool moecore_cpu_engine = false;  // moecore's own CPU engine (fp32 weights), not Megatron on GPUs
};

// H100 (SXM, HGX 8-GPU NVLink domain, 400 Gb/s InfiniBand per GPU), H200, B200 (HGX 8-GPU), GB200 and GB300
// (NVL72 racks; 400 / 800 Gb/s per GPU between racks), and "cpu": this machine running moecore itself.
// Throws ConfigError naming the known presets for any other name.
Cluster cluster_preset(const std::string& name);
std::vector<std::string> cluster_preset_names();

// One line per preset with its figures (for --help and the README).
std::string describe_cluster(const Cluster& cluster);

}  // namespace moecore::plan
