"""Payload schemas: how named real and count fields become integers in a ring Z_{2^b}.

The server only ever sees sums mod 2^b, so everything that can go wrong with a sum (wrap-around,
silent clipping, biased rounding) has to be ruled out here, per field, before any masking happens.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

MAX_RING_BITS = 64
MAX_FRAC_BITS = 40


class CodecError(ValueError):
    """A payload or configuration the codec cannot encode faithfully."""


class OverflowRefused(CodecError):
    """A sum that could wrap around the ring; refused up front rather than produced wrong."""


class Kind(enum.Enum):
    REAL = "real"
    COUNT = "count"


def _check_ring_bits(bits: int) -> None:
    if not 1 <= bits <= MAX_RING_BITS:
        raise CodecError(f"ring width must be 1..{MAX_RING_BITS} bits, got {bits}")


def ring_mask(bits: int) -> int:
    _check_ring_bits(bits)
    return (1 << bits) - 1


def ring_dtype(bits: int) -> np.dtype:
    """The narrowest unsigned dtype holding a ring element; uint32 makes b = 32 wrap for free."""
    _check_ring_bits(bits)
    return np.dtype(np.uint32 if bits <= 32 else np.uint64)


def to_ring(vector_int64: np.ndarray, bits: int) -> np.ndarray:
    """Two's complement mod 2^bits, so that ring addition of encodings adds the signed values."""
    vector = np.asarray(vector_int64)
    if vector.dtype.kind not in "iu":
        raise CodecError(f"to_ring needs an integer vector, got dtype {vector.dtype}")
    wrapped = vector.astype(np.int64, copy=False).view(np.uint64) & np.uint64(ring_mask(bits))
    return wrapped.astype(ring_dtype(bits))


@dataclass(frozen=True)
class Field:
    """One named tensor in a payload.

    COUNT fields are exact: out-of-range counts raise instead of being clipped, because a clipped
    count is a wrong answer, not a noisy one. Their ``frac_bits`` is stored as 0 so that a single
    formula (value * 2^frac_bits, bounded by clip * 2^frac_bits) covers both kinds.
    """

    name: str
    shape: tuple[int, ...]
    kind: Kind = Kind.REAL
    clip: float = 1.0
    frac_bits: int = 16

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise CodecError(f"field name must be a non-empty string, got {self.name!r}")
        shape = tuple(int(d) for d in self.shape)
        if any(d < 1 for d in shape):
            raise CodecError(f"field {self.name!r}: every dimension must be >= 1, got {shape}")
        try:
            kind = Kind(self.kind)
        except ValueError as exc:
            raise CodecError(f"field {self.name!r}: unknown kind {self.kind!r}") from exc
        clip = float(self.clip)
        if not (math.isfinite(clip) and clip > 0):
            raise CodecError(f"field {self.name!r}: clip must be finite and > 0, got {self.clip}")
        if int(self.frac_bits) != self.frac_bits or not 0 <= self.frac_bits <= MAX_FRAC_BITS:
            raise CodecError(
                f"field {self.name!r}: frac_bits must be 0..{MAX_FRAC_BITS}, got {self.frac_bits}"
            )
        if kind is Kind.COUNT and not clip.is_integer():
            raise CodecError(f"field {self.name!r}: a count's clip is its maximum count and must "
                             f"be integral, got {self.clip}")
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "kind", kind)
        object.__setattr__(self, "clip", clip)
        object.__setattr__(self, "frac_bits", int(self.frac_bits) if kind is Kind.REAL else 0)

    @property
    def size(self) -> int:
        return math.prod(self.shape)


@dataclass
class Encoded:
    """One device's encoded payload. ``clipped`` has an entry per field (always 0 for counts,
    which raise rather than clip) so callers can report clipping without knowing the kinds."""

    vector: np.ndarray
    clipped: dict[str, int]


