"""Wire format for ring vectors: exactly ``bits`` bits per value, little-endian.

Uploads dominate a device's traffic, so a 31-bit ring must cost 31 bits per value, not 64. Byte
widths are plain dtype views; other widths go through a bit array, built a chunk at a time so that
the 8x expansion of np.unpackbits stays a few MiB however long the vector is.
"""

from __future__ import annotations

import numpy as np

from tally.codec.schema import CodecError, ring_dtype, ring_mask

# Values per chunk of the bit-array path; a multiple of 8 so that every chunk starts on a byte.
_CHUNK = 1 << 16
_BYTE_WIDTHS = (8, 16, 32, 64)


def _bytes_per_value(bits: int) -> int:
    return (bits + 7) // 8


def wire_width(bits: int) -> int:
    """Bits per value on the wire for a ring of 2**bits.

    The next machine width when it costs at most 10% more bytes, so neither side shifts
    bits (unpacking 100k 30-bit values costs ~60x a vector add; a uint32 view is free);
    otherwise exactly ``bits``, so a 20-bit ring never pays for 32.
    """
    ring_mask(bits)
    native = next(w for w in _BYTE_WIDTHS if w >= bits)
    return native if native <= 1.1 * bits else bits


def packed_size(count: int, bits: int) -> int:
    ring_mask(bits)  # rejects widths outside 1..64
    if count < 0:
        raise CodecError(f"count must be >= 0, got {count}")
    return (count * bits + 7) // 8


def pack(values: np.ndarray, bits: int) -> bytes:
    """Refuses values >= 2^bits instead of truncating them: a truncated value is a corrupt sum."""
    values = np.asarray(values)
    mask = ring_mask(bits)
    if values.ndim != 1 or values.dtype.kind not in "iu":
        raise CodecError(f"pack needs a 1-D integer vector, got dtype {values.dtype} "
                         f"shape {values.shape}")
    if values.size and (int(values.min()) < 0 or int(values.max()) > mask):
        raise CodecError(f"values must lie in [0, 2^{bits}), got [{values.min()}, {values.max()}]")
    if bits in _BYTE_WIDTHS:
        return values.astype(f"<u{bits // 8}", copy=False).tobytes()
    wide = values.astype("<u8")
    out = np.empty(packed_size(values.size, bits), dtype=np.uint8)
    for start in range(0, wide.size, _CHUNK):
        chunk = wide[start:start + _CHUNK]
        low_bytes = chunk.view(np.uint8).reshape(-1, 8)[:, :_bytes_per_value(bits)]
        value_bits = np.unpackbits(low_bytes, axis=1, bitorder="little")[:, :bits]
        packed = np.packbits(value_bits, bitorder="little")
        first = start * bits // 8
        out[first:first + packed.size] = packed
    return out.tobytes()


def unpack(data: bytes, bits: int, count: int) -> np.ndarray:
    """Inverse of ``pack``; the length check is what rejects a truncated or padded upload."""
    expected = packed_size(count, bits)
    if len(data) != expected:
        raise CodecError(f"packed data for {count} values at {bits} bits must be {expected} "
                         f"bytes, got {len(data)}")
    dtype = ring_dtype(bits)
    if bits in _BYTE_WIDTHS:
        return np.frombuffer(data, dtype=f"<u{bits // 8}", count=count).astype(dtype)
    raw = np.frombuffer(data, dtype=np.uint8)
    out = np.empty(count, dtype=dtype)
    for start in range(0, count, _CHUNK):
        n = min(_CHUNK, count - start)
        first = start * bits // 8
        chunk_bits = np.unpackbits(raw[first:first + packed_size(n, bits)], count=n * bits,
                                   bitorder="little").reshape(n, bits)
        value_bits = np.zeros((n, 8 * _bytes_per_value(bits)), dtype=np.uint8)
        value_bits[:, :bits] = chunk_bits
        value_bytes = np.zeros((n, 8), dtype=np.uint8)
        value_bytes[:, :_bytes_per_value(bits)] = np.packbits(value_bits, axis=1, bitorder="little")
        out[start:start + n] = value_bytes.view("<u8")[:, 0]
    return out
