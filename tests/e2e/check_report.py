#!/usr/bin/env python3
"""Checks a `moecore report` page against the training log it was made from.

    check_report.py --dom DOM.html --screenshot SHOT.png --log RUN_LOG.txt [--log MORE.txt] [--expect-heatmaps N]

DOM.html is headless Chromium's --dump-dom of the report, SHOT.png its --screenshot. The log is parsed here on its
own (regular expressions over the text), and the numbers the page carries in its data hooks must equal it: the lm
loss, validation loss, learning rate and grad norm series, and per MoE layer the tokens per expert and the min/max
load ratios; every "WARNING: [MoE]" line must be listed in the page's alarms. The screenshot must not be blank.
Prints one line per group of checks; on the first failure prints "FAIL: <reason>" and exits 1. Standard library only.
"""

import argparse
import collections
import html.parser
import math
import re
import struct
import sys
import zlib
from itertools import accumulate

REL_TOL = 1e-9


class CheckFailed(Exception):
    pass


def fail(reason):
    raise CheckFailed(reason)


# ---------------------------------------------------------------------------------------------------------------------
# The log

ITERATION_RE = re.compile(r"\biteration\s+(\d+)/\s*\d+\s*\|")
VALIDATION_RE = re.compile(r"\bvalidation loss at iteration (\d+) \|.*?\blm loss value:\s*([^\s|]+)")
MOE_RE = re.compile(r"\[MoE\] layer (\d+) tokens per expert: \[([^\]]*)\] \| min/max load ratio: ([^\s|]+) / ([^\s|]+)")
WARNING_RE = re.compile(r"WARNING: \[MoE\].*")
WARNING_LAYER_RE = re.compile(r"WARNING: \[MoE\] layer (\d+): experts? (.*?) (?:has|have) had ")


def field(line, name):
    """The value of ' | name: value |' in an iteration line, or None when the line has no such field."""
    m = re.search(r"\|\s*" + re.escape(name) + r":\s*([^\s|]+)\s*(?:\||$)", line)
    return None if m is None else m.group(1)


def log_float(text, what, lineno):
    try:
        return float(text)  # also "nan", "inf", "-INF" as the log prints non-finite values
    except ValueError:
        fail("log line %d: %s %r is not a number" % (lineno, what, text))


def parse_log(paths):
    log = {"lm loss": [], "learning rate": [], "grad norm": [], "validation": [], "layers": collections.OrderedDict(),
           "warnings": [], "iterations": 0}
    iteration = None
    lineno = 0
    for path in paths:
        try:
            text = open(path, encoding="utf-8", errors="replace").read()
        except OSError as e:
            fail("cannot read the log %s: %s" % (path, e))
        for line in text.splitlines():
            lineno += 1
            m = ITERATION_RE.search(line)
            if m and "validation loss" not in line:
                iteration = int(m.group(1))
                log["iterations"] += 1
                for name in ("lm loss", "learning rate", "grad norm"):
                    value = field(line, name)
                    if value is not None:
                        log[name].append((iteration, log_float(value, name, lineno)))
                continue
            m = VALIDATION_RE.search(line)
            if m:
                log["validation"].append((int(m.group(1)), log_float(m.group(2), "validation loss", lineno)))
                continue
            m = MOE_RE.search(line)
            if m:
                if iteration is None:
                    fail("log line %d: an [MoE] tokens-per-expert line before any iteration line" % lineno)
                tokens = [int(t) for t in m.group(2).split()]
                layer = log["layers"].setdefault(int(m.group(1)), {"x": [], "values": [], "min": [], "max": []})
                layer["x"].append(iteration)
                layer["values"].append(tokens)
                layer["min"].append((iteration, log_float(m.group(3), "min load ratio", lineno)))
                layer["max"].append((iteration, log_float(m.group(4), "max load ratio", lineno)))
                continue
            m = WARNING_RE.search(line)
            if m:
                text_ = m.group(0).strip()
                w = WARNING_LAYER_RE.match(text_)
                experts = [int(e) for e in re.findall(r"(\d+) \(load ratio", w.group(2))] if w else []
                log["warnings"].append({"text": text_, "iteration": iteration, "layer": int(w.group(1)) if w else None,
                                        "experts": experts})
    return log


