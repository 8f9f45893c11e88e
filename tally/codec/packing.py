"""Wire format for ring vectors: exactly ``bits`` bits per value, little-endian.

Uploads dominate a device's traffic, so a 31-bit ring must cost 31 bits per value, not 64. Byte
widths are plain dtype views. Other widths are read and written a machine word at a time: the
bit stream, seen as little-endian words (32-bit for rings up to 32 bits, 64-bit above), repeats
the same pattern every ``period`` values, so one row of words per period makes every value's
word, shift and spill into the next word a fixed column of a 2-d array, and packing or unpacking
a whole vector is a handful of vectorised shifts and adds instead of a pass per bit.

The server never needs the uploads one by one, only their sum: ``PackedSum`` adds packed vectors
without unpacking them. A value's spill into the next word is a left shift, which commutes with
addition mod 2^word, so the raw words are summed and the spills applied once at the end; only
the right shifts, which do not commute, are paid per upload (per batch of small uploads).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from tally.codec.schema import CodecError, ring_dtype, ring_mask

_BYTE_WIDTHS = (8, 16, 32, 64)


def wire_width(bits: int) -> int:
    """Bits per value on the wire for a ring of 2**bits.

    The next machine width when it costs at most 10% more bytes, so neither side shifts
    bits; otherwise exactly ``bits``, so a 20-bit ring never pays for 32.
    """
    ring_mask(bits)
    native = next(w for w in _BYTE_WIDTHS if w >= bits)
    return native if native <= 1.1 * bits else bits


def packed_size(count: int, bits: int) -> int:
    ring_mask(bits)  # rejects widths outside 1..64
    if count < 0:
        raise CodecError(f"count must be >= 0, got {count}")
    return (count * bits + 7) // 8


@dataclass(frozen=True)
class _Start:
    """The values that start in a word as its ``rank``-th value: which words, which positions of
    the period, and where in the word they start."""

    words: np.ndarray
    positions: np.ndarray
    shifts: np.ndarray


@dataclass(frozen=True)
class _Layout:
    """Where each of the ``period`` values of a row sits in the row's ``row_words`` words."""

    bits: int
    word_bits: int
    period: int
    row_words: int
    starts: tuple[_Start, ...]  # starts[0]: the first value of every word (each word has one)
    # Per position (in the order of ``starts``' positions): the next word and the left shift that
    # puts that word's bits in place; a shift of word_bits (zero) where the value does not spill.
    next_words: np.ndarray
    next_shifts: np.ndarray
    # Per word after the first: the last value starting in the word before, and the right shift
    # that leaves the part of it that spills into this word (all of it shifted out if none).
    carry_positions: np.ndarray
    carry_shifts: np.ndarray

    @property
    def word(self) -> np.dtype:
        return np.dtype(f"<u{self.word_bits // 8}")

    def rows(self, count: int) -> int:
        return -(-count // self.period)

    @functools.cached_property
    def position_order(self) -> np.ndarray:
        """Column of each position in the starts' concatenated order."""
        return np.argsort(np.concatenate([s.positions for s in self.starts]))


@functools.cache
def _layout(bits: int) -> _Layout:
    word_bits = 32 if bits <= 32 else 64
    shift_type = f"u{word_bits // 8}"
    period = word_bits // math.gcd(bits, word_bits)
    row_words = period * bits // word_bits
    by_word: list[list[tuple[int, int]]] = [[] for _ in range(row_words)]
    for position in range(period):
        word, shift = divmod(position * bits, word_bits)
        by_word[word].append((position, shift))
    starts = []
    for rank in range(max(len(w) for w in by_word)):
        ranked = [(w, *entries[rank]) for w, entries in enumerate(by_word) if len(entries) > rank]
        words, positions, shifts = (np.array(column) for column in zip(*ranked))
        starts.append(_Start(words, positions, shifts.astype(shift_type)))
    next_words, next_shifts = [], []
    for start in starts:
        for word, shift in zip(start.words.tolist(), start.shifts.tolist()):
            spills = shift + bits > word_bits
            next_words.append(word + 1 if spills else word)
            next_shifts.append(word_bits - shift if spills else word_bits)
    carry_positions, carry_shifts = [], []
    for word in range(1, row_words):
        position, shift = by_word[word - 1][-1]
        carry_positions.append(position)
        carry_shifts.append(word_bits - shift if shift + bits > word_bits else word_bits)
    return _Layout(bits, word_bits, period, row_words, tuple(starts), np.array(next_words),
                   np.array(next_shifts, dtype=shift_type), np.array(carry_positions, dtype=np.int64),
                   np.array(carry_shifts, dtype=shift_type))


@functools.lru_cache(maxsize=16)
def _tiled(shifts: bytes, dtype: str, rows: int) -> np.ndarray:
    """A row's shifts repeated for ``rows`` rows, flat: one long contiguous shift runs at SIMD
    speed, a short row broadcast down many rows does not."""
    tiled = np.tile(np.frombuffer(shifts, dtype=dtype), rows)
    tiled.setflags(write=False)
    return tiled


def _shift_tile(shifts: np.ndarray, rows: int) -> np.ndarray:
    return _tiled(shifts.tobytes(), shifts.dtype.str, rows)


def pack(values: np.ndarray, bits: int) -> bytes:
    """Refuses values >= 2^bits instead of truncating them: a truncated value is a corrupt sum."""
    values = np.asarray(values)
    mask = ring_mask(bits)
    if values.ndim != 1 or values.dtype.kind not in "iu":
        raise CodecError(f"pack needs a 1-D integer vector, got dtype {values.dtype} "
                         f"shape {values.shape}")
    if values.size and ((values.dtype.kind == "i" and int(values.min()) < 0)
                        or int(values.max()) > mask):
        raise CodecError(f"values must lie in [0, 2^{bits}), got [{values.min()}, {values.max()}]")
    if bits in _BYTE_WIDTHS:
        return values.astype(f"<u{bits // 8}", copy=False).tobytes()
    layout = _layout(bits)
    rows = layout.rows(values.size)
    padded = np.zeros((rows, layout.period), dtype=layout.word)
    padded.ravel()[: values.size] = values
    first, *others = layout.starts
    words = np.take(padded, first.positions, axis=1)  # every word has a first value
    np.left_shift(words.ravel(), _shift_tile(first.shifts, rows), out=words.ravel())
    # Bit ranges of different values never overlap, so adding the shifted pieces is OR-ing them.
    for start in others:
        piece = np.take(padded, start.positions, axis=1)
        np.left_shift(piece.ravel(), _shift_tile(start.shifts, rows), out=piece.ravel())
        words[:, start.words] += piece
    if layout.row_words > 1:
        carry = np.take(padded, layout.carry_positions, axis=1)
        np.right_shift(carry.ravel(), _shift_tile(layout.carry_shifts, rows), out=carry.ravel())
        words[:, 1:] += carry
    return words.view(np.uint8).ravel()[: packed_size(values.size, bits)].tobytes()


class _LaterRank:
    """The running sum of the values that start second (third, ...) in their word.

    Only some columns of a row hold such a value. One column (28 bits: two values in a row's
    first word) is read as a strided view and shifted by a scalar, without copying it; several
    are gathered into a buffer kept from one batch to the next, so the gather allocates nothing
    (take's default mode would copy that buffer on every call, to restore it on error)."""

    def __init__(self, start: _Start, acc: np.ndarray, rows: int, batch: int = 1) -> None:
        self.acc = acc
        self.buffer = np.empty((batch, rows, len(start.words)), dtype=acc.dtype)
        self.column = int(start.words[0]) if len(start.words) == 1 else None
        self.columns = start.words
        self.shifts = start.shifts[0] if self.column is not None else _shift_tile(start.shifts, rows)

    def add(self, by_row: np.ndarray) -> None:
        """Add uploads given as (uploads, rows, row words)."""
        count = len(by_row)
        buffer = self.buffer[:count]
        pieces = buffer.reshape(count, -1)
        if self.column is not None:
            np.right_shift(by_row[:, :, self.column], self.shifts, out=pieces)
        else:
            np.take(by_row, self.columns, axis=2, out=buffer, mode="clip")
            np.right_shift(pieces, self.shifts, out=pieces)
        _add_rows(self.acc, pieces)


# Small uploads are added a batch at a time: on a 10^4-value upload numpy's fixed cost per call
# outweighs the shifts themselves, and a batch of them shares it. The batch stays within L2, past
# which its passes run from memory and cost more than they share (10^5 values: one at a time).
_BATCH_BYTES = 1 << 19
_BATCH_MAX = 32


class PackedSum:
    """The ring sum of packed vectors of ``count`` values at ``bits`` bits, added as they arrive,
    without materialising an unpacked copy of any of them.

    Uploads of a width that is not a byte width are queued as raw words, at most ``batch`` of
    them (by default as many as fit in 512 KiB, at most 32), and added together; ``total`` adds
    whatever is queued.
    """

    def __init__(self, count: int, bits: int, batch: int | None = None) -> None:
        self.count = count
        self.bits = bits
        self.size = packed_size(count, bits)
        self.added = 0
        if batch is not None and batch < 1:
            raise ValueError(f"batch must be >= 1, got {batch}")
        if bits in _BYTE_WIDTHS:
            self._layout = None
            self._total = np.zeros(count, dtype=ring_dtype(bits))
            return
        layout = self._layout = _layout(bits)
        self._rows = rows = layout.rows(count)
        word = layout.word
        n_words = rows * layout.row_words
        if batch is None:
            batch = max(1, min(_BATCH_MAX, _BATCH_BYTES // max(1, n_words * word.itemsize)))
        self._batch = batch
        # Queued uploads, one per row, zero past each upload's last byte (an upload that fills
        # its words exactly is read in place when it is added alone: no rows then).
        self._in_place = batch == 1 and n_words * word.itemsize == self.size
        self._queue = np.zeros((0 if self._in_place else batch, n_words), dtype=word)
        self._queued = 0
        # Per start rank: the sum of each value's word shifted down to the value (mod 2^word).
        self._shifted = [np.zeros(rows * len(s.words), dtype=word) for s in layout.starts]
        # The plain sum of the words, for the spills (a left shift commutes with the sum).
        spills = bool(np.any(layout.next_shifts < layout.word_bits))
        self._words = np.zeros(n_words, dtype=word) if spills else None
        self._scratch = np.empty((batch, n_words), dtype=word)
        self._first_shifts = _shift_tile(layout.starts[0].shifts, rows)
        self._later = [_LaterRank(start, acc, rows, batch)
                       for start, acc in zip(layout.starts[1:], self._shifted[1:])]

    def add(self, data: bytes) -> None:
        """Add one packed vector; the length check is what rejects a truncated or padded one."""
        if len(data) != self.size:
            raise CodecError(f"packed data for {self.count} values at {self.bits} bits must be "
                             f"{self.size} bytes, got {len(data)}")
        self.added += 1
        if self._layout is None:
            view = np.frombuffer(data, dtype=f"<u{self.bits // 8}", count=self.count)
            np.add(self._total, view, out=self._total)
            return
        if self._in_place:
            self._add_words(np.frombuffer(data, dtype=self._layout.word)[None, :])
            return
        self._queue.view(np.uint8)[self._queued, : self.size] = np.frombuffer(data, dtype=np.uint8)
        self._queued += 1
        if self._queued == self._batch:
            self._flush()

    def _flush(self) -> None:
        if self._queued:
            self._add_words(self._queue[: self._queued])
            self._queued = 0  # after the add: a failed one raises with the uploads still counted as queued

    def _add_words(self, words: np.ndarray) -> None:
        """Add uploads given as rows of words, (uploads, words)."""
        layout = self._layout
        assert layout is not None  # only uploads of packed widths come as words
        scratch = self._scratch[: len(words)]
        np.right_shift(words, self._first_shifts, out=scratch)
        _add_rows(self._shifted[0], scratch)
        if self._words is not None:
            _add_rows(self._words, words)
        by_row = words.reshape(len(words), self._rows, layout.row_words)
        for later in self._later:
            later.add(by_row)

    def total(self) -> np.ndarray:
        """The sum mod 2^bits, in the ring's dtype."""
        mask = ring_mask(self.bits)
        if self._layout is None:
            out = self._total.copy()
        else:
            self._flush()
            layout, rows = self._layout, self._rows
            by_rank = np.concatenate(
                [acc.reshape(rows, len(s.words)) for s, acc in zip(layout.starts, self._shifted)], axis=1
            )
            values = np.take(by_rank, layout.position_order, axis=1)
            if self._words is not None:
                spilled = np.take(self._words.reshape(rows, layout.row_words), layout.next_words, axis=1)
                np.left_shift(spilled.ravel(), _shift_tile(layout.next_shifts, rows), out=spilled.ravel())
                values += np.take(spilled, layout.position_order, axis=1)
            out = values.ravel()[: self.count].astype(ring_dtype(self.bits))
        np.bitwise_and(out, out.dtype.type(mask), out=out)
        return out


def _add_rows(acc: np.ndarray, rows: np.ndarray) -> None:
    """acc += the sum of ``rows`` (uploads, n), mod 2^word."""
    if len(rows) == 1:
        np.add(acc, rows[0], out=acc)
    else:
        np.add(acc, rows.sum(axis=0, dtype=acc.dtype), out=acc)


def unpack(data: bytes, bits: int, count: int) -> np.ndarray:
    """Inverse of ``pack``; the length check is what rejects a truncated or padded upload."""
    packed_sum = PackedSum(count, bits, batch=1)
    packed_sum.add(data)
    return packed_sum.total()
