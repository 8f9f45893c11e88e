"""A device's side of differential privacy: the DP parameters a step's broadcast carries, the
client wrapper that applies them, and ring encoding of a payload already in the ring.

The parameters travel with the step's broadcast (``dp.*`` tensors), so a device needs no
configuration: it applies what the server's step asks for, and strips those tensors before its
algorithm sees the broadcast. A device with a noise floor checks them first
(``check_noise_floor``). Nothing here needs the accountant (devices do not install it).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from tally.algorithms.base import Arrays, ClientAlgorithm, LocalTrainer
from tally.codec import CodecError, PayloadSchema, to_ring
from tally.privacy import mechanisms
from tally.privacy.planning import DP_FIELD, kls_epsilon

SEED = "dp.seed"
PARAMS = "dp.params"
FIELD_PREFIX = "dp.field."
COUNTED_PREFIX = "dp.counted."
CENTRAL, DISTRIBUTED = "central", "distributed"
MECHANISM_CODES = {CENTRAL: 0.0, DISTRIBUTED: 1.0}


def split(vector: np.ndarray, shapes: list[tuple[str, tuple[int, ...]]]) -> dict[str, np.ndarray]:
    """The flat vector back into named arrays, in order."""
    out, offset = {}, 0
    for name, shape in shapes:
        size = int(np.prod(shape, dtype=np.int64))
        out[name] = vector[offset:offset + size].reshape(shape)
        offset += size
    return out


class NoiseBelowFloor(ValueError):
    """The step asks this device for less privacy than its own floor; ``reason`` is a short label
    (``no_noise``, ``central``, ``below_floor``, ``share_mismatch``) for metrics."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def check_noise_floor(public: Mapping[str, np.ndarray], floor: float, cohort: int) -> None:
    """``NoiseBelowFloor`` unless the step's DP gives at least noise multiplier ``floor``.

    A device does not trust the server's DP parameters: the step must ask for distributed noise
    (central noise is the server's to add, so unverifiable), declare a multiplier at or above the
    floor, and the share this device is told to add must carry that multiplier: its share std
    times sqrt(honest devices) at least ``floor`` times its discretised sensitivity, with the
    honest devices counted at most ``cohort`` (the session's size, which the device checks
    against its roster). A server asking a small share while claiming more noisy devices than the
    cohort holds is refused too."""
    if floor <= 0:
        return
    if PARAMS not in public:
        raise NoiseBelowFloor("no_noise",
                              f"the step adds no DP noise; this device requires noise multiplier >= {floor:g}")
    params = [float(x) for x in public[PARAMS]]
    code, declared, honest = params[0], params[5] if len(params) > 5 else 0.0, params[6] if len(params) > 6 else 0.0
    if code != MECHANISM_CODES[DISTRIBUTED]:
        raise NoiseBelowFloor("central", "the step's noise is central (added by the server, which this device "
                              f"cannot verify); this device requires distributed noise multiplier >= {floor:g}")
    if declared < floor:
        raise NoiseBelowFloor("below_floor", f"the step declares noise multiplier {declared:g}, below this device's "
                              f"floor {floor:g}")
    _, _, _, bound_sq, sigma = params[:5]
    counted = min(honest, float(cohort))
    carried = sigma * math.sqrt(counted) / math.sqrt(bound_sq) if bound_sq > 0 else 0.0
    if carried < floor * (1 - 1e-9):
        raise NoiseBelowFloor("share_mismatch", f"the noise share this device is asked to add (std {sigma:g} ring "
                              f"units over {counted:g} honest devices of a cohort of {cohort}) carries noise "
                              f"multiplier {carried:.4g}, below this device's floor {floor:g}")


# dp.params: mechanism, clip, scale, squared bound, share std, declared multiplier, honest devices.
PARAMS_FIELDS = ("mechanism", "clip", "scale", "bound_sq", "share_std", "noise_multiplier", "noise_devices")