# ---------------------------------------------------------------------------------------------------------------------
# The dumped DOM: a small element tree

VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "param", "source", "track", "wbr"}


class Node:
    __slots__ = ("tag", "attrs", "children", "parent")

    def __init__(self, tag, attrs, parent):
        self.tag, self.attrs, self.children, self.parent = tag, attrs, [], parent

    def classes(self):
        return (self.attrs.get("class") or "").split()

    def walk(self):
        stack = [self]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(reversed([c for c in node.children if isinstance(c, Node)]))

    def find_all(self, pred):
        return [n for n in self.walk() if n is not self and pred(n)]

    def text(self):
        parts = []
        stack = [self]
        while stack:
            node = stack.pop()
            if isinstance(node, str):
                parts.append(node)
            else:
                stack.extend(reversed(node.children))
        return "".join(parts)


class TreeBuilder(html.parser.HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.root = Node("#document", {}, None)
        self.cur = self.root

    def handle_starttag(self, tag, attrs):
        node = Node(tag, {k: ("" if v is None else v) for k, v in attrs}, self.cur)
        self.cur.children.append(node)
        if tag not in VOID:
            self.cur = node

    def handle_startendtag(self, tag, attrs):
        self.cur.children.append(Node(tag, {k: ("" if v is None else v) for k, v in attrs}, self.cur))

    def handle_endtag(self, tag):
        node = self.cur
        while node is not None and node.tag != tag:
            node = node.parent
        if node is not None and node.parent is not None:
            self.cur = node.parent

    def handle_data(self, data):
        self.cur.children.append(data)


def parse_dom(path):
    try:
        text = open(path, encoding="utf-8", errors="replace").read()
    except OSError as e:
        fail("cannot read the DOM dump %s: %s" % (path, e))
    builder = TreeBuilder()
    builder.feed(text)
    builder.close()
    return builder.root


def dom_number(token, where):
    if token in ("null", "undefined", "NaN"):
        return math.nan
    try:
        return float(token)  # JS String(number): "10.83297", "1e-7", "Infinity"
    except ValueError:
        fail("%s: %r is not a number" % (where, token))


def dom_points(node, where):
    text = node.attrs.get("data-points")
    if text is None:
        fail("%s has no data-points" % where)
    if text == "":
        return []
    points = []
    for i, pair in enumerate(text.split(";")):
        xy = pair.split(",")
        if len(xy) != 2:
            fail("%s: point %d %r is not x,y" % (where, i, pair))
        points.append((dom_number(xy[0], where), dom_number(xy[1], where)))
    return points


def same_value(expected, got):
    if math.isnan(expected):
        return math.isnan(got)
    if math.isinf(expected):
        return math.isnan(got) or got == expected  # JSON has no infinities: null stands in for them
    return math.isfinite(got) and math.isclose(expected, got, rel_tol=REL_TOL, abs_tol=0.0)


def compare_series(expected, got, where):
    """expected, got: lists of (x, y). Equal length, x exactly, y within REL_TOL (NaN matches NaN/null)."""
    for i, (e, g) in enumerate(zip(expected, got)):
        if g[0] != e[0]:
            fail("%s: point %d has x %s, the log has iteration %s" % (where, i, fmt(g[0]), e[0]))
        if not same_value(e[1], g[1]):
            fail("%s: at x %s the page has %r, the log has %r" % (where, e[0], g[1], e[1]))
    if len(got) != len(expected):
        extra = "extra point at x %s" % fmt(got[len(expected)][0]) if len(got) > len(expected) else \
            "missing the log's point at iteration %s" % expected[len(got)][0]
        fail("%s: %d points, the log has %d (%s)" % (where, len(got), len(expected), extra))


def fmt(v):
    return str(int(v)) if isinstance(v, float) and v.is_integer() else str(v)


def series_of(section, name, where):
    found = [n for n in section.find_all(lambda n: "series" in n.classes()) if n.attrs.get("data-series") == name]
    if len(found) > 1:
        fail("%s has %d series named %r" % (where, len(found), name))
    return found[0] if found else None


def check_chart_series(charts, chart_id, name, expected):
    section = charts.get(chart_id)
    where = 'chart "%s" series "%s"' % (chart_id, name)
    if section is None:
        if not expected:
            return 0
        fail('no chart with data-chart-id "%s"' % chart_id)
    node = series_of(section, name, 'chart "%s"' % chart_id)
    if node is None:
        if not expected:
            return 0
        fail("%s is missing (the log has %d values)" % (where, len(expected)))
    compare_series(expected, dom_points(node, where), where)
    return len(expected)


def check_heatmap(section, layer_id, layer):
    where = 'heatmap "%s"' % layer_id
    columns = section.find_all(lambda n: "column" in n.classes())
    if len(columns) != len(layer["x"]):
        fail("%s has %d columns, the log has %d logged iterations for the layer" % (where, len(columns), len(layer["x"])))
    for i, (col, x, values) in enumerate(zip(columns, layer["x"], layer["values"])):
        got_x = col.attrs.get("data-x")
        if got_x is None or dom_number(got_x, where) != x:
            fail("%s: column %d has data-x %r, the log has iteration %d" % (where, i, got_x, x))
        text = col.attrs.get("data-values")
        if text is None:
            fail("%s: column %d (iteration %d) has no data-values" % (where, i, x))
        got = text.split(",") if text else []
        if got != [str(v) for v in values]:
            fail("%s: iteration %d has tokens per expert [%s], the log has [%s]"
                 % (where, x, " ".join(got), " ".join(str(v) for v in values)))
    for name, key in (("min load ratio", "min"), ("max load ratio", "max")):
        node = series_of(section, name, where)
        if node is None:
            fail('%s has no "under" series "%s"' % (where, name))
        compare_series(layer[key], dom_points(node, where + ' series "%s"' % name), where + ' series "%s"' % name)


# ---------------------------------------------------------------------------------------------------------------------
# The screenshot: a PNG decoder for 8-bit RGB / RGBA, non-interlaced

def paeth_row(row, prev, bpp):
    out = bytearray(row)
    n = len(out)
    for i in range(n):
        a = out[i - bpp] if i >= bpp else 0
        b = prev[i]
        c = prev[i - bpp] if i >= bpp else 0
        p = a + b - c
        pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
        pred = a if pa <= pb and pa <= pc else (b if pb <= pc else c)
        out[i] = (out[i] + pred) & 255
    return out


def decode_png(path):
    try:
        data = open(path, "rb").read()
    except OSError as e:
        fail("cannot read the screenshot %s: %s" % (path, e))
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        fail("the screenshot %s is not a PNG file" % path)
    pos, idat, header = 8, [], None
    while pos + 8 <= len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        chunk = data[pos + 8:pos + 8 + length]
        pos += 12 + length
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", chunk)
        elif kind == b"IDAT":
            idat.append(chunk)
        elif kind == b"IEND":
            break
    if header is None:
        fail("the screenshot has no IHDR chunk")
    width, height, depth, color_type, _, _, interlace = header
    if depth != 8 or color_type not in (2, 6) or interlace != 0:
        fail("the screenshot is a PNG of bit depth %d, colour type %d, interlace %d: only 8-bit RGB (2) or RGBA (6), "
             "non-interlaced, is supported" % (depth, color_type, interlace))
    bpp = 3 if color_type == 2 else 4
    try:
        raw = zlib.decompress(b"".join(idat))
    except zlib.error as e:
        fail("the screenshot's image data does not inflate: %s" % e)
    stride = width * bpp
    if len(raw) != (stride + 1) * height:
        fail("the screenshot's image data has %d bytes, %dx%d needs %d" % (len(raw), width, height, (stride + 1) * height))
    mask = (255).__and__
    pixels = bytearray(stride * height)
    prev = bytes(stride)
    for y in range(height):
        start = y * (stride + 1)
        ftype, row = raw[start], raw[start + 1:start + 1 + stride]
        if ftype == 0:
            cur = row
        elif ftype == 1:  # Sub: running sums per channel
            cur = bytearray(stride)
            for ch in range(bpp):
                cur[ch::bpp] = bytes(map(mask, accumulate(row[ch::bpp])))
        elif ftype == 2:  # Up
            cur = bytes(map(mask, map(int.__add__, row, prev)))
        elif ftype == 3:  # Average
            cur = bytearray(row)
            for i in range(stride):
                cur[i] = (cur[i] + (((cur[i - bpp] if i >= bpp else 0) + prev[i]) >> 1)) & 255
        elif ftype == 4:
            cur = paeth_row(row, prev, bpp)
        else:
            fail("the screenshot's row %d has the unknown PNG filter type %d" % (y, ftype))
        pixels[y * stride:(y + 1) * stride] = cur
        prev = cur
    return width, height, bpp, pixels


def check_screenshot(path):
    width, height, bpp, pixels = decode_png(path)
    n = width * height
    if n == 0:
        fail("the screenshot is empty (%dx%d)" % (width, height))
    if bpp == 3:  # widen to 4 bytes per pixel so that each pixel is one 32-bit word
        rgba = bytearray(n * 4)
        for ch in range(3):
            rgba[ch::4] = pixels[ch::3]
        pixels = rgba
    counts = collections.Counter(memoryview(pixels).cast("I"))
    common, common_n = counts.most_common(1)[0]
    differing = 1.0 - common_n / n
    if differing < 0.03:
        fail("the screenshot looks blank: only %.2f%% of its pixels differ from the most common colour (needs 3%%)"
             % (100 * differing))
    if len(counts) < 50:
        fail("the screenshot looks blank: only %d distinct colours (needs 50)" % len(counts))
    return "%dx%d, %.1f%% off the background, %d colours" % (width, height, 100 * differing, len(counts))


# ---------------------------------------------------------------------------------------------------------------------

def norm_space(s):
    return " ".join(s.split())


def run(args):
    log = parse_log(args.log)
    if log["iterations"] == 0:
        fail("the log has no iteration lines")
    print("log: %d iteration lines, %d validation lines, %d MoE layers, %d alarm lines"
          % (log["iterations"], len(log["validation"]), len(log["layers"]), len(log["warnings"])))

    root = parse_dom(args.dom)
    body = next((n for n in root.walk() if n.tag == "body"), None)
    if body is None:
        fail("the DOM dump has no <body>")
    state = body.attrs.get("data-rendered")
    if state != "ok":
        err = next((norm_space(n.text()) for n in body.walk() if n.attrs.get("id") == "error"), "")
        fail('the page did not render: body data-rendered is %r%s' % (state, (": " + err[:300]) if err else ""))
    print("page: rendered ok")

    charts, heatmaps = {}, {}
    for node in body.walk():
        if node.tag == "section" and "chart" in node.classes() and "data-chart-id" in node.attrs:
            if node.attrs["data-chart-id"] in charts:
                fail('two charts have data-chart-id "%s"' % node.attrs["data-chart-id"])
            charts[node.attrs["data-chart-id"]] = node
        if node.tag == "section" and "heatmap" in node.classes() and "data-heatmap-id" in node.attrs:
            if node.attrs["data-heatmap-id"] in heatmaps:
                fail('two heatmaps have data-heatmap-id "%s"' % node.attrs["data-heatmap-id"])
            heatmaps[node.attrs["data-heatmap-id"]] = node

    tables = [n for n in body.walk() if n.tag == "table" and "summary" in n.classes()]
    if len(tables) != 1:
        fail("the page has %d summary tables (table.summary), expected 1" % len(tables))
    rows = [r for r in tables[0].walk() if r.tag == "tr"]
    if not rows:
        fail("the summary table has no rows")
    for r in rows:
        cells = [c.tag for c in r.children if isinstance(c, Node)]
        if cells != ["th", "td"]:
            fail("a summary row has cells %s, expected <th>label</th><td>value</td>" % cells)
    print("summary: %d rows" % len(rows))

    counted = [check_chart_series(charts, "loss", "lm loss", log["lm loss"]),
               check_chart_series(charts, "loss", "lm loss validation", log["validation"]),
               check_chart_series(charts, "learning-rate", "learning rate", log["learning rate"]),
               check_chart_series(charts, "grad-norm", "grad norm", log["grad norm"])]
    if not log["lm loss"]:
        fail("the log has no lm loss values to check")
    print("charts: lm loss %d, validation %d, learning rate %d, grad norm %d points match the log (%d charts)"
          % (tuple(counted) + (len(charts),)))

    if args.expect_heatmaps is not None and len(heatmaps) != args.expect_heatmaps:
        fail("the page has %d heatmaps, expected %d" % (len(heatmaps), args.expect_heatmaps))
    for number, layer in log["layers"].items():
        layer_id = "moe-layer-%d" % number
        if layer_id not in heatmaps:
            fail('no heatmap with data-heatmap-id "%s" (the log has MoE layer %d)' % (layer_id, number))
        check_heatmap(heatmaps[layer_id], layer_id, layer)
    print("heatmaps: %d layers, %d columns match the log's tokens per expert and load ratios"
          % (len(log["layers"]), sum(len(l["x"]) for l in log["layers"].values())))

    sections = [n for n in body.walk() if n.tag == "section" and "alarms" in n.classes()]
    items = [norm_space(a.text()) for s in sections for a in s.find_all(lambda n: "alarm" in n.classes())]
    for w in log["warnings"]:
        if not any(norm_space(w["text"]) in item for item in items):
            fail("the alarms section does not list the log's alarm: %s" % w["text"])
        if w["layer"] is None:
            continue
        section = heatmaps.get("moe-layer-%d" % w["layer"])
        if section is None:
            fail("no heatmap for the alarm's MoE layer %d: %s" % (w["layer"], w["text"]))
        marks = {(a.attrs.get("data-iteration"), a.attrs.get("data-expert"))
                 for a in section.find_all(lambda n: "alarm" in n.classes())}
        for expert in w["experts"]:
            if (str(w["iteration"]), str(expert)) not in marks:
                fail('heatmap "moe-layer-%d" has no alarm mark for expert %d at iteration %s'
                     % (w["layer"], expert, w["iteration"]))
    print("alarms: %d of the log's alarm lines listed and marked (%d alarm items on the page)"
          % (len(log["warnings"]), len(items)))

    shot = check_screenshot(args.screenshot)
    print("screenshot: not blank (%s)" % shot)
    return "%d charts, %d heatmaps, %d alarms" % (len(charts), len(heatmaps), len(log["warnings"]))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dom", required=True, help="the report page as headless Chromium's --dump-dom wrote it")
    parser.add_argument("--screenshot", required=True, help="Chromium's --screenshot of the page (PNG)")
    parser.add_argument("--log", required=True, action="append", help="the training log (repeat for several, in order)")
    parser.add_argument("--expect-heatmaps", type=int, help="the page must have exactly this many heatmaps")
    args = parser.parse_args()
    try:
        what = run(args)
    except CheckFailed as e:
        print("FAIL: %s" % e)
        return 1
    print("report check: ok (%s)" % what)
    return 0


if __name__ == "__main__":
    sys.exit(main())
