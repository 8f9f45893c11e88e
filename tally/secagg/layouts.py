"""Byte layouts both halves of the protocol must agree on."""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterable

import numpy as np

from tally.secagg import sharecheck
from tally.secagg.errors import MalformedMessage
from tally.secagg.messages import SessionRef, SumPublicKeys

GCM_TAG_BYTES = 16
# A share message carries the mask-key share and the self-mask-seed share of one sum, and the
# holder's value of the dealer's blinding polynomial (``sharecheck``): three scalars.
SHARE_PLAINTEXT_BYTES = sharecheck.PLAINTEXT_BYTES
SHARE_CIPHERTEXT_BYTES = SHARE_PLAINTEXT_BYTES + GCM_TAG_BYTES
COMMITMENT_BYTES = 32


def share_associated_data(ref: SessionRef, sum_id: str, sender: int, recipient: int) -> bytes:
    """Binds a ciphertext to its session, sum and route: the server cannot re-address it."""
    return ref.context(sum_id) + b"|share|%d>%d" % (sender, recipient)


def _fields(*parts: bytes) -> bytes:
    """Length-prefixed concatenation: no two different field lists encode alike."""
    return b"".join(len(p).to_bytes(4, "big") + p for p in parts)


def _ref_fields(ref: SessionRef, sum_id: str) -> bytes:
    return _fields(ref.job_id.encode(), str(ref.round).encode(), ref.session_id.encode(), sum_id.encode())


def advertise_statement(ref: SessionRef, sender: int, keys: Iterable[SumPublicKeys]) -> bytes:
    """What a device signs with its identity key in AdvertiseKeys: its session keys and seed
    commitments, bound to this session and its own index."""
    parts = [b"tally/advertise", _ref_fields(ref, ""), str(int(sender)).encode()]
    for k in keys:
        parts += [k.sum_id.encode(), k.cipher_public, k.mask_public, k.seed_commitment]
    return _fields(*parts)


def consistency_message(ref: SessionRef, sum_id: str, signer: int, view: Iterable[int]) -> bytes:
    """What device ``signer`` signs in ConsistencyCheck: this session's sum and its view, the
    survivors among itself and its neighbours. Views are local (O(k) per device, not O(n)): what
    makes a split view useless is that every device's status is signed by t of its own
    neighbours, each of which signs one view (see ``tally.secagg.client``)."""
    digest = hashlib.sha256(np.asarray(view, dtype="<u8").tobytes()).digest()
    return b"tally/consistency|" + ref.context(sum_id) + b"|%d|" % int(signer) + digest


def payload_bytes(message: object) -> int:
    """Bytes a message carries (keys, ciphertexts, masked vectors, 4 per integer id).

    Transport framing is left out: it is the services' to measure.
    """
    kind = type(message)
    if type(message) is bytes or type(message) is str:
        return len(message)
    if type(message) is int:
        return 4
    if type(message) is tuple:
        return sum(map(payload_bytes, message))
    names = _FIELDS.get(kind)
    if names is None:
        if not dataclasses.is_dataclass(message):
            raise TypeError(f"{kind.__name__} is not a message")
        names = _FIELDS[kind] = tuple(f.name for f in dataclasses.fields(message) if f.name != "ref")
    return sum(payload_bytes(getattr(message, name)) for name in names)


_FIELDS: dict[type, tuple[str, ...]] = {}


def device_list(values: object, what: str) -> np.ndarray:
    """A list of integer device indices as an array; anything else (floats, strings, nesting) is
    malformed rather than quietly converted. ``what`` names the list in the error."""
    try:
        array = np.asarray(values)
    except (TypeError, ValueError):
        array = None
    if array is None or array.ndim != 1 or (array.size and array.dtype.kind not in "iu"):
        raise MalformedMessage(f"{what} must be a list of device indices")
    return array.astype(np.int64)
