# Shared by tests/e2e/plan_memory_measured.sh and bench/run_plan_time.sh (sourced): a config file's flags, the subset `moecore plan` takes, and a
# training run on NP ranks of one core each (what `moecore plan --gpu cpu` models: one rank per core).
# Needs $src, $bin and $mpirun.

# A config file's flags ("#" lines are comments), one word per line.
config_flags() {
  grep -v '^[[:space:]]*#' "$src/configs/$1.args" | tr -s ' \n' '\n\n' | grep -v '^$'
}

# config_flags CONFIG without the given flags (each followed by one value) and without --mock-data.
config_flags_without() {
  local config=$1 skip=0 word
  shift
  local -A drop=()
  for word in "$@"; do drop[$word]=1; done
  while read -r word; do
    if [ $skip = 1 ]; then skip=0; continue; fi
    if [ -n "${drop[$word]:-}" ]; then skip=1; continue; fi
    [ "$word" = --mock-data ] && continue
    echo "$word"
  done < <(config_flags "$config")
}

# The flags `plan` describes the same run with: the config's model, batch and tokenizer flags, without the
# training-loop flags (iterations, learning rate, logging, evaluation, the data source).
plan_flags() {
  config_flags_without "$1" --train-iters --lr --lr-warmup-iters --lr-decay-style --log-interval --eval-interval \
    --eval-iters --min-lr --weight-decay --adam-beta2 --clip-grad --seed --split
}

# train_on NP LOG FLAGS...: `moecore train FLAGS` on NP single-core ranks; returns its status.
train_on() {
  local np=$1 log=$2
  shift 2
  local -a launch=(env OMP_NUM_THREADS=1)
  [ "$np" -gt 1 ] && launch+=("$mpirun" -q --allow-run-as-root --oversubscribe -np "$np")
  timeout 300 "${launch[@]}" "$bin" train "$@" >"$log" 2>&1
}
