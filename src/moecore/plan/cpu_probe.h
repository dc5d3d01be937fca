// This machine's figures for `--gpu cpu` (moecore itself as the cluster): one "GPU" is one core, as mpirun binds
// each rank to a core. Measured when asked for, since CPUs differ between machines.
#pragma once

namespace moecore::plan {

struct CpuProbe {
  double sgemm_gflops = 0;  // one thread, moecore's fp32 GEMM library, a [1024 x 1024] x [1024 x 1024] product
  double copy_gbps = 0;     // one thread, memcpy of 64 MiB (bytes read + written per second)
  double memory_gib = 0;    // MemAvailable per core
};

// About half a second; the result is cached for the process.
const CpuProbe& probe_cpu();

}  // namespace moecore::plan
