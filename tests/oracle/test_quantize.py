"""`moecore quantize` against quant_reference.py, an independent numpy model of TransformerEngine's numerics.

Writes random and adversarial fp32 matrices (zeros, fp32 subnormals, huge values, values at rounding boundaries,
NaN / +-Inf, a block of zeros beside a block of large values), runs the command for every recipe x format x role x
usage, and compares codes and scales bit for bit and decoded values exactly (NaN where NaN); NVFP4's stochastic
rounding is compared through the same counter-based random bits reimplemented in numpy. Bad inputs must fail with
one "error: ..." line and a non-zero exit.

Usage: /usr/bin/python3 test_quantize.py --moecore build/moecore [-v]
"""
import argparse
import os
import subprocess
import sys
import tempfile
import unittest

import numpy as np

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import quant_reference as ref  # noqa: E402
import st  # noqa: E402

MOECORE = None
F32 = np.float32


def midpoints(fmt):
    """Every midpoint between neighbouring positive codes, and the float32 neighbours of each midpoint."""
    table = ref.FORMATS[fmt][0]
    mids = ((table[:-1] + table[1:]) / 2).astype(np.float32)
    return np.concatenate([mids, np.nextafter(mids, F32(0)), np.nextafter(mids, F32(np.inf))])


def fill(shape, values, rng):
    """values repeated / cut to shape, with random signs."""
    flat = np.resize(np.asarray(values, dtype=np.float32), int(np.prod(shape)))
    signs = np.where(rng.random(flat.size) < 0.5, F32(-1), F32(1))
    return (flat * signs).astype(np.float32).reshape(shape)


def make_inputs(rng):
    """Matrices whose both dimensions are multiples of 32 (every recipe takes them)."""
    t = {}
    rows_scale = np.exp2(rng.integers(-20, 20, size=(64, 1))).astype(np.float32)
    t["random"] = (rng.standard_normal((64, 256)).astype(np.float32) * rows_scale).astype(np.float32)
    t["zeros"] = np.zeros((32, 64), dtype=np.float32)
    t["denormals"] = fill((32, 64), rng.uniform(1e-45, 1.1e-38, 4096).astype(np.float32), rng)
    t["huge"] = fill((32, 64), np.concatenate([[np.finfo(np.float32).max, 3e38], rng.uniform(1e30, 3e38, 500)]), rng)
    # Rounding boundaries: 448 in every 32-run and 16-run sets per-tensor and block scales to 1 (e4m3) or a power of
    # two; the rest are midpoints between codes and their float32 neighbours.
    b = fill((32, 64), np.concatenate([midpoints("e4m3"), midpoints("e5m2") / 128, midpoints("e2m1") * 8]), rng)
    b[:, ::16] = 448.0
    t["boundaries"] = b
    b6 = fill((32, 64), midpoints("e2m1"), rng)  # NVFP4: global amax 6 -> S_enc 448; block amax 6 -> scale 448
    b6[:, ::16] = 6.0
    t["e2m1_boundaries"] = b6
    m = np.zeros((32, 256), dtype=np.float32)
    m[:, 32:64] = rng.uniform(1e3, 5e4, (32, 32))  # zeros (cols 0-31) beside large values
    m[:, 128:256] = rng.uniform(-1e-3, 1e-3, (32, 128))  # a small 128-block after a zero/large one
    m[1, :] = 0.0
    m[2, 5] = 1e-42
    t["mixed_blocks"] = m
    s = rng.standard_normal((32, 64)).astype(np.float32)
    s[0, 0], s[3, 17], s[5, 40], s[7, 63] = np.nan, np.inf, -np.inf, -0.0
    s[9, :] = -0.0
    t["specials"] = s
    nan_only = rng.standard_normal((32, 32)).astype(np.float32)
    nan_only[4, 7] = np.nan
    t["nan"] = nan_only
    return t


def make_odd_inputs(rng):
    """Shapes no block divides (per-tensor and blockwise scaling take them)."""
    return {"odd_a": rng.standard_normal((3, 130)).astype(np.float32) * F32(100),
            "odd_b": (rng.standard_normal((130, 5)) * 1e-3).astype(np.float32),
            "single": np.array([[2.5]], dtype=np.float32)}


