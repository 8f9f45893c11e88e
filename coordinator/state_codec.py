"""An algorithm's server state as bytes, without pickle.

A restarted coordinator must resume with everything the server half carries between rounds
(FedAvg's parameters and round counter; later algorithms' optimizer moments or dual variables),
not only the model. Unpickling a checkpoint would execute whatever the file says, so the format
is data only: a JSON header for scalars and the layout, and the arrays as a ``tally.modelio``
blob::

    b"TALLYS1\\n" | u32 header length | JSON header | modelio blob of the arrays

Supported states are dataclasses whose fields are arrays, mappings of names to arrays (kept in
order: FedAvg flattens parameters in mapping order) or JSON scalars. That covers
``FedAvgState``; a state of any other shape raises ``UnsupportedState`` and the caller falls back
to checkpointing the model alone (``server.init(model)`` on resume).

Decoding needs a *template* state of the same algorithm (``server.init(model)``) rather than a
class name from the file, so the bytes can never choose which type gets constructed.
"""

from __future__ import annotations

import dataclasses
import json
import struct
from collections.abc import Mapping
from typing import Any

import numpy as np

from tally import modelio

MAGIC = b"TALLYS1\n"
_SCALARS = (type(None), bool, int, float, str)


class UnsupportedState(TypeError):
    """A state this format cannot represent faithfully."""


def state_to_bytes(state: Any) -> bytes:
    header, arrays = state_to_arrays(state)
    head = json.dumps(header, separators=(",", ":")).encode()
    return MAGIC + struct.pack("<I", len(head)) + head + modelio.serialize(arrays)


def state_from_bytes(data: bytes, template: Any) -> Any:
    if not data.startswith(MAGIC) or len(data) < len(MAGIC) + 4:
        raise ValueError("not a Tally state blob")
    (size,) = struct.unpack_from("<I", data, len(MAGIC))
    start = len(MAGIC) + 4
    try:
        header = json.loads(data[start : start + size])
    except json.JSONDecodeError as exc:
        raise ValueError(f"corrupt state header: {exc}") from None
    return state_from_arrays(template, header, modelio.deserialize(data[start + size :]))


def state_to_arrays(state: Any) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """(header, arrays): scalars and the layout in the header, every array by a unique name."""
    if not dataclasses.is_dataclass(state) or isinstance(state, type):
        raise UnsupportedState(f"{type(state).__name__} is not a dataclass")
    header: dict[str, Any] = {"scalars": {}, "arrays": [], "maps": {}}
    arrays: dict[str, np.ndarray] = {}
    for f in dataclasses.fields(state):
        value = getattr(state, f.name)
        if isinstance(value, (np.ndarray, np.generic)):
            header["arrays"].append(f.name)
            arrays[f.name] = np.asarray(value)
        elif isinstance(value, Mapping) and all(
            isinstance(k, str) and isinstance(v, (np.ndarray, np.generic)) for k, v in value.items()
        ):
            header["maps"][f.name] = list(value)
            arrays.update({f"{f.name}/{k}": np.asarray(v) for k, v in value.items()})
        elif isinstance(value, _SCALARS):
            header["scalars"][f.name] = value
        else:
            raise UnsupportedState(
                f"{type(state).__name__}.{f.name} is a {type(value).__name__}; supported are "
                "arrays, mappings of names to arrays and JSON scalars"
            )
    return header, arrays


def state_from_arrays(template: Any, header: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> Any:
    """A state like ``template`` with the values of ``state_to_arrays``'s output."""
    names = {f.name for f in dataclasses.fields(template)}
    scalars, plain, maps = header.get("scalars", {}), header.get("arrays", []), header.get("maps", {})
    stored = set(scalars) | set(plain) | set(maps)
    if stored != names:
        raise ValueError(
            f"state blob has fields {sorted(stored)} but {type(template).__name__} has {sorted(names)}"
        )
    values: dict[str, Any] = dict(scalars)
    try:
        values.update({name: arrays[name] for name in plain})
        values.update({name: {k: arrays[f"{name}/{k}"] for k in keys} for name, keys in maps.items()})
    except KeyError as exc:
        raise ValueError(f"state blob lacks array {exc.args[0]!r}") from None
    return dataclasses.replace(template, **values)
