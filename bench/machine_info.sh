# shellcheck shell=bash
# Sourced by the MoE step benchmarks (run_moe_step.sh, run_step_ab.sh): what the machine is, for their headers.
#   cpu:             lscpu's model name;
#   isa:             the matrix / vector extensions of /proc/cpuinfo that decide the GEMM kernels, space-separated
#                    with a leading space (avx2, avx512f, avx512_bf16, avx512_fp16, amx_tile, amx_bf16), or empty;
#   openblas_best:   the OpenBLAS kernel family for this instruction set (OPENBLAS_CORETYPE=SkylakeX with avx512f,
#                    Haswell with avx2 only, empty otherwise). Debian's OpenBLAS picks its kernels by CPU model and
#                    runs generic ones on models it does not know, several times slower (bench/RESULTS.md).
cpu=$(lscpu | sed -n 's/^Model name: *//p')
isa=$(for f in avx2 avx512f avx512_bf16 avx512_fp16 amx_tile amx_bf16; do
  grep -qw "$f" /proc/cpuinfo && printf ' %s' "$f"
done || true)
case "$isa" in
  *avx512f*) openblas_best=SkylakeX ;;
  *avx2*) openblas_best=Haswell ;;
  *) openblas_best= ;;
esac