@dataclass(frozen=True)
class PayloadSchema:
    """An ordered list of fields; the schema, not the algorithm, owns encoding and decoding."""

    fields: tuple[Field, ...]

    def __post_init__(self) -> None:
        fields = tuple(self.fields)
        if not fields:
            raise CodecError("a payload schema needs at least one field")
        if not all(isinstance(f, Field) for f in fields):
            raise CodecError("schema fields must be Field instances")
        names = [f.name for f in fields]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise CodecError(f"duplicate field names: {duplicates}")
        object.__setattr__(self, "fields", fields)
        for f in fields:
            if 2 * self.max_abs(f) + 1 > 2**MAX_RING_BITS:
                raise OverflowRefused(
                    f"field {f.name!r}: one encoded value (up to {self.max_abs(f)}) does not fit "
                    f"in {MAX_RING_BITS} signed bits; lower clip or frac_bits"
                )

    @property
    def dim(self) -> int:
        return sum(f.size for f in self.fields)

    def _field(self, name: str) -> Field:
        for f in self.fields:
            if f.name == name:
                return f
        raise CodecError(f"no field named {name!r}")

    def max_abs(self, field: Field | str) -> int:
        """Largest |encoded integer| one device can send: stochastic rounding of |x| <= clip*2^f
        never exceeds ceil(clip*2^f)."""
        f = self._field(field) if isinstance(field, str) else field
        return math.ceil(f.clip * 2.0**f.frac_bits)

    def _widest(self) -> Field:
        return max(self.fields, key=self.max_abs)

    def required_bits(self, n_contributors: int) -> int:
        """Smallest b with 2*n*M + 1 <= 2^b, M the largest per-device |value| of any field.

        Counts are non-negative and could use one bit less, but they share the signed bound so
        that every field of the vector is decoded the same way; the cost is at most one bit.
        """
        if n_contributors < 1:
            raise CodecError(f"need at least one contributor, got {n_contributors}")
        return (2 * n_contributors * self.max_abs(self._widest())).bit_length()

    def check_bits(self, n_contributors: int, bits: int) -> None:
        """Refuse, at configuration time, a ring that a sum of n payloads could wrap."""
        required = self.required_bits(n_contributors)
        if bits < required or required > MAX_RING_BITS:
            widest = self._widest()
            limit = f" (a ring has at most {MAX_RING_BITS})" if required > MAX_RING_BITS else ""
            raise OverflowRefused(
                f"field {widest.name!r} (max |value| {self.max_abs(widest)}): a sum over "
                f"n={n_contributors} contributors needs {required} bits but {bits} are "
                f"available{limit}"
            )
        _check_ring_bits(bits)

    def encode(self, values: Mapping[str, ArrayLike], rng: np.random.Generator) -> Encoded:
        """Fields are concatenated in schema order, each flattened C-order; ``rng`` drives the
        stochastic rounding, which keeps E[decoded sum] equal to the sum of clipped inputs."""
        names = [f.name for f in self.fields]
        missing = [n for n in names if n not in values]
        extra = sorted(set(values) - set(names))
        if missing or extra:
            raise CodecError(
                f"payload does not match schema: missing {missing}, unexpected {extra}"
            )
        parts = []
        clipped: dict[str, int] = {}
        for f in self.fields:
            array = _as_array(f, values[f.name])
            if f.kind is Kind.REAL:
                encoded, clipped[f.name] = _encode_real(f, array, rng)
            else:
                encoded, clipped[f.name] = _encode_count(f, array), 0
            parts.append(encoded)
        return Encoded(vector=np.concatenate(parts), clipped=clipped)

    def decode_sum(
        self, total: np.ndarray, bits: int, contributors: int | None = None
    ) -> dict[str, np.ndarray]:
        """Turn a ring sum back into per-field sums: reals as float64, counts as int64.

        With ``contributors``, also refuse a total that no honest cohort of that size can
        produce: each real field's total within contributors x its clip, each count's within
        [0, contributors x its maximum]. Honest encoding never leaves those bounds, so the check
        costs nothing but one pass; a device that sent values far outside them (a sum cannot
        hide that, whatever the masking) fails the whole total loudly instead of skewing it.
        It proves nothing about one device's values within the bounds: see the README's threat
        model.
        """
        total = np.asarray(total)
        if total.dtype.kind != "u" or total.shape != (self.dim,):
            raise CodecError(f"sum must be an unsigned vector of length {self.dim}, "
                             f"got dtype {total.dtype} shape {total.shape}")
        mask = ring_mask(bits)
        if total.size and int(total.max()) > mask:
            raise CodecError(f"sum has values >= 2^{bits}; it is not reduced mod 2^{bits}")
        # Sign-extend from b bits: move the sign bit to bit 63, then shift back arithmetically.
        shift = MAX_RING_BITS - bits
        signed = (total.astype(np.uint64) << np.uint64(shift)).view(np.int64) >> np.int64(shift)
        out: dict[str, np.ndarray] = {}
        offset = 0
        for f in self.fields:
            chunk = signed[offset:offset + f.size].reshape(f.shape)
            offset += f.size
            if contributors is not None:
                _check_range(f, chunk, contributors, self.max_abs(f))
            out[f.name] = (np.ldexp(chunk.astype(np.float64), -f.frac_bits)
                           if f.kind is Kind.REAL else chunk)
        return out

    def quantisation_bound(self, n_contributors: int) -> dict[str, float]:
        """Stochastic rounding moves each device's value by less than one unit 2^-frac_bits, so a
        sum of n is off by less than n units; counts are exact."""
        return {f.name: n_contributors * 2.0**-f.frac_bits if f.kind is Kind.REAL else 0.0
                for f in self.fields}

    def to_dict(self) -> dict[str, Any]:
        return {"fields": [{"name": f.name, "shape": list(f.shape), "kind": f.kind.value,
                            "clip": f.clip, "frac_bits": f.frac_bits} for f in self.fields]}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PayloadSchema:
        try:
            return cls(tuple(Field(name=d["name"], shape=tuple(d["shape"]), kind=Kind(d["kind"]),
                                   clip=d["clip"], frac_bits=d["frac_bits"])
                             for d in data["fields"]))
        except (KeyError, TypeError) as exc:
            raise CodecError(f"malformed schema dict: {exc!r}") from exc


