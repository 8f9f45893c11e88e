"""Model parameters as bytes: a deterministic layout, so equal models have equal digests
and the checkpoint store can be content-addressed."""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Mapping
from typing import Any

import numpy as np

_MAGIC = b"TALLYM1\n"


def serialize(params: Mapping[str, np.ndarray]) -> bytes:
    header, blobs = [], []
    for name, value in params.items():
        array = np.asarray(value, order="C")  # not ascontiguousarray: it turns a 0-d scalar into shape (1,)
        little = array.astype(array.dtype.newbyteorder("<"), copy=False)
        header.append({"name": name, "dtype": little.dtype.str, "shape": list(array.shape)})
        blobs.append(little.tobytes())
    return pack_header(_MAGIC, header) + b"".join(blobs)


def deserialize(data: bytes) -> dict[str, np.ndarray]:
    header, offset = unpack_header(data, _MAGIC, "model")
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


def pack_header(magic: bytes, header: Any) -> bytes:
    """``magic | u32 length | compact JSON header``: how a model blob starts, and the coordinator's
    state blob too (``tally.coordinator.state.state_codec``), so both are read by one parser."""
    head = json.dumps(header, separators=(",", ":")).encode()
    return magic + struct.pack("<I", len(head)) + head


def unpack_header(data: bytes, magic: bytes, kind: str) -> tuple[Any, int]:
    """(the JSON header, the offset of the body after it) of a blob that ``pack_header`` began;
    ``ValueError`` naming ``kind`` when ``data`` does not start with ``magic`` or the header is
    not JSON."""
    if not data.startswith(magic) or len(data) < len(magic) + 4:
        raise ValueError(f"not a Tally {kind} blob of format {magic.strip().decode()}")
    (size,) = struct.unpack_from("<I", data, len(magic))
    start = len(magic) + 4
    try:
        return json.loads(data[start : start + size]), start + size
    except json.JSONDecodeError as exc:
        raise ValueError(f"corrupt {kind} header: {exc}") from None


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
