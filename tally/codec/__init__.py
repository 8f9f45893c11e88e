"""Fixed-point payload codec: schemas that put named fields in Z_{2^b}; the b-bit wire format."""

from tally.codec.packing import pack, packed_size, unpack, wire_width
from tally.codec.schema import (
    CodecError,
    Encoded,
    Field,
    Kind,
    OverflowRefused,
    PayloadSchema,
    ring_dtype,
    ring_mask,
    to_ring,
)

__all__ = [
    "CodecError",
    "Encoded",
    "Field",
    "Kind",
    "OverflowRefused",
    "PayloadSchema",
    "pack",
    "packed_size",
    "ring_dtype",
    "ring_mask",
    "to_ring",
    "unpack",
    "wire_width",
]
