"""Named arrays to and from ``common.Tensor``: the model a device downloads, the plain
contributions of a step that is not summed securely, what the coordinator publishes of a step.

Apart from the protocol messages because the device's training path and the coordinator's step
answers move arrays and never a secure-aggregation message. Only plain numeric dtypes travel,
little-endian in C order, so a tensor reads the same on every platform.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from tally.wire.fields import WireError
from tally.wire.v1 import common_pb2

# Plain numeric dtypes only: object, string, void and datetime arrays have no portable bytes
# (and decoding an object array from untrusted bytes would be unsafe).
_DTYPES = frozenset(
    ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
     "float16", "float32", "float64", "complex64", "complex128"]
)


def tensor_to_proto(name: str, array: Any) -> common_pb2.Tensor:
    """A Tensor of ``array``'s values, C order, little-endian."""
    if not isinstance(name, str):
        raise TypeError(f"tensor name must be a str, got {type(name).__name__}")
    array = np.asarray(array)
    if array.dtype.name not in _DTYPES:
        raise ValueError(f"tensor {name!r}: dtype {array.dtype} cannot go on the wire; "
                         f"use one of {sorted(_DTYPES)}")
    little = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<"))
    return common_pb2.Tensor(
        name=name, shape=array.shape, dtype=array.dtype.name, data=little.tobytes()
    )


def tensor_from_proto(proto: common_pb2.Tensor) -> np.ndarray:
    """A writable array in native byte order, with the Tensor's dtype and shape."""
    if not isinstance(proto, common_pb2.Tensor):
        raise WireError(f"expected a Tensor, got {type(proto).__name__}")
    if proto.dtype not in _DTYPES:
        raise WireError(f"tensor {proto.name!r}: unsupported dtype {proto.dtype!r}; "
                        f"expected one of {sorted(_DTYPES)}")
    shape = tuple(int(d) for d in proto.shape)
    if any(d < 0 for d in shape):
        raise WireError(f"tensor {proto.name!r}: negative dimension in shape {shape}")
    dtype = np.dtype(proto.dtype).newbyteorder("<")
    expected = math.prod(shape) * dtype.itemsize
    if len(proto.data) != expected:
        raise WireError(f"tensor {proto.name!r}: shape {shape} of {proto.dtype} needs {expected} "
                        f"bytes, got {len(proto.data)}")
    return np.frombuffer(proto.data, dtype=dtype).reshape(shape).astype(dtype.newbyteorder("="))


def tensors_to_proto(values: Mapping[str, Any]) -> list[common_pb2.Tensor]:
    """Named arrays (a broadcast) as Tensors, in the mapping's order."""
    return [tensor_to_proto(name, array) for name, array in values.items()]


def tensors_from_proto(protos: Iterable[common_pb2.Tensor]) -> dict[str, np.ndarray]:
    """Inverse of ``tensors_to_proto``; names must be present and unique."""
    out: dict[str, np.ndarray] = {}
    for proto in protos:
        if not isinstance(proto, common_pb2.Tensor):
            raise WireError(f"expected a Tensor, got {type(proto).__name__}")
        if not proto.name:
            raise WireError("Tensor.name is missing (empty) in a list of named tensors")
        if proto.name in out:
            raise WireError(f"duplicate tensor name {proto.name!r}")
        out[proto.name] = tensor_from_proto(proto)
    return out
