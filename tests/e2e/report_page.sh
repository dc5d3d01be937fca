#!/usr/bin/env bash
# moecore report: a demo run (mock data) with TensorBoard files, routing traces and an expert-collapse alarm; the
# report of its log and traces renders in headless Chromium (Debian's package, installed by scripts/setup.sh): the
# page's script finishes, the screenshot is not blank, and tests/e2e/check_report.py finds the log's values in the
# page (every lm loss, validation loss, learning rate and grad norm point, every tokens-per-expert column, the load
# ratios and the alarm), reading the log on its own. The TensorBoard folder's report draws the event files' lm loss
# (decoded by scripts/read_tfevents.py); the routing traces' heatmaps hold the records' expert counts. Bad sources
# give one-line errors.
set -u
source "$(dirname "$0")/lib/setup.sh" "$@"
browser=$(command -v chromium || command -v chromium-browser || true)
if [ -z "$browser" ]; then
  echo "FAIL: Chromium is not installed (scripts/setup.sh installs Debian's chromium)"
  exit 1
fi
demo_without_split demo
demo+=(--mock-data --tokenizer-type NullTokenizer --vocab-size 50256 --lr-warmup-iters 2 --log-interval 2
  --eval-interval 4 --eval-iters 1 --train-iters 8 --log-throughput --moe-per-layer-logging
  --moe-collapse-min-load-ratio 0.5 --moe-collapse-intervals 1)

# render HTML NAME: a screenshot and the DOM after the page's script ran.
render() {
  local flags=(--headless --no-sandbox --disable-gpu --hide-scrollbars --user-data-dir="$work/chromium")
  timeout 120 "$browser" "${flags[@]}" --window-size=1280,2400 --screenshot="$work/$2.png" "file://$1" \
    >"$work/$2.chromium.log" 2>&1 || fail "$2: chromium's screenshot failed: $(tail -2 "$work/$2.chromium.log")"
  timeout 120 "$browser" "${flags[@]}" --virtual-time-budget=5000 --dump-dom "file://$1" >"$work/$2.dom" \
    2>>"$work/$2.chromium.log" || fail "$2: chromium's --dump-dom failed"
  grep -q 'data-rendered="ok"' "$work/$2.dom" || fail "$2: the page did not render: $(grep -o 'id="error"[^<]*<[^<]*' "$work/$2.dom")"
}

if ! timeout 300 "$bin" train "${demo[@]}" --tensorboard-dir "$work/tb" --log-timers-to-tensorboard \
  --moe-routing-trace-path "$work/trace" >"$work/run.log" 2>&1; then
  fail "moecore train failed: $(tail -3 "$work/run.log")"
  exit 1
fi
grep -q '^WARNING: \[MoE\]' "$work/run.log" || fail "the run raised no expert-collapse alarm to show"

# The log and the routing traces: 4 MoE layers from the log, 4 from the traces.
"$bin" report "$work/run.log" "$work/trace" -o "$work/report.html" >"$work/report.out" 2>&1 ||
  fail "moecore report failed: $(cat "$work/report.out")"
if grep -qE 'https?://' <(grep -v 'http://www.w3.org/2000/svg' "$work/report.html"); then
  fail "the page names an address: $(grep -oE 'https?://[^"]*' "$work/report.html" | grep -v w3.org | head -2)"
fi
render "$work/report.html" report
/usr/bin/python3 "$src/tests/e2e/check_report.py" --dom "$work/report.dom" --screenshot "$work/report.png" \
  --log "$work/run.log" --expect-heatmaps 8 || fail "the report's page differs from the run's log"

# The routing traces' heatmaps: each column the records' expert counts summed over micro-batches.
/usr/bin/python3 - "$work/trace" "$work/report.dom" <<'PY' || fail "the trace heatmaps differ from the records"
import glob, html.parser, json, sys
trace_dir, dom = sys.argv[1], sys.argv[2]
want = {}
for path in glob.glob(trace_dir + "/router_trace_rank*.jsonl"):
    for line in open(path):
        r = json.loads(line)
        counts = want.setdefault(r["layer"], {}).setdefault(r["step"] + 1, {})
        for token in r["top_indices"]:
            for e in token:
                counts[e] = counts.get(e, 0) + 1
class Columns(html.parser.HTMLParser):
    def __init__(self):
        super().__init__(); self.heatmap = None; self.got = {}
    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if "data-heatmap-id" in a: self.heatmap = a["data-heatmap-id"]
        if "column" in (a.get("class") or "").split() and self.heatmap and self.heatmap.startswith("trace-layer-"):
            layer = int(self.heatmap[len("trace-layer-"):])
            self.got.setdefault(layer, {})[int(a["data-x"])] = [int(v) for v in a["data-values"].split(",")]
