"""The codec's promises: sums decode exactly (counts) or within the stated bound (reals), nothing
wraps or clips silently, rounding is unbiased, and the wire format costs exactly b bits a value."""

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tally.codec import (
    CodecError,
    Field,
    Kind,
    OverflowRefused,
    PayloadSchema,
    pack,
    packed_size,
    ring_dtype,
    ring_mask,
    to_ring,
    unpack,
    wire_width,
)
from tally.codec.packing import PackedSum


def reference_pack(values: list[int], bits: int) -> bytes:
    """Bit-by-bit definition of the wire format, independent of the numpy implementation."""
    acc = 0
    for i, v in enumerate(values):
        acc |= v << (i * bits)
    return acc.to_bytes(packed_size(len(values), bits), "little")


def ring_sum(vectors: list[np.ndarray], bits: int) -> np.ndarray:
    """What the aggregator computes: the sum of the devices' ring elements mod 2^bits."""
    acc = np.zeros(vectors[0].size, dtype=np.uint64)
    for v in vectors:
        acc += to_ring(v, bits).astype(np.uint64)  # wraps mod 2^64, and 2^bits divides 2^64
    return (acc & np.uint64(ring_mask(bits))).astype(ring_dtype(bits))


# --- packing ---------------------------------------------------------------------------------

@st.composite
def bit_vectors(draw):
    bits = draw(st.integers(1, 64))
    values = draw(st.lists(st.integers(0, 2**bits - 1), max_size=300))
    return bits, values


@given(bit_vectors())
def test_pack_matches_reference_and_round_trips(case):
    bits, values = case
    array = np.array(values, dtype=np.uint64)
    data = pack(array, bits)
    assert len(data) == packed_size(len(values), bits) == (len(values) * bits + 7) // 8
    assert data == reference_pack(values, bits)
    out = unpack(data, bits, len(values))
    assert out.dtype == ring_dtype(bits)
    assert out.tolist() == values


def test_pack_known_bytes():
    assert pack(np.array([1, 2, 3], dtype=np.uint32), 4) == bytes([0x21, 0x03])
    assert pack(np.array([0xABC, 0x123], dtype=np.uint32), 12) == bytes([0xBC, 0x3A, 0x12])
    assert pack(np.array([1, 2], dtype=np.uint32), 32) == np.array([1, 2], "<u4").tobytes()


@st.composite
def packed_sums(draw):
    """Several vectors at one wire width: any ring width, or one the planner's wire_width picks
    (word-sized or not), and lengths that end inside a row of the packing as well as on one."""
    bits = draw(st.one_of(st.integers(1, 64), st.integers(1, 64).map(wire_width)))
    count = draw(st.one_of(st.integers(0, 200), st.sampled_from([64, 128, 640, 641, 1001])))
    seeds = draw(st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=6))
    dtype = ring_dtype(bits)
    vectors = [
        np.random.default_rng(seed).integers(0, 2**bits, count, dtype=np.uint64).astype(dtype)
        for seed in seeds
    ]
    return bits, vectors


@settings(max_examples=300)
@given(packed_sums(), st.one_of(st.none(), st.integers(1, 4)))
def test_packed_sum_is_the_ring_sum_of_the_unpacked_vectors(case, batch):
    """Whatever the batch of queued uploads (the default, or one that fills and is added several
    times before ``total``), and ``total`` read in between."""
    bits, vectors = case
    count = vectors[0].size
    total = PackedSum(count, bits, batch=batch)
    for k, v in enumerate(vectors):
        data = pack(v, bits)
        assert data == reference_pack(v.tolist(), bits)
        total.add(data)
        if k == 0:
            assert total.total().tolist() == v.tolist()
    expected = [sum(int(v[j]) for v in vectors) % 2**bits for j in range(count)]
    result = total.total()
    assert result.dtype == ring_dtype(bits)
    assert result.tolist() == expected
    assert total.added == len(vectors)


@pytest.mark.parametrize("bits", [13, 27, 31, 32, 33, 57, 58])
def test_pack_round_trips_many_rows_and_a_partial_one(bits):
    values = np.random.default_rng(bits).integers(0, 2**bits, size=10_001, dtype=np.uint64)
    whole = pack(values, bits)
    assert whole == reference_pack(values.tolist(), bits)
    assert np.array_equal(unpack(whole, bits, values.size), values)


