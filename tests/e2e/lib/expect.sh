# Sourced by the end-to-end scripts: checks that a command fails the way a user should see it fail. The caller sets
# $work (a scratch folder) and failures=0; each check prints "ok: PATTERN" or "FAIL: ..." and counts failures.

fail() { echo "FAIL: $*"; failures=$((failures + 1)); }

# The command fails with an exit code in [1, 124) (not a signal, not a timeout) and exactly one line on stderr, which
# holds PATTERN (a fixed string). Its output stays in $work/expect.stdout and $work/expect.stderr.
check_one_line_error() {  # check_one_line_error PATTERN COMMAND...
  local pattern=$1
  shift
  "$@" >"$work/expect.stdout" 2>"$work/expect.stderr"
  local rc=$?
  local err
  err=$(cat "$work/expect.stderr")
  if [ $rc -eq 0 ] || [ $rc -ge 124 ]; then fail "exit code $rc for: $* ($err)"; return 1; fi
  if ! grep -qF -- "$pattern" <<<"$err"; then fail "expected '$pattern' in: $err"; return 1; fi
  if [ "$(grep -c . <<<"$err")" -ne 1 ]; then fail "expected one line, got: $err"; return 1; fi
}

expect_error() {  # expect_error PATTERN COMMAND...
  check_one_line_error "$@" && echo "ok: $1"
}

# As expect_error, and before training: no model built ("number of parameters"), no "training ..." or iteration line.
expect_early_error() {  # expect_early_error PATTERN COMMAND...
  check_one_line_error "$@" || return 1
  if grep -qE 'number of parameters|training \.\.\.|iteration +[0-9]' "$work/expect.stdout"; then
    fail "'$1' came after the run started: $(grep -E 'parameters|training|iteration' "$work/expect.stdout" | head -2)"
    return 1
  fi
  echo "ok: $1"
}