p = Columns(); p.feed(open(dom).read())
if sorted(p.got) != sorted(want):
    sys.exit(f"trace layers {sorted(p.got)} vs records {sorted(want)}")
for layer, columns in want.items():
    for it, counts in columns.items():
        got = p.got[layer].get(it)
        expect = [counts.get(e, 0) for e in range(len(got or []))]
        if got is None or got != expect or sum(got) != sum(counts.values()):
            sys.exit(f"layer {layer} iteration {it}: page {got}, records {counts}")
print(f"ok: {sum(len(c) for c in want.values())} trace columns equal the records")
PY

# The TensorBoard folder alone: its lm loss curve is the event files' (decoded independently).
"$bin" report "$work/tb" -o "$work/tb.html" >"$work/tb.out" 2>&1 || fail "report of the TensorBoard folder failed: $(cat "$work/tb.out")"
render "$work/tb.html" tb
/usr/bin/python3 - "$src/scripts/read_tfevents.py" "$work/tb" "$work/tb.dom" <<'PY' || fail "the TensorBoard report's lm loss differs from the event files"
import html.parser, json, subprocess, sys
decoder, tb, dom = sys.argv[1:4]
out = subprocess.run([sys.executable, decoder, tb, "--json"], capture_output=True, text=True, check=True).stdout
want = [(r["step"], r["value"]) for r in map(json.loads, out.replace("NaN", "null").splitlines()) if r.get("tag") == "lm loss"]
class Series(html.parser.HTMLParser):
    def __init__(self):
        super().__init__(); self.chart = None; self.points = None
    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if "data-chart-id" in a: self.chart = a["data-chart-id"]
        if self.chart == "loss" and a.get("data-series") == "lm loss":
            self.points = [tuple(float(v) for v in p.split(",")) for p in a["data-points"].split(";")]
p = Series(); p.feed(open(dom).read())
if not want or p.points is None or len(p.points) != len(want):
    sys.exit(f"lm loss: page {p.points}, event files {want}")
for (x, y), (step, value) in zip(p.points, want):
    if x != step or abs(y - value) > 1e-7 * abs(value):
        sys.exit(f"lm loss at {step}: page {y}, event file {value}")
print(f"ok: the TensorBoard report's {len(want)} lm loss points are the event files'")
PY

# One event file, and one rank's trace file, given on their own: the same curves / heatmaps as their folders give.
tb_file=$(find "$work/tb" -name 'events.out.tfevents.*' | head -1)
"$bin" report "$tb_file" -o "$work/tb_file.html" >/dev/null 2>&1 || fail "report of one event file failed"
"$bin" report "$work/trace/router_trace_rank0.jsonl" -o "$work/trace_file.html" >/dev/null 2>&1 ||
  fail "report of one trace file failed"
"$bin" report "$work/trace" -o "$work/trace_dir.html" >/dev/null 2>&1 || fail "report of the trace folder failed"
/usr/bin/python3 - "$work" <<'PY' || fail "a single file's report differs from its folder's"
import json, re, sys
work = sys.argv[1]
def data(name):
    page = open(f"{work}/{name}.html").read()
    return json.loads(re.search(r'id="moecore-report-data">(.*?)</script>', page, re.S).group(1))
for single, folder, key in (("tb_file", "tb", "charts"), ("trace_file", "trace_dir", "heatmaps")):
    if not data(single)[key] or data(single)[key] != data(folder)[key]:
        sys.exit(f"{single}: its {key} differ from {folder}'s")
print("ok: one event file and one trace file give their folders' curves and heatmaps")
PY

# Bad input: one line naming the problem, a non-zero exit.
expect_error "needs a SOURCE" "$bin" report -o "$work/x.html"
expect_error "needs -o REPORT.html" "$bin" report "$work/run.log"
expect_error "cannot read $work/missing.log" "$bin" report "$work/missing.log" -o "$work/x.html"
mkdir -p "$work/empty_dir"
expect_error "holds neither TensorBoard event files" "$bin" report "$work/empty_dir" -o "$work/x.html"
echo "no training here" >"$work/other.log"
expect_error "no training figures found in $work/other.log" "$bin" report "$work/other.log" -o "$work/x.html"
mkdir -p "$work/tb_corrupt"
cp "$tb_file" "$work/tb_corrupt/"
printf '\x01' | dd of="$work/tb_corrupt/$(basename "$tb_file")" bs=1 seek=40 conv=notrunc status=none
expect_error "is corrupt" "$bin" report "$work/tb_corrupt" -o "$work/x.html"
expect_error "unknown flag --bogus" "$bin" report "$work/run.log" -o "$work/x.html" --bogus
[ ! -e "$work/x.html" ] || fail "a failed report left $work/x.html"

[ $failures -eq 0 ] || { echo "$failures failure(s)"; exit 1; }
echo "e2e ok"