def verified_noise(public: Mapping[str, np.ndarray], cohort: int, dim: int) -> tuple[float, int]:
    """(noise multiplier, honest devices) of the release this step asks for, as far as this device
    can verify it: its own share of std sigma (ring units) over at most the ``cohort``'s planned
    honest survivors, against its discretised sensitivity, as the KLS zCDP bound of the sum of
    their discrete Gaussians over ``dim`` values gives it (the server's accountant's formula).
    (0.0, 0) for a step without noise this device can see (none, or central: the server's to
    add), an unbounded release. ``CodecError`` naming the field when ``dp.params`` declares
    distributed DP without what the device needs to account it."""
    if PARAMS not in public:
        return 0.0, 0
    params = [float(x) for x in np.ravel(public[PARAMS])]
    if not params or params[0] != MECHANISM_CODES[DISTRIBUTED]:
        return 0.0, 0
    if len(params) < len(PARAMS_FIELDS) or not all(math.isfinite(x) for x in params):
        raise CodecError(f"{PARAMS}: distributed DP needs {len(PARAMS_FIELDS)} finite values "
                         f"({', '.join(PARAMS_FIELDS)}), got {params}")
    bad = [name for name, value in zip(PARAMS_FIELDS[3:], params[3:7], strict=True) if value <= 0]
    if bad:
        raise CodecError(f"{PARAMS}: distributed DP with {' and '.join(bad)} <= 0 cannot be accounted")
    if dim < 1:
        raise CodecError(f"{PARAMS}: distributed DP over a payload of {dim} values")
    honest = int(min(params[6], float(cohort)))
    if honest < 1:
        return 0.0, 0
    return 1.0 / kls_epsilon(math.sqrt(params[3]), params[4], honest, dim), honest


class PrivateClient:
    """A client half that applies whatever DP the step's broadcast asks for (nothing if none),
    refusing a step whose noise is below ``min_noise_multiplier`` (0: no floor) over a cohort of
    ``cohort`` devices (the session's size)."""

    def __init__(self, inner: ClientAlgorithm, min_noise_multiplier: float = 0.0, cohort: int = 0) -> None:
        self.inner, self.min_noise_multiplier, self.cohort = inner, min_noise_multiplier, cohort

    def check(self, broadcast: Mapping[str, np.ndarray]) -> None:
        """``NoiseBelowFloor`` when the step's DP is below this device's floor."""
        check_noise_floor({k: v for k, v in broadcast.items() if k.startswith("dp.")},
                          self.min_noise_multiplier, self.cohort)

    def contribute(
        self, step: str, broadcast: Mapping[str, np.ndarray], device: LocalTrainer, local_state: Any
    ) -> tuple[Arrays, Any]:
        public = {k: v for k, v in broadcast.items() if k.startswith("dp.")}
        self.check(public)  # before any training
        plain = {k: v for k, v in broadcast.items() if not k.startswith("dp.")}
        values, state = self.inner.contribute(step, plain, device, local_state)
        return (privatise(values, public) if public else values), state


def privatise(values: Mapping[str, np.ndarray], public: Mapping[str, np.ndarray]) -> Arrays:
    """A payload clipped (central) or encoded in the ring with noise (distributed)."""
    order = sorted((int(v[0]), k[len(FIELD_PREFIX):], float(v[1]) if np.size(v) > 1 else 1.0)
                   for k, v in public.items() if k.startswith(FIELD_PREFIX))
    names = [name for _, name, _ in order]
    for name in (k[len(COUNTED_PREFIX):] for k in public if k.startswith(COUNTED_PREFIX)):
        if name not in values or not np.all(np.asarray(values[name]) == 1):
            raise CodecError(f"{name!r} is counted under DP (the server uses the number of contributors), "
                             f"so it must be 1 on every device")
    missing = [n for n in names if n not in values]
    if missing:
        raise CodecError(f"the step asks for DP over fields {missing} the payload does not have")
    shapes = [(n, np.shape(values[n])) for n in names]
    # Each field in units of the joint clip (a bounded field's unit is its L2 bound / clip).
    units = np.repeat([unit for _, _, unit in order], [int(np.prod(shape, dtype=np.int64)) for _, shape in shapes])
    vector = np.concatenate([np.asarray(values[n], dtype=np.float64).ravel() for n in names]) / units
    code, clip, scale, bound_sq, sigma = (float(x) for x in public[PARAMS][:5])
    if code == MECHANISM_CODES[CENTRAL]:
        return split(units * mechanisms.clip_l2(vector, clip), shapes)
    share = mechanisms.DeviceShare(clip, scale, bound_sq, sigma)
    return {DP_FIELD: mechanisms.encode_distributed(vector, share, int(public[SEED][0]))}


def ring_encode(schema: PayloadSchema, values: Mapping[str, Any], rng: np.random.Generator,
                bits: int) -> tuple[np.ndarray, int]:
    """A payload as ring elements, and how many values the codec clipped. A distributed-DP
    payload is already integer: it is reduced mod 2^bits as it is (modular clipping), since its
    noise share may exceed the per-device bound that the codec's clip would cut it to."""
    if [f.name for f in schema.fields] == [DP_FIELD]:
        ints = np.asarray(values[DP_FIELD])
        if ints.dtype.kind not in "iu" or ints.shape != (schema.dim,):
            raise CodecError(f"{DP_FIELD}: expected {schema.dim} integers, got {ints.dtype} {ints.shape}")
        return to_ring(ints, bits), 0
    encoded = schema.encode(values, rng)
    return to_ring(encoded.vector, bits), sum(encoded.clipped.values())