@pytest.mark.parametrize("delta", [-1, 1])
def test_packed_sum_rejects_wrong_length_and_keeps_its_total(delta):
    values = np.arange(100, dtype=np.uint32)
    total = PackedSum(100, 27)
    total.add(pack(values, 27))
    data = pack(values, 27)
    with pytest.raises(CodecError, match="338 bytes"):
        total.add(data[:delta] if delta < 0 else data + b"\0")
    assert total.total().tolist() == values.tolist() and total.added == 1


def test_pack_refuses_out_of_range_values():
    with pytest.raises(CodecError):
        pack(np.array([2**20], dtype=np.uint32), 20)
    with pytest.raises(CodecError):
        pack(np.array([-1], dtype=np.int64), 20)


@pytest.mark.parametrize("delta", [-1, 1])
def test_unpack_rejects_wrong_length(delta):
    data = pack(np.arange(10, dtype=np.uint32), 20)
    with pytest.raises(CodecError, match="25 bytes"):
        unpack(data[:delta] if delta < 0 else data + b"\0", 20, 10)


# --- ring helpers ----------------------------------------------------------------------------

def test_to_ring_is_twos_complement():
    assert ring_mask(20) == 2**20 - 1
    small = to_ring(np.array([-1, 0, 5], dtype=np.int64), 20)
    assert small.dtype == np.uint32 and small.tolist() == [2**20 - 1, 0, 5]
    big = to_ring(np.array([-1, -(2**40)], dtype=np.int64), 64)
    assert big.dtype == np.uint64 and big.tolist() == [2**64 - 1, 2**64 - 2**40]
    for bits in (0, 65):
        with pytest.raises(CodecError):
            ring_dtype(bits)


# --- sums ------------------------------------------------------------------------------------

@st.composite
def fields(draw, name):
    shape = tuple(draw(st.lists(st.integers(1, 4), max_size=2)))
    if draw(st.booleans()):
        return Field(name, shape, Kind.REAL, clip=draw(st.floats(0.01, 100.0)),
                     frac_bits=draw(st.integers(0, 24)))
    return Field(name, shape, Kind.COUNT, clip=draw(st.integers(1, 1000)))


@st.composite
def schemas(draw):
    n_fields = draw(st.integers(1, 3))
    return PayloadSchema(tuple(draw(fields(f"f{i}")) for i in range(n_fields)))


