"""Byte layouts both halves of the protocol must agree on."""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterable

from tally.secagg import shamir
from tally.secagg.messages import SessionRef

GCM_TAG_BYTES = 16
# A share message carries the mask-key share and the self-mask-seed share of one sum.
SHARE_PLAINTEXT_BYTES = 2 * shamir.SHARE_BYTES
SHARE_CIPHERTEXT_BYTES = SHARE_PLAINTEXT_BYTES + GCM_TAG_BYTES


def share_associated_data(ref: SessionRef, sum_id: str, sender: int, recipient: int) -> bytes:
    """Binds a ciphertext to its session, sum and route: the server cannot re-address it."""
    return ref.context(sum_id) + b"|share|%d>%d" % (sender, recipient)


def consistency_message(ref: SessionRef, sum_id: str, survivors: Iterable[int]) -> bytes:
    """What a device signs in ConsistencyCheck: this session's sum and its survivor set."""
    digest = hashlib.sha256(",".join(str(int(i)) for i in survivors).encode()).digest()
    return b"tally/consistency|" + ref.context(sum_id) + b"|" + digest


def payload_bytes(message: object) -> int:
    """Bytes a message carries (keys, ciphertexts, masked vectors, 4 per integer id).

    Transport framing is left out: it is the services' to measure.
    """
    kind = type(message)
    if kind is bytes or kind is str:
        return len(message)
    if kind is int:
        return 4
    if kind is tuple:
        return sum(map(payload_bytes, message))
    names = _FIELDS.get(kind)
    if names is None:
        names = _FIELDS[kind] = tuple(f.name for f in dataclasses.fields(message) if f.name != "ref")
    return sum(payload_bytes(getattr(message, name)) for name in names)


_FIELDS: dict[type, tuple[str, ...]] = {}