def same_floats(a, b):
    """Bitwise equal, except that any NaN matches any NaN."""
    a = np.asarray(a, dtype=np.float32)
    b = np.asarray(b, dtype=np.float32)
    if a.shape != b.shape:
        return False
    nan_a, nan_b = np.isnan(a), np.isnan(b)
    return bool(np.array_equal(nan_a, nan_b) and np.array_equal(a.view(np.uint32)[~nan_a], b.view(np.uint32)[~nan_b]))


def run(args):
    return subprocess.run([MOECORE, "quantize", *args], capture_output=True, text=True)


class QuantizeOracle(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        rng = np.random.default_rng(20240611)
        cls.inputs = make_inputs(rng)
        cls.odd = make_odd_inputs(rng)
        cls.path = os.path.join(cls.tmp.name, "in.safetensors")
        cls.odd_path = os.path.join(cls.tmp.name, "odd.safetensors")
        st.save(cls.path, cls.inputs)
        st.save(cls.odd_path, cls.odd)

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def check(self, path, inputs, recipe, fmt, role, usage, seed=None):
        out = os.path.join(self.tmp.name, f"out_{recipe}_{fmt}_{role}_{usage}.safetensors")
        args = ["--recipe", recipe, "--format", fmt, "--as", role, "--usage", usage, "--input", path, "--output", out]
        if seed is not None:
            args += ["--seed", str(seed)]
        proc = run(args)
        self.assertEqual(proc.returncode, 0, proc.stderr)
        got, metadata = st.load(out)
        self.assertEqual(metadata["recipe"], recipe)
        for name, x in inputs.items():
            label = f"{name} {recipe} {fmt} {role} {usage}"
            codes, scales, decoded, g_amax = ref.quantize(x, recipe, "e2m1" if recipe == "nvfp4" else fmt, role,
                                                          usage, 1234 if seed is None else seed)
            np.testing.assert_array_equal(got[name + ".codes"], codes, err_msg=label)
            self.assertTrue(same_floats(got[name + ".scales"], scales), label)
            self.assertTrue(same_floats(got[name + ".decoded"], decoded), label)
            if recipe == "nvfp4":
                self.assertTrue(same_floats(got[name + ".global_amax"], [g_amax]), label)
            self.assertIn(f"{name} [{x.shape[0]}, {x.shape[1]}]: {recipe} ", proc.stdout)
        return got

    def test_every_recipe_format_role_and_usage(self):
        for recipe in ["tensorwise", "blockwise", "mxfp8", "nvfp4"]:
            for fmt in ["e4m3", "e5m2"]:
                for role in ["activation", "weight", "gradient"]:
                    for usage in ["rowwise", "columnwise"]:
                        with self.subTest(recipe=recipe, fmt=fmt, role=role, usage=usage):
                            self.check(self.path, self.inputs, recipe, fmt, role, usage)

    def test_shapes_no_block_divides(self):
        for recipe in ["tensorwise", "blockwise"]:
            for role in ["activation", "weight"]:
                for usage in ["rowwise", "columnwise"]:
                    with self.subTest(recipe=recipe, role=role, usage=usage):
                        self.check(self.odd_path, self.odd, recipe, "e4m3", role, usage)

    def test_stochastic_rounding_follows_the_seed(self):
        a = self.check(self.path, self.inputs, "nvfp4", "e4m3", "gradient", "rowwise", seed=7)
        b = self.check(self.path, self.inputs, "nvfp4", "e4m3", "gradient", "rowwise", seed=8)
        self.assertFalse(np.array_equal(a["random.codes"], b["random.codes"]))
        # Statistically unbiased: over many seeds the mean decoded value of an element approaches the input.
        x = {"x": np.full((16, 16), 1.2, dtype=np.float32) * np.linspace(0.5, 5.5, 16, dtype=np.float32)}
        x["x"][0, 0] = 6.0  # global amax 6 and block amaxes near 6: the scaled values are the inputs themselves
        path = os.path.join(self.tmp.name, "sr.safetensors")
        st.save(path, x)
        total = np.zeros((16, 16))
        seeds = 200
        for seed in range(seeds):
            out = os.path.join(self.tmp.name, "sr_out.safetensors")
            proc = run(["--recipe", "nvfp4", "--format", "e4m3", "--as", "gradient", "--seed", str(seed),
                        "--input", path, "--output", out])
            self.assertEqual(proc.returncode, 0, proc.stderr)
            total += st.load(out)[0]["x.decoded"]
        nearest = ref.quantize(x["x"], "nvfp4", "e2m1", "activation")[2]  # round-to-nearest decode
        mean_error = np.abs(total / seeds - x["x"]).mean()
        self.assertLess(mean_error, 0.5 * np.abs(nearest - x["x"]).mean())

    def test_bad_inputs_fail_with_one_line(self):
        bad = os.path.join(self.tmp.name, "bad.safetensors")
        out = os.path.join(self.tmp.name, "bad_out.safetensors")
        base = ["--format", "e4m3", "--as", "weight", "--output", out]
        cases = {
            "non-2-D": ({"v": np.zeros(4, dtype=np.float32)}, ["--recipe", "tensorwise"], "2-D"),
            "non-fp32": ({"d": np.zeros((4, 4), dtype=np.float64)}, ["--recipe", "tensorwise"], "F64"),
            "mxfp8 shape": ({"m": np.zeros((33, 64), dtype=np.float32)}, ["--recipe", "mxfp8"], "[33, 64]"),
            "nvfp4 shape": ({"m": np.zeros((32, 40), dtype=np.float32)}, ["--recipe", "nvfp4"], "[32, 40]"),
        }
        for label, (tensors, args, needle) in cases.items():
            with self.subTest(label):
                st.save(bad, tensors)
                proc = run(args + base + ["--input", bad])
                self.assertNotEqual(proc.returncode, 0)
                self.assertTrue(proc.stderr.startswith("error: "), proc.stderr)
                self.assertIn(needle, proc.stderr)
                self.assertEqual(proc.stderr.count("\n"), 1, proc.stderr)
        st.save(bad, {"w": np.zeros((32, 32), dtype=np.float32)})
        flag_cases = {
            "unknown format": ["--recipe", "mxfp8", "--format", "e3m4", "--as", "weight"],
            "unknown role": ["--recipe", "mxfp8", "--format", "e4m3", "--as", "bias"],
            "unknown recipe": ["--recipe", "fp16", "--format", "e4m3", "--as", "weight"],
            "unknown usage": ["--recipe", "mxfp8", "--format", "e4m3", "--as", "weight", "--usage", "diagonal"],
            "bad seed": ["--recipe", "nvfp4", "--format", "e4m3", "--as", "gradient", "--seed", "-3"],
            "unknown flag": ["--recipe", "mxfp8", "--format", "e4m3", "--as", "weight", "--blocks", "32"],
        }
        for label, args in flag_cases.items():
            with self.subTest(label):
                proc = run(args + ["--input", bad, "--output", out])
                self.assertNotEqual(proc.returncode, 0)
                self.assertRegex(proc.stderr, r"^error: [^\n]+\n$")
        with self.subTest("missing file"):
            proc = run(["--recipe", "mxfp8", "--format", "e4m3", "--as", "weight", "--input",
                        os.path.join(self.tmp.name, "absent.safetensors"), "--output", out])
            self.assertNotEqual(proc.returncode, 0)
            self.assertRegex(proc.stderr, r"^error: [^\n]*absent[^\n]*\n$")
        self.assertFalse(os.path.exists(out))

    def test_output_over_the_input_is_refused(self):
        src = os.path.join(self.tmp.name, "keep.safetensors")
        st.save(src, {"w": np.ones((32, 32), dtype=np.float32)})
        with open(src, "rb") as f:
            before = f.read()
        link = os.path.join(self.tmp.name, "keep_link.safetensors")
        if not os.path.lexists(link):
            os.symlink(src, link)
        same = {"same path": src, "another spelling": os.path.join(self.tmp.name, ".", "keep.safetensors"),
                "a symlink": link}
        for label, output in same.items():
            with self.subTest(label):
                proc = run(["--recipe", "mxfp8", "--format", "e4m3", "--as", "weight", "--input", src,
                            "--output", output])
                self.assertNotEqual(proc.returncode, 0)
                self.assertRegex(proc.stderr, r"^error: --output [^\n]* is the --input file [^\n]*\n$")
                with open(src, "rb") as f:
                    self.assertEqual(f.read(), before)

    def test_statistics_count_nonfinite_inputs(self):
        path = os.path.join(self.tmp.name, "nonfinite.safetensors")
        x = np.ones((32, 32), dtype=np.float32)
        x[4, 7] = np.nan
        x[9, 1] = np.inf
        st.save(path, {"x": x})
        out = os.path.join(self.tmp.name, "nonfinite_out.safetensors")
        proc = run(["--recipe", "tensorwise", "--format", "e4m3", "--as", "weight", "--input", path, "--output", out])
        self.assertEqual(proc.returncode, 0, proc.stderr)
        self.assertIn("non-finite inputs 2 (1 decoded finite)", proc.stdout)  # Inf saturates to 448, NaN stays NaN
        del x
        nan_only = {"y": np.ones((32, 32), dtype=np.float32)}
        nan_only["y"][4, 7] = np.nan
        st.save(path, nan_only)
        proc = run(["--recipe", "nvfp4", "--format", "e4m3", "--as", "activation", "--input", path, "--output", out])
        self.assertEqual(proc.returncode, 0, proc.stderr)
        self.assertRegex(proc.stdout, r"non-finite inputs 1\n")  # E2M1 has no NaN: the block's scale carries it
        decoded = st.load(out)[0]["y.decoded"]
        self.assertTrue(np.isnan(decoded[4, 7]))
        self.assertEqual(int(np.isnan(decoded).sum()), 16)  # the 1 x 16 block holding the NaN


class ReferenceSelfChecks(unittest.TestCase):
    """The numpy model's own hand-checked values."""

    def test_codecs(self):
        self.assertEqual(ref.decode("e4m3", [0x7E])[0], 448)
        self.assertEqual(ref.decode("e5m2", [0x7B])[0], 57344)
        np.testing.assert_array_equal(ref.decode("e2m1", range(8)), [0, 0.5, 1, 1.5, 2, 3, 4, 6])
        np.testing.assert_array_equal(ref.encode("e2m1", F32([0.25, 0.75, 1.25, 2.5, 5, 7, np.nan, -np.inf])),
                                      [0, 2, 2, 4, 6, 7, 7, 15])
        np.testing.assert_array_equal(ref.encode("e4m3", F32([464, 1e9, np.inf, -0.0])), [0x7E, 0x7E, 0x7E, 0x80])
        np.testing.assert_array_equal(ref.e8m0_round_up(F32([1, 1.5, 0, 2.0 ** -130, np.inf])), [127, 128, 0, 0, 254])

    def test_philox_matches_the_published_known_answer(self):
        # Random123's kat_vectors: philox4x32_10 with counter 0 and key 0 -> 6627e8d5 e169c58d bc57ac4c 9b00dbd8.
        self.assertEqual([hex(w) for w in ref.philox(0, 0, [0])[0]],
                         ["0x6627e8d5", "0xe169c58d", "0xbc57ac4c", "0x9b00dbd8"])

    def test_hadamard_inverse(self):
        x = np.random.default_rng(1).standard_normal((4, 32)).astype(np.float32)
        np.testing.assert_allclose(ref.inverse_rht_rows(ref.rht_rows(x)), x, rtol=1e-5, atol=1e-6)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--moecore", required=True)
    known, rest = parser.parse_known_args()
    MOECORE = os.path.abspath(known.moecore)
    unittest.main(argv=[sys.argv[0]] + rest)