def random_payload(schema: PayloadSchema, rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {f.name: (rng.uniform(-1.5 * f.clip, 1.5 * f.clip, f.shape) if f.kind is Kind.REAL
                     else rng.integers(0, int(f.clip), size=f.shape, endpoint=True))
            for f in schema.fields}


@settings(max_examples=150, deadline=None)
@given(schemas(), st.integers(1, 50), st.integers(0, 2**32 - 1))
def test_sum_decodes_within_bound(schema, n, seed):
    rng = np.random.default_rng(seed)
    bits = schema.required_bits(n)
    schema.check_bits(n, bits)
    payloads = [random_payload(schema, rng) for _ in range(n)]
    encoded = [schema.encode(p, rng) for p in payloads]
    for payload, enc in zip(payloads, encoded):
        assert enc.vector.dtype == np.int64 and enc.vector.shape == (schema.dim,)
        for f in schema.fields:
            assert enc.clipped[f.name] == np.count_nonzero(np.abs(payload[f.name]) > f.clip)

    decoded = schema.decode_sum(ring_sum([e.vector for e in encoded], bits), bits)
    bound = schema.quantisation_bound(n)
    for f in schema.fields:
        exact = sum(np.clip(p[f.name], -f.clip, f.clip) for p in payloads)
        assert decoded[f.name].shape == f.shape
        if f.kind is Kind.COUNT:
            assert decoded[f.name].dtype == np.int64
            assert np.array_equal(decoded[f.name], exact)
        else:
            assert decoded[f.name].dtype == np.float64
            slack = 1e-12 * (1 + np.abs(exact))  # float error of the reference sum itself
            assert np.all(np.abs(decoded[f.name] - exact) <= bound[f.name] + slack)


def extreme_schema(frac_bits: int) -> PayloadSchema:
    return PayloadSchema((Field("w", (3,), clip=1.0, frac_bits=frac_bits),))


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_required_bits_is_tight(sign):
    schema, n = extreme_schema(19), 1024
    bits = schema.required_bits(n)
    assert bits == 31
    rng = np.random.default_rng(0)
    vectors = [schema.encode({"w": np.full(3, sign)}, rng).vector for _ in range(n)]
    assert schema.decode_sum(ring_sum(vectors, bits), bits)["w"].tolist() == [sign * n] * 3
    if sign > 0:  # one bit less and the largest positive sum wraps to negative
        assert schema.decode_sum(ring_sum(vectors, bits - 1), bits - 1)["w"].tolist() == [-n] * 3


def test_32_bit_ring_wraps_natively_in_uint32():
    schema, n = extreme_schema(20), 1024
    assert schema.required_bits(n) == 32
    rng = np.random.default_rng(0)
    total = np.zeros(3, dtype=np.uint32)
    for _ in range(n):
        total += to_ring(schema.encode({"w": np.array([-1.0, 1.0, -0.25])}, rng).vector, 32)
    assert schema.decode_sum(total, 32)["w"].tolist() == [-n, n, -n / 4]


# --- clipping and rounding -------------------------------------------------------------------

def test_clipping_is_counted():
    schema = PayloadSchema((Field("w", (2, 3), clip=1.0, frac_bits=4),
                            Field("c", (2,), Kind.COUNT, clip=3)))
    values = np.array([[2.0, -3.0, 0.5], [1.0, -1.0, 1.0001]])
    enc = schema.encode({"w": values, "c": [0, 3]}, np.random.default_rng(0))
    assert enc.clipped == {"w": 3, "c": 0}
    assert enc.vector.tolist() == [16, -16, 8, 16, -16, 16, 0, 3]


def test_stochastic_rounding_is_unbiased():
    f, n = 8, 50_000
    units = np.array([0.3, 2.3, -0.3, -2.7])
    schema = PayloadSchema((Field("w", (4, n), clip=1.0, frac_bits=f),))
    enc = schema.encode({"w": np.repeat(units[:, None] * 2.0**-f, n, axis=1)},
                        np.random.default_rng(1234))
    rows = enc.vector.reshape(4, n)
    assert np.all((rows == np.floor(units)[:, None]) | (rows == np.ceil(units)[:, None]))
    p = units - np.floor(units)
    tolerance = 5 * np.sqrt(p * (1 - p) / n)
    assert np.all(np.abs(rows.mean(axis=1) - units) < tolerance)


def test_encoding_is_reproducible_from_the_seed():
    schema = extreme_schema(10)
    a = schema.encode({"w": [0.1, 0.2, 0.3]}, np.random.default_rng(7)).vector
    b = schema.encode({"w": [0.1, 0.2, 0.3]}, np.random.default_rng(7)).vector
    assert np.array_equal(a, b)


# --- overflow --------------------------------------------------------------------------------

def test_check_bits_refuses_a_ring_that_could_wrap():
    schema = extreme_schema(19)
    schema.check_bits(1024, 31)
    with pytest.raises(OverflowRefused) as info:
        schema.check_bits(1024, 30)
    message = str(info.value)
    assert "'w'" in message and "1024" in message and "31" in message and "30" in message


def test_check_bits_refuses_more_than_64_bits():
    schema = PayloadSchema((Field("big", (1,), clip=2.0**20, frac_bits=40),))
    assert schema.required_bits(16) == 66
    with pytest.raises(OverflowRefused):
        schema.check_bits(16, 64)


def test_schema_refuses_a_field_that_cannot_fit_one_value():
    with pytest.raises(OverflowRefused, match="huge"):
        PayloadSchema((Field("huge", (1,), clip=2.0**30, frac_bits=40),))


@pytest.mark.parametrize("n", [1, 2, 100, 1024])
def test_20_bit_precision_upload_is_at_most_1_1_x_float32(n):
    schema, dim = PayloadSchema((Field("w", (1000,), clip=1.0, frac_bits=19),)), 1000
    assert packed_size(dim, schema.required_bits(n)) <= 1.1 * 4 * dim


# --- errors ----------------------------------------------------------------------------------

MIXED = PayloadSchema((Field("w", (2,), clip=1.0), Field("c", (2,), Kind.COUNT, clip=5)))


@pytest.mark.parametrize("payload, message", [
    ({"w": [0.0, 0.0]}, "missing"),
    ({"w": [0.0, 0.0], "c": [1, 1], "x": [0]}, "unexpected"),
    ({"w": [0.0, 0.0, 0.0], "c": [1, 1]}, "shape"),
    ({"w": [[0.0, 0.0]], "c": [1, 1]}, "shape"),
    ({"w": [0.0, np.nan], "c": [1, 1]}, "NaN"),
    ({"w": [np.inf, 0.0], "c": [1, 1]}, "infinite"),
    ({"w": ["a", "b"], "c": [1, 1]}, "numbers"),
    ({"w": [0.0, 0.0], "c": [-1, 1]}, r"\[0, 5\]"),
    ({"w": [0.0, 0.0], "c": [1.5, 1]}, "integers"),
    ({"w": [0.0, 0.0], "c": [6, 1]}, r"\[0, 5\]"),
])
def test_encode_rejects_bad_payloads(payload, message):
    with pytest.raises(CodecError, match=message):
        MIXED.encode(payload, np.random.default_rng(0))


def test_float_counts_that_are_integral_are_accepted():
    enc = MIXED.encode({"w": [0.0, 0.0], "c": np.array([2.0, 5.0])}, np.random.default_rng(0))
    assert enc.vector[2:].tolist() == [2, 5]


@pytest.mark.parametrize("kwargs", [
    {"name": "", "shape": (1,)},
    {"name": "w", "shape": (0,)},
    {"name": "w", "shape": (2, -1)},
    {"name": "w", "shape": (1,), "clip": 0.0},
    {"name": "w", "shape": (1,), "clip": float("inf")},
    {"name": "w", "shape": (1,), "frac_bits": 41},
    {"name": "w", "shape": (1,), "frac_bits": -1},
    {"name": "w", "shape": (1,), "kind": Kind.COUNT, "clip": 2.5},
    {"name": "w", "shape": (1,), "kind": "bogus"},
])
def test_field_validation(kwargs):
    with pytest.raises(CodecError):
        Field(**kwargs)


def test_schema_validation():
    with pytest.raises(CodecError, match="duplicate"):
        PayloadSchema((Field("w", (1,)), Field("w", (2,))))
    with pytest.raises(CodecError):
        PayloadSchema(())


def test_decode_sum_rejects_malformed_totals():
    wrong_length, signed, unreduced = (np.zeros(3, np.uint32), np.zeros(4, np.int64),
                                       np.array([0, 0, 0, 2**20], np.uint32))
    for total in (wrong_length, signed, unreduced):
        with pytest.raises(CodecError):
            MIXED.decode_sum(total, 20)


# --- shape, scalars, serialisation -----------------------------------------------------------

def test_scalar_field_and_layout():
    schema = PayloadSchema((Field("loss", ()), Field("m", (2, 2), frac_bits=0),
                            Field("n", (), Kind.COUNT, clip=10)))
    assert schema.fields[0].size == 1 and schema.dim == 6
    assert schema.fields[2].frac_bits == 0 and schema.max_abs("n") == 10
    assert schema.max_abs(schema.fields[0]) == 2**16
    enc = schema.encode({"loss": 0.5, "m": [[1.0, 0.0], [-1.0, 0.0]], "n": 7},
                        np.random.default_rng(0))
    assert enc.vector.tolist() == [2**15, 1, 0, -1, 0, 7]  # C order, schema order
    decoded = schema.decode_sum(to_ring(enc.vector, 24), 24)
    assert decoded["loss"].shape == () and float(decoded["loss"]) == 0.5
    assert decoded["m"].tolist() == [[1.0, 0.0], [-1.0, 0.0]] and int(decoded["n"]) == 7
    assert schema.quantisation_bound(4) == {"loss": 4 * 2.0**-16, "m": 4.0, "n": 0.0}


def test_json_round_trip():
    schema = PayloadSchema((Field("w", (3, 2), clip=0.5, frac_bits=12),
                            Field("c", (4,), Kind.COUNT, clip=9)))
    data = json.loads(json.dumps(schema.to_dict()))
    assert data["fields"][0]["shape"] == [3, 2] and data["fields"][1]["kind"] == "count"
    assert PayloadSchema.from_dict(data) == schema


def test_wire_width_uses_machine_words_only_when_they_cost_at_most_ten_percent():
    from tally.codec import wire_width

    assert wire_width(30) == 32 and wire_width(31) == 32 and wire_width(32) == 32
    assert wire_width(20) == 20 and wire_width(28) == 28
    assert wire_width(60) == 64 and wire_width(7) == 7 and wire_width(8) == 8
    for bits in range(1, 65):
        assert bits <= wire_width(bits) <= 1.1 * bits
