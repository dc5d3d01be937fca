"""An independent numpy model of TransformerEngine's low-precision number formats and scaling recipes.

Written from TE's formulas (transformer_engine/common/recipe/recipe_common.cuh compute_scale_from_amax,
cast/mxfp8/quantize_mxfp8.cuh + util/ptx_arch_spec.cuh float_to_e8m0, cast/nvfp4/core_nvfp4.cuh and
quantize_transpose_nvfp4.cuh, nvfp4/dequantize_nvfp4.cuh, util/ptx.cuh stochastic_round_fp4_e2m1,
pytorch/tensor/nvfp4_tensor.py get_rht_matrix) and the format definitions, not from moecore's C++:

* codecs by table: every finite value of a format is listed from its bit fields; a value is encoded as the nearest
  table entry (ties to the even code, i.e. the even mantissa), after clamping to the largest finite magnitude
  (satfinite: finite overflow and +-Inf become +-max); NaN -> 0x7F (E4M3, E5M2) or +6 (E2M1); the sign of zero
  and of underflows is kept.
* every product and quotient in float32 numpy scalars/arrays (IEEE round to nearest), as the CUDA kernels.
* the counter-based random bits: Philox4x32-10 (Salmon et al. 2011) keyed as moecore's tensor/rng.cpp
  (counter words = counter lo/hi, stream key lo/hi; key words = seed lo/hi), byte i % 16 of counter i // 16.
"""
import numpy as np

F32 = np.float32
FLT_MAX = np.finfo(np.float32).max


# ---------------------------------------------------------------- codecs

def _table(exp_bits, man_bits, bias, max_code):
    """Values of the non-negative codes 0..max_code of a sign/exponent/mantissa format (float64, exact)."""
    values = []
    for code in range(max_code + 1):
        field, mantissa = code >> man_bits, code & ((1 << man_bits) - 1)
        if field == 0:
            values.append(mantissa * 2.0 ** (1 - bias - man_bits))
        else:
            values.append((1 + mantissa / 2.0 ** man_bits) * 2.0 ** (field - bias))
    return np.array(values, dtype=np.float64)


FORMATS = {
    # name: (positive finite values by code, sign bit, NaN code)
    "e4m3": (_table(4, 3, 7, 0x7E), 0x80, 0x7F),
    "e5m2": (_table(5, 2, 15, 0x7B), 0x80, 0x7F),
    "e2m1": (_table(2, 1, 1, 0x7), 0x8, 0x7),
}
FORMAT_MAX = {name: table[-1] for name, (table, _, _) in FORMATS.items()}


def encode(fmt, x):
    """float32 array -> uint8 codes: nearest value, ties to the even code, satfinite."""
    table, sign_bit, nan_code = FORMATS[fmt]
    x = np.asarray(x, dtype=np.float32)
    a = np.minimum(np.abs(x.astype(np.float64)), table[-1])
    nan = np.isnan(x)
    a = np.where(nan, 0.0, a)
    hi = np.clip(np.searchsorted(table, a, side="left"), 0, len(table) - 1)
    lo = np.clip(hi - 1, 0, len(table) - 1)
    d_lo = a - table[lo]
    d_hi = table[hi] - a
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    code = np.where(pick_hi, hi, lo).astype(np.uint8)
    code = np.where(np.signbit(x), code | sign_bit, code).astype(np.uint8)
    return np.where(nan, nan_code, code).astype(np.uint8)


def decode(fmt, codes):
    """uint8 codes -> float32 values (E4M3 0x7F/0xFF and E5M2 0x7D-0x7F/0xFD-0xFF NaN, E5M2 0x7C/0xFC Inf)."""
    table, sign_bit, _ = FORMATS[fmt]
    codes = np.asarray(codes, dtype=np.uint8)
    mag = (codes & (sign_bit - 1)).astype(np.int64)
    full = np.concatenate([table, np.full(sign_bit - len(table), np.nan)])
    if fmt == "e5m2":
        full[0x7C] = np.inf
    value = full[mag]
    return np.where(codes & sign_bit, -value, value).astype(np.float32)


