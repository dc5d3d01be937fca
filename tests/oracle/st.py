"""A small, independent safetensors reader/writer on numpy (the `safetensors` package is not installed here).

Format: 8-byte little-endian header length N, N bytes of JSON
{"__metadata__": {str: str}, name: {"dtype": "F32", "shape": [...], "data_offsets": [begin, end]}},
then the byte buffer (offsets relative to its start). bf16 has no numpy dtype: it is read into float32
(exactly) and written from float32 with round-to-nearest-even.
"""
import json
import os
import struct

import numpy as np

_DTYPES = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "U8": np.dtype("u1"),
}
_CODES = {np.dtype(v).newbyteorder("="): k for k, v in _DTYPES.items()}


def _bf16_bits_to_f32(bits):
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _f32_to_bf16_bits(values):
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    nan = np.isnan(values)
    rounded = np.where(nan, (bits >> 16) | 0x40, rounded)
    return rounded.astype(np.uint16)


def load(path):
    """Returns ({name: np.ndarray}, metadata). BF16 tensors come back as float32."""
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < 8:
        raise ValueError(f"{path}: too short")
    (n,) = struct.unpack("<Q", data[:8])
    if n > len(data) - 8:
        raise ValueError(f"{path}: header length {n} runs past the end")
    header = json.loads(data[8:8 + n].decode("utf-8"))
    buffer = memoryview(data)[8 + n:]
    metadata = header.pop("__metadata__", {})
    tensors = {}
    for name, info in header.items():
        begin, end = info["data_offsets"]
        shape = tuple(info["shape"])
        raw = buffer[begin:end]
        if info["dtype"] == "BF16":
            array = _bf16_bits_to_f32(np.frombuffer(raw, dtype="<u2")).reshape(shape)
        else:
            dtype = _DTYPES[info["dtype"]]
            array = np.frombuffer(raw, dtype=dtype).reshape(shape)
            if array.nbytes != end - begin:
                raise ValueError(f"{path}: {name}: size mismatch")
        tensors[name] = array.copy()
    return tensors, metadata


def save(path, tensors, metadata=None, bf16=()):
    """Writes {name: array}; names listed in `bf16` are stored as BF16. Atomic (temp file + rename)."""
    header = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    chunks = []
    offset = 0
    for name, value in tensors.items():
        array = np.asarray(value)
        if name in bf16:
            raw = _f32_to_bf16_bits(array).astype("<u2").tobytes()
            code = "BF16"
        else:
            code = _CODES.get(array.dtype.newbyteorder("="))
            if code is None:
                raise ValueError(f"{name}: unsupported dtype {array.dtype}")
            raw = np.ascontiguousarray(array, dtype=_DTYPES[code]).tobytes()
        header[name] = {"dtype": code, "shape": list(array.shape), "data_offsets": [offset, offset + len(raw)]}
        chunks.append(raw)
        offset += len(raw)
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * ((8 - len(text) % 8) % 8)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for raw in chunks:
            f.write(raw)
    os.replace(tmp, path)
