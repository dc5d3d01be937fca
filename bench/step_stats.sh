# shellcheck shell=bash
# Sourced by the step benchmarks that compare variants (run_step_ab.sh, run_bf16_paths.sh).
# step_stats FILE MODEL VARIANT: "median min" of the ms of the lines "MODEL VARIANT ms" in FILE.
step_stats() {
  awk -v m="$2" -v s="$3" '$1 == m && $2 == s {print $3}' "$1" | sort -g |
    awk '{v[NR] = $1} END {printf "%.1f %.1f", (NR % 2 ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2), v[1]}'
}