def e8m0_round_up(value):
    """Positive float32 -> E8M0 code of the smallest power of two >= value, clamped to [2^-127, 2^127]."""
    value = np.asarray(value, dtype=np.float32)
    mantissa, exponent = np.frexp(value.astype(np.float64))  # value = m 2^e, m in [0.5, 1)
    power = np.where(mantissa == 0.5, exponent - 1, exponent)  # ceil(log2(value))
    code = np.clip(power + 127, 0, 254)
    code = np.where(value == 0, 0, code)
    code = np.where(np.isinf(value), 254, code)
    return np.where(np.isnan(value), 255, code).astype(np.uint8)


def e8m0_value(codes):
    return np.ldexp(np.float32(1), np.asarray(codes, dtype=np.int64) - 127).astype(np.float32)


# ---------------------------------------------------------------- random bits

M0, M1, W0, W1 = 0xD2511F53, 0xCD9E8D57, 0x9E3779B9, 0xBB67AE85
MASK = 0xFFFFFFFF


def stream_key(name):
    h = 14695981039346656037
    for byte in name.encode():
        h = ((h ^ byte) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    return h


def philox(seed, key, counters):
    """Philox4x32-10 of each counter: [n, 4] uint32 words."""
    counters = np.asarray(counters, dtype=np.uint64)
    c = [counters & MASK, counters >> np.uint64(32),
         np.full_like(counters, key & MASK), np.full_like(counters, key >> 32)]
    k0, k1 = seed & MASK, (seed >> 32) & MASK
    for _ in range(10):
        p0 = np.uint64(M0) * c[0]
        p1 = np.uint64(M1) * c[2]
        c = [(p1 >> np.uint64(32)) ^ c[1] ^ np.uint64(k0), p1 & np.uint64(MASK),
             (p0 >> np.uint64(32)) ^ c[3] ^ np.uint64(k1), p0 & np.uint64(MASK)]
        k0, k1 = (k0 + W0) & MASK, (k1 + W1) & MASK
    return np.stack(c, axis=-1).astype(np.uint32)


def random_bytes(seed, key, n):
    """Byte i of the stream for i < n: byte i % 16 (little-endian within words) of counter i // 16."""
    words = philox(seed, key, np.arange((n + 15) // 16)).astype("<u4")
    return words.view(np.uint8).reshape(-1)[:n]


ROWWISE_KEY = stream_key("quant.nvfp4.stochastic_rounding.rowwise")
COLUMNWISE_KEY = stream_key("quant.nvfp4.stochastic_rounding.columnwise")


def e2m1_stochastic(x, rbits):
    """TE's software cvt.rs onto the E2M1 grid: t = |x| + (rbits / 256) step (the product is exact, so the fma is
    one float32 rounding of the sum), floored to the grid step at t, clamped to 6, sign of x (NaN -> +6)."""
    x = np.asarray(x, dtype=np.float32)
    a = np.abs(x)
    u = rbits.astype(np.float32) / F32(256)
    step = np.where(a >= 4, F32(2), np.where(a >= 2, F32(1), F32(0.5))).astype(np.float32)
    t = (a + (u * step).astype(np.float32)).astype(np.float32)
    step_t = np.where(t >= 4, F32(2), np.where(t >= 2, F32(1), F32(0.5))).astype(np.float32)
    q = np.fmin(np.floor(t / step_t) * step_t, F32(6))
    q = np.where(np.isnan(q), F32(6), q)
    negative = np.signbit(x) & ~np.isnan(x)
    return encode("e2m1", np.where(negative, -q, q).astype(np.float32))


# ---------------------------------------------------------------- Hadamard transform

TE_SIGNS = np.array([1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1], dtype=np.float32)


def sylvester(n):
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h


def rht_rows(x, signs=TE_SIGNS):
    """Each 16-run of a row times diag(signs) H16 / 4: the 16 signed terms summed in order in float32, then x 0.25."""
    x = np.asarray(x, dtype=np.float32)
    rows, cols = x.shape
    groups = x.reshape(rows, cols // 16, 16)
    m = signs[:, None] * sylvester(16)  # M[i, j] (times 1/4)
    out = np.empty_like(groups)
    for j in range(16):
        acc = np.zeros(groups.shape[:2], dtype=np.float32)
        for i in range(16):
            term = groups[:, :, i] if m[i, j] > 0 else -groups[:, :, i]
            with np.errstate(over="ignore", invalid="ignore"):  # huge inputs overflow to Inf as in float32 C++
                acc = (acc + term).astype(np.float32)
        out[:, :, j] = acc * F32(0.25)
    return out.reshape(rows, cols)


def inverse_rht_rows(y, signs=TE_SIGNS):
    y = np.asarray(y, dtype=np.float32)
    rows, cols = y.shape
    groups = y.reshape(rows, cols // 16, 16)
    h = sylvester(16)
    out = np.empty_like(groups)
    for i in range(16):
        acc = np.zeros(groups.shape[:2], dtype=np.float32)
        for j in range(16):
            term = groups[:, :, j] if h[i, j] > 0 else -groups[:, :, j]
            with np.errstate(over="ignore", invalid="ignore"):
                acc = (acc + term).astype(np.float32)
        v = acc * F32(0.25)
        out[:, :, i] = v if signs[i] > 0 else -v
    return out.reshape(rows, cols)


# ---------------------------------------------------------------- recipes

def block_amax(x, br, bc):
    """max |x| (NaN skipped, from 0) of each br x bc block, [ceil(rows / br), ceil(cols / bc)]; edge blocks cover
    the elements there are (zero padding leaves a max of magnitudes unchanged)."""
    rows, cols = x.shape
    gr, gc = -(-rows // br), -(-cols // bc)
    a = np.abs(np.asarray(x, dtype=np.float32))
    a = np.where(np.isnan(a), F32(0), a)
    padded = np.zeros((gr * br, gc * bc), dtype=np.float32)
    padded[:rows, :cols] = a
    return padded.reshape(gr, br, gc, bc).max(axis=(1, 3))


def per_element(grid, shape, br, bc):
    """The block value of every element."""
    return np.repeat(np.repeat(grid, br, axis=0), bc, axis=1)[:shape[0], :shape[1]]


def scale_from_amax(a, fp8_max, pow2):
    """compute_scale_from_amax with epsilon 0 and value_for_inf = FLT_MAX, elementwise."""
    a = np.asarray(a, dtype=np.float32)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        s = (F32(fp8_max) / a).astype(np.float32)
    s = np.where(np.isinf(s), FLT_MAX, s).astype(np.float32)
    if pow2:
        s = np.ldexp(F32(1), np.frexp(s)[1] - 1).astype(np.float32)  # round down to a power of two
    return np.where(np.isinf(a) | (a == 0) | np.isnan(a), F32(1), s).astype(np.float32)


def quantize_fp8_blocks(x, fmt, br, bc, pow2):
    """Per-tensor (one block) and blockwise FP8: codes, decode scales [grid], decoded."""
    scale = scale_from_amax(block_amax(x, br, bc), FORMAT_MAX[fmt], pow2)
    inv = (F32(1) / scale).astype(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        codes = encode(fmt, (x * per_element(scale, x.shape, br, bc)).astype(np.float32))
        decoded = (decode(fmt, codes) * per_element(inv, x.shape, br, bc)).astype(np.float32)
    return codes, inv, decoded


def quantize_mxfp8(x, fmt):
    rcp = F32(1.0 / FORMAT_MAX[fmt])
    with np.errstate(over="ignore"):
        e = e8m0_round_up((block_amax(x, 1, 32) * rcp).astype(np.float32)).astype(np.int64)
    inv = np.ldexp(F32(1), 127 - e).astype(np.float32)
    scale = e8m0_value(e)
    with np.errstate(over="ignore", invalid="ignore"):
        codes = encode(fmt, (x * per_element(inv, x.shape, 1, 32)).astype(np.float32))
        decoded = (decode(fmt, codes) * per_element(scale, x.shape, 1, 32)).astype(np.float32)
    return codes, scale, decoded


def quantize_nvfp4(x, br, rbits=None):
    """NVFP4 with br x 16 blocks; rbits (one byte per element, row-major) selects stochastic rounding."""
    g_amax = amax(x)
    with np.errstate(divide="ignore", over="ignore"):
        s_enc = F32(min(F32(2688) / g_amax, FLT_MAX))
    if g_amax == 0 or s_enc == 0:
        s_enc = F32(1)
    s_dec = F32(1) / s_enc
    sixth = F32(1) / F32(6)
    with np.errstate(over="ignore"):
        s_b = decode("e4m3", encode("e4m3", (block_amax(x, br, 16) * F32(s_enc * sixth)).astype(np.float32)))
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        factor = np.minimum(F32(1) / (s_b * s_dec).astype(np.float32), FLT_MAX).astype(np.float32)
        scaled = (x * per_element(factor, x.shape, br, 16)).astype(np.float32)
        codes = encode("e2m1", scaled) if rbits is None else e2m1_stochastic(scaled, rbits.reshape(x.shape))
    # E2M1 has no NaN: moecore marks a block holding a NaN with the E4M3 NaN scale (TE's cast would decode the NaN as
    # a finite +6 x scale); the codes stay the cast's.
    s_b = np.where(block_has_nan(x, br, 16), F32(np.nan), s_b).astype(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        final = ((s_b * g_amax).astype(np.float32) * (F32(1) / F32(2688))).astype(np.float32)
        decoded = (decode("e2m1", codes) * per_element(final, x.shape, br, 16)).astype(np.float32)
    return codes, s_b, decoded, g_amax


def block_has_nan(x, br, bc):
    """Whether each br x bc block holds a NaN (the shape's multiples of the block)."""
    rows, cols = x.shape
    return np.isnan(x).reshape(rows // br, br, cols // bc, bc).any(axis=(1, 3))


def amax(x):
    """max |x| skipping NaN, from 0 (chains of fmaxf)."""
    a = np.abs(np.asarray(x, dtype=np.float32))
    return F32(np.max(np.where(np.isnan(a), F32(0), a), initial=F32(0)))


def quantize(x, recipe, fmt, role, usage="rowwise", seed=1234):
    """The tool's outputs for one tensor: codes (stored layout), scales (grid), decoded (source layout), and the
    nvfp4 global amax (None otherwise)."""
    x = np.asarray(x, dtype=np.float32)
    data = x.T.copy() if usage == "columnwise" else x
    rht = recipe == "nvfp4" and usage == "columnwise" and role != "weight"
    if rht:
        data = rht_rows(data)
    g_amax = None
    if recipe == "tensorwise":
        codes, grid, dec = quantize_fp8_blocks(data, fmt, max(data.shape[0], 1), max(data.shape[1], 1), False)
    elif recipe == "blockwise":
        codes, grid, dec = quantize_fp8_blocks(data, fmt, 128 if role == "weight" else 1, 128, True)
    elif recipe == "mxfp8":
        codes, grid, dec = quantize_mxfp8(data, fmt)
    elif recipe == "nvfp4":
        rbits = None
        if role == "gradient":
            key = ROWWISE_KEY if usage == "rowwise" else COLUMNWISE_KEY
            rbits = random_bytes(seed, key, data.size)
        codes, grid, dec, g_amax = quantize_nvfp4(data, 16 if role == "weight" else 1, rbits)
    else:
        raise ValueError(recipe)
    if rht:
        dec = inverse_rht_rows(dec)
    if usage == "columnwise":
        dec = dec.T.copy()
    return codes, grid, dec, g_amax
