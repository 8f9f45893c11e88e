"""An algorithm's server state as bytes, without pickle.

A restarted coordinator must resume with everything the server half carries between rounds
(FedAvg's parameters and round counter; AgnosticFedAvg's λ, count window and optimizer moments;
AAggFF's decision and Newton history), not only the model. Unpickling a checkpoint would execute
whatever the file says, so the format is data only: a JSON header describing the state as a
tree, and its arrays as a ``tally.modelio`` blob::

    b"TALLYS2\\n" | u32 header length | JSON header | modelio blob of the arrays

The tree's nodes, each a one-key JSON object:

- ``{"d": {field: node}}`` a dataclass (nested ones too), every field present;
- ``{"m": [[key, node], ...]}`` a mapping with string keys, in order (FedAvg flattens parameters
  in mapping order);
- ``{"s": [node, ...], "tuple": bool}`` a list or tuple of arrays and scalars;
- ``{"a": name, "shape": [...]}`` an ndarray, ``{"g": name}`` a numpy scalar (kept with its
  dtype), both stored under ``name`` in the array blob (the shape is restated because the blob
  stores a 0-d array as 1-d);
- ``{"v": value}`` a JSON scalar (None, bool, int, float including NaN and ±inf, str).

Anything else raises ``UnsupportedState`` and the caller falls back to checkpointing the model
alone (``server.init(model)`` on resume).

Decoding needs a *template* state of the same algorithm (``server.init(model)``): a dataclass
node is rebuilt with ``dataclasses.replace`` on the template's value at the same place, so the
bytes can never choose which type gets constructed; containers are plain dicts, lists and tuples.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from tally import modelio

MAGIC = b"TALLYS2\n"
_SCALARS = (type(None), bool, int, float, str)


class UnsupportedState(TypeError):
    """A state this format cannot represent faithfully."""


def state_to_bytes(state: Any) -> bytes:
    header, arrays = state_to_arrays(state)
    return modelio.pack_header(MAGIC, header) + modelio.serialize(arrays)


def state_from_bytes(data: bytes, template: Any) -> Any:
    header, body = modelio.unpack_header(data, MAGIC, "state")
    return state_from_arrays(template, header, modelio.deserialize(data[body:]))


def state_to_arrays(state: Any) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """(header, arrays): the tree in the header, every array under a unique name."""
    if not _is_dataclass(state):
        raise UnsupportedState(f"{type(state).__name__} is not a dataclass")
    arrays: dict[str, np.ndarray] = {}
    return {"tree": _encode(state, type(state).__name__, arrays)}, arrays


def state_from_arrays(template: Any, header: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> Any:
    """A state like ``template`` with the values of ``state_to_arrays``'s output."""
    if not isinstance(header, Mapping) or "tree" not in header:
        raise ValueError("state header has no tree")
    return _decode(header["tree"], template, type(template).__name__, arrays)


def _is_dataclass(value: Any) -> bool:
    return dataclasses.is_dataclass(value) and not isinstance(value, type)


def _encode(value: Any, where: str, arrays: dict[str, np.ndarray]) -> dict[str, Any]:
    if _is_dataclass(value):
        return {"d": {f.name: _encode(getattr(value, f.name), f"{where}.{f.name}", arrays)
                      for f in dataclasses.fields(value)}}
    if isinstance(value, Mapping):
        if not all(isinstance(k, str) for k in value):
            raise UnsupportedState(f"{where} is a mapping with keys that are not strings")
        return {"m": [[k, _encode(v, f"{where}[{k!r}]", arrays)] for k, v in value.items()]}
    if isinstance(value, (list, tuple)):
        items = [_leaf(v, f"{where}[{i}]", arrays) for i, v in enumerate(value)]
        return {"s": items, "tuple": isinstance(value, tuple)}
    return _leaf(value, where, arrays)


def _leaf(value: Any, where: str, arrays: dict[str, np.ndarray]) -> dict[str, Any]:
    if isinstance(value, (np.ndarray, np.generic)):
        array = np.asarray(value)
        if array.dtype.hasobject or array.dtype.fields is not None:
            raise UnsupportedState(f"{where} has dtype {array.dtype}; only plain numeric arrays are kept")
        name = str(len(arrays))
        arrays[name] = array
        if isinstance(value, np.generic):
            return {"g": name}
        return {"a": name, "shape": list(array.shape)}
    if isinstance(value, _SCALARS):
        return {"v": value}
    raise UnsupportedState(
        f"{where} is a {type(value).__name__}; supported are dataclasses, mappings, lists and "
        "tuples of arrays and scalars, arrays, numpy scalars and JSON scalars"
    )


def _decode(node: Any, template: Any, where: str, arrays: Mapping[str, np.ndarray]) -> Any:
    if not isinstance(node, Mapping) or len(node) not in (1, 2):
        raise ValueError(f"state blob: malformed node at {where}")
    if "d" in node:
        return _decode_dataclass(node["d"], template, where, arrays)
    if "m" in node:
        items = node["m"]
        if not isinstance(items, list) or not all(
            isinstance(i, list) and len(i) == 2 and isinstance(i[0], str) for i in items
        ):
            raise ValueError(f"state blob: malformed mapping at {where}")
        inner = template if isinstance(template, Mapping) else {}
        return {k: _decode(v, inner.get(k), f"{where}[{k!r}]", arrays) for k, v in items}
    if "s" in node:
        if not isinstance(node["s"], list):
            raise ValueError(f"state blob: malformed sequence at {where}")
        items = [_decode_leaf(v, f"{where}[{i}]", arrays) for i, v in enumerate(node["s"])]
        return tuple(items) if node.get("tuple") else items
    return _decode_leaf(node, where, arrays)


def _decode_dataclass(fields: Any, template: Any, where: str, arrays: Mapping[str, np.ndarray]) -> Any:
    if not _is_dataclass(template):
        raise ValueError(f"state blob has a dataclass at {where}, the template a {type(template).__name__}")
    names = [f.name for f in dataclasses.fields(template)]
    if not isinstance(fields, Mapping) or sorted(fields) != sorted(names):
        stored = sorted(fields) if isinstance(fields, Mapping) else fields
        raise ValueError(f"state blob has fields {stored} at {where} but "
                         f"{type(template).__name__} has {sorted(names)}")
    return dataclasses.replace(template, **{
        name: _decode(fields[name], getattr(template, name), f"{where}.{name}", arrays) for name in names
    })


def _decode_leaf(node: Any, where: str, arrays: Mapping[str, np.ndarray]) -> Any:
    if not isinstance(node, Mapping):
        raise ValueError(f"state blob: malformed value at {where}")
    if node.keys() == {"v"} and isinstance(node["v"], _SCALARS):
        return node["v"]
    if node.keys() == {"g"}:
        return _array(node["g"], [], where, arrays)[()]
    if node.keys() == {"a", "shape"}:
        return _array(node["a"], node["shape"], where, arrays)
    raise ValueError(f"state blob: malformed value at {where}")


def _array(name: Any, shape: Any, where: str, arrays: Mapping[str, np.ndarray]) -> np.ndarray:
    if not isinstance(name, str) or name not in arrays:
        raise ValueError(f"state blob lacks array {name!r} ({where})")
    if not isinstance(shape, list) or not all(isinstance(n, int) and n >= 0 for n in shape):
        raise ValueError(f"state blob: malformed shape at {where}")
    array = arrays[name]
    if array.size != math.prod(shape):
        raise ValueError(f"state blob: array {name!r} has {array.size} values, {where} needs shape {shape}")
    return array.reshape(shape)
