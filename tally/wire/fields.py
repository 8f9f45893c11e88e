"""Structural checks shared by every decoder in ``tally.wire``, and the one error they raise.

Each converter module is a trust boundary for structure, and a service must be able to catch one
error type (``WireError``, a ``ValueError``) whichever converter found the fault; so the error and
the checks live here once, and every message reports a missing submessage, an empty or oversized
id, a wrong-size key or a zero device index in the same words, naming the message and field.
Nothing oversized (ids beyond ``MAX_ID_BYTES``, fixed fields of any other size) is ever stored or
relayed to another device.
"""

from __future__ import annotations

from google.protobuf.message import Message


class WireError(ValueError):
    """A protobuf message that does not describe a valid value."""


def message_name(proto: Message) -> str:
    """The message's protobuf name, as errors name it."""
    return type(proto).DESCRIPTOR.name


def submessage(proto: Message, field: str) -> Message:
    """A required submessage: proto3 reports an absent one as empty, which is never valid here."""
    if not proto.HasField(field):
        raise WireError(f"{message_name(proto)}.{field} is missing")
    sub: Message = getattr(proto, field)
    return sub


MAX_ID_BYTES = 256


def id_text(proto: Message, field: str) -> str:
    """A required id: non-empty, at most ``MAX_ID_BYTES`` characters."""
    value: str = getattr(proto, field)
    if not value:
        raise WireError(f"{message_name(proto)}.{field} is missing (empty)")
    if len(value) > MAX_ID_BYTES:
        raise WireError(
            f"{message_name(proto)}.{field}: at most {MAX_ID_BYTES} characters, got {len(value)}"
        )
    return value


def fixed_bytes(proto: Message, field: str, size: int, value: bytes | None = None) -> bytes:
    """A bytes field of exactly ``size`` bytes."""
    value = getattr(proto, field) if value is None else value
    if len(value) != size:
        raise WireError(f"{message_name(proto)}.{field} must be {size} bytes, got {len(value)}")
    return value


def device_index(proto: Message, field: str, value: int | None = None) -> int:
    """A 1-based device index; 0 is what proto3 reads for an absent field."""
    value = getattr(proto, field) if value is None else value
    if value < 1:
        raise WireError(f"{message_name(proto)}.{field}: device indices are 1-based, got {value}")
    return int(value)


def device_indices(proto: Message, field: str) -> tuple[int, ...]:
    """A repeated field of 1-based device indices."""
    values = tuple(getattr(proto, field))
    if values and min(values) < 1:
        device_index(proto, field, next(v for v in values if v < 1))  # raises, naming the field
    return values