def _check_range(f: Field, total: np.ndarray, contributors: int, max_abs: int) -> None:
    low, high = (0, contributors * int(f.clip)) if f.kind is Kind.COUNT else (
        -contributors * max_abs, contributors * max_abs)
    outside = (total < low) | (total > high)
    if np.any(outside):
        worst = int(total[outside].flat[0])
        unit = 1 if f.kind is Kind.COUNT else 2.0**-f.frac_bits
        raise CodecError(
            f"field {f.name!r}: {int(np.count_nonzero(outside))} totals outside "
            f"[{low * unit:g}, {high * unit:g}], the range {contributors} contributors can reach "
            f"(first: {worst * unit:g}); a contribution was out of bounds"
        )


def _as_array(f: Field, value: ArrayLike) -> np.ndarray:
    try:
        array = np.asarray(value)
    except (ValueError, TypeError) as exc:
        raise CodecError(f"field {f.name!r}: not an array of shape {f.shape}: {exc}") from exc
    if array.shape != f.shape:
        raise CodecError(f"field {f.name!r}: expected shape {f.shape}, got {array.shape}")
    if array.dtype.kind not in "biuf":
        raise CodecError(f"field {f.name!r}: expected numbers, got dtype {array.dtype}")
    return array.reshape(-1)


def _encode_real(f: Field, values: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, int]:
    values = values.astype(np.float64, copy=False)
    if not np.isfinite(values).all():
        raise CodecError(f"field {f.name!r}: contains NaN or infinite values")
    n_clipped = int(np.count_nonzero(np.abs(values) > f.clip))
    scaled = np.ldexp(np.clip(values, -f.clip, f.clip), f.frac_bits)
    floor = np.floor(scaled)
    rounded = floor + (rng.random(scaled.size) < scaled - floor)
    return rounded.astype(np.int64), n_clipped


def _encode_count(f: Field, values: np.ndarray) -> np.ndarray:
    if values.dtype.kind == "f" and not (np.isfinite(values) & (values == np.floor(values))).all():
        raise CodecError(f"field {f.name!r}: counts must be integers")
    if values.size and (values.min() < 0 or values.max() > f.clip):
        raise CodecError(f"field {f.name!r}: counts must lie in [0, {int(f.clip)}], got values in "
                         f"[{values.min()}, {values.max()}]")
    return values.astype(np.int64)
