# Sourced by the MPI benchmarks of the demo model (run_ep_overlap.sh, run_flex_bytes.sh): `demo_args FLAG...` sets
# `args` to configs/demo.args without the flags named (and their values), plus mock data, so a script adds its own.
demo_args() {
  args=()
  local flag value skip
  while read -r flag value; do
    for skip in "$@"; do [ "$flag" = "$skip" ] && continue 2; done
    args+=("$flag")
    if [ -n "$value" ]; then args+=("$value"); fi
  done < <(grep -v '^#' configs/demo.args | grep -v '^\s*$')
  args+=(--mock-data --tokenizer-type NullTokenizer --vocab-size 50256)
}
