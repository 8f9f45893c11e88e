"""Model parameters as bytes: a deterministic layout, so equal models have equal digests
and the checkpoint store can be content-addressed."""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Mapping

import numpy as np

_MAGIC = b"TALLYM1\n"


def serialize(params: Mapping[str, np.ndarray]) -> bytes:
    header, blobs = [], []
    for name, value in params.items():
        array = np.asarray(value, order="C")  # not ascontiguousarray: it turns a 0-d scalar into shape (1,)
        little = array.astype(array.dtype.newbyteorder("<"), copy=False)
        header.append({"name": name, "dtype": little.dtype.str, "shape": list(array.shape)})
        blobs.append(little.tobytes())
    head = json.dumps(header, separators=(",", ":")).encode()
    return _MAGIC + struct.pack("<I", len(head)) + head + b"".join(blobs)


def deserialize(data: bytes) -> dict[str, np.ndarray]:
    if not data.startswith(_MAGIC) or len(data) < len(_MAGIC) + 4:
        raise ValueError("not a Tally model blob")
    (size,) = struct.unpack_from("<I", data, len(_MAGIC))
    start = len(_MAGIC) + 4
    try:
        header = json.loads(data[start : start + size])
    except json.JSONDecodeError as exc:
        raise ValueError(f"corrupt model header: {exc}") from None
    offset = start + size
    out = {}
    for entry in header:
        dtype = np.dtype(entry["dtype"])
        count = int(np.prod(entry["shape"], dtype=np.int64))
        end = offset + count * dtype.itemsize
        if end > len(data):
            raise ValueError(f"model blob truncated in {entry['name']!r}")
        out[entry["name"]] = np.frombuffer(data[offset:end], dtype=dtype).reshape(entry["shape"]).copy()
        offset = end
    if offset != len(data):
        raise ValueError("model blob has trailing bytes")
    return out


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
