// Whether the CPU's AVX512-BF16 dot product is worth using without AMX tiles: vdpbf16ps sums 32 bf16 products into
// 16 fp32 lanes, twice the products of the fp32 FMA it replaces, but it pays off only where it issues at that FMA's
// rate. That is a property of the core, not of the CPUID flags, so it comes from a table of measured CPUs:
//   - AMD family 1Ah (Zen 5): yes. On a 2-core EPYC VM, oneDNN's bf16 matmul ran at 1.6-2.1x the fp32 sgemm on
//     moecore's shapes and the attention's vdpbf16ps products at 1.2-1.6x its fp32 products (bench/RESULTS.md).
//   - Intel with AVX512-BF16 (Cooper Lake; Sapphire Rapids and later when the tiles are not granted): no. The
//     bf16 matmul ran at 55-70% of the sgemm on a Xeon (family 6 model 207) without its AMX exposed.
//   - Anything else, AMD Zen 4 (family 19h) included: no, until measured (bench/bench_gemm_lowp prints both paths;
//     MOECORE_LOWP_GEMM=native and MOECORE_ATTENTION_PRODUCTS=bf16 force them).
#pragma once

namespace moecore::kernels::cpu {

// True where the CPU has AVX512-BF16 (and AVX512-BW) and the table above says its vdpbf16ps outpaces the fp32 FMAs.
bool avx512_bf16_outpaces_fp32();

}  // namespace moecore::kernels::cpu
