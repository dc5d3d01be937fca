# Sourced by the end-to-end scripts that compare training runs. The caller sets $bin, $work and `model` (the model's
# flags) and sources setup.sh first.
# run NAME ARGS...: `moecore train "${model[@]}" ARGS...`, its log in $work/NAME.log and its per-iteration
# "lm loss ... grad norm" in $work/NAME.losses; a run that fails is a failure.
run() {
  local name=$1
  shift
  if ! timeout 300 "$bin" train "${model[@]}" "$@" >"$work/$name.log" 2>&1; then
    fail "$name did not train: $(tail -2 "$work/$name.log")"
  fi
  grep -E '^ .*iteration +[0-9]+/' "$work/$name.log" | sed -E 's/.*(lm loss: [^|]*).*(grad norm: [^|]*).*/\1 \2/' \
    >"$work/$name.losses"
}
# same_file WHAT A B: "ok: WHAT" when files A and B hold the same bytes, else a failure showing both side by side.
same_file() {
  if cmp -s "$2" "$3"; then echo "ok: $1"; else fail "$1: $2 and $3 differ: $(paste "$2" "$3" | head -3)"; fi
}
