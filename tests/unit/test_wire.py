"""The wire contract: committed stubs up to date, lossless conversions, clear errors."""

from __future__ import annotations

import dataclasses
import hashlib
import shutil
import subprocess
import sys
from collections import deque

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from support.secagg import lax_client, roster
from tally.codec import Field, Kind, PayloadSchema, ring_dtype, ring_mask
from tally.secagg import OutOfPhase, SecAggServer, SessionConfig, crypto, shamir, sharecheck
from tally.secagg.layouts import SHARE_CIPHERTEXT_BYTES
from tally.secagg.messages import (
    Abort,
    AdvertiseKeys,
    ConsistencyCheckRequest,
    ConsistencyCheckResponse,
    EncryptedShare,
    JustifyRequest,
    JustifyResponse,
    MaskedInputRequest,
    MaskedInputResponse,
    NeighbourKeys,
    RevealedShareKey,
    SessionAborted,
    SessionRef,
    ShareCheck,
    ShareComplaint,
    ShareComplaints,
    ShareDelivery,
    ShareKeysRequest,
    ShareKeysResponse,
    ShareVerdict,
    SumPublicKeys,
    SumResult,
    SumSpec,
    UnmaskRequest,
    UnmaskResponse,
)
from tally.secagg.params import GraphParams
from tally.wire import generate
from tally.wire.chunks import ChunkError, MaskedInputAssembler, split_masked_input
from tally.wire.fields import WireError
from tally.wire.join import join_from_metadata, join_metadata
from tally.wire.protocol import (
    aggregator_envelope,
    device_envelope,
    from_proto,
    open_envelope,
    session_config_bytes,
    to_proto,
)
from tally.wire.sums import (
    cohort_sum_from_proto,
    cohort_sum_to_proto,
    schema_from_proto,
    schema_to_proto,
)
from tally.wire.tensors import (
    tensor_from_proto,
    tensor_to_proto,
    tensors_from_proto,
    tensors_to_proto,
)
from tally.wire.v1 import (
    admin_pb2_grpc,
    aggregator_pb2,
    aggregator_pb2_grpc,
    common_pb2,
    coordinator_pb2,
    coordinator_pb2_grpc,
    secagg_pb2,
    secagg_pb2_grpc,
)

# ---- generated stubs ---------------------------------------------------------------------------


def test_committed_stubs_are_up_to_date():
    assert generate.stale_files() == [], "run `python -m tally.wire.generate`"


def test_check_reports_a_proto_edited_without_regenerating(tmp_path, capsys):
    protos = tmp_path / "proto"
    shutil.copytree(generate.PROTO_DIR, protos)
    secagg = protos / "tally" / "v1" / "secagg.proto"
    text = secagg.read_text()
    marker = "message Abort {\n"
    assert marker in text
    secagg.write_text(text.replace(marker, marker + "  string added_field = 99;\n"))

    code = generate.main(
        ["--check", "--proto-dir", str(protos), "--out-dir", str(generate.OUT_DIR)])

    assert code == 1
    err = capsys.readouterr().err
    assert "out of date" in err and "secagg_pb2.py" in err and "secagg_pb2.pyi" in err
    assert "admin_pb2.py" not in err  # only what the edit touches is named
    assert "python -m tally.wire.generate" in err


def test_generate_reproduces_the_committed_stubs_and_prunes_leftovers(tmp_path):
    out = tmp_path / "v1"
    out.mkdir()
    (out / "removed_pb2.py").write_text("# from a deleted .proto\n")
    assert "removed_pb2.py" in generate.stale_files(out_dir=out)

    written = generate.write(out_dir=out)

    assert "removed_pb2.py" in written and not (out / "removed_pb2.py").exists()
    assert generate.stale_files(out_dir=out) == []
    for path in sorted(generate.OUT_DIR.glob("*_pb2*.py*")):
        assert (out / path.name).read_text() == path.read_text(), path.name
    assert generate.write(out_dir=out) == []  # idempotent


def test_check_command_line():
    done = subprocess.run([sys.executable, "-m", "tally.wire.generate", "--check"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_stubs_import_as_tally_wire_and_keep_the_tally_v1_contract():
    assert secagg_pb2.SessionRef.__module__ == "tally.wire.v1.secagg_pb2"
    assert secagg_pb2.SessionRef.DESCRIPTOR.full_name == "tally.v1.SessionRef"
    services = {
        secagg_pb2: ("SecureAggregation", ["Session"]),
        coordinator_pb2: ("Coordinator",
                          ["Register", "CheckIn", "DownloadModel", "GetStep", "RoundStatus", "Reveal"]),
        aggregator_pb2: ("AggregatorControl", ["OpenSession", "AwaitResult", "CloseSession", "Fence"]),
    }
    for module, (name, methods) in services.items():
        service = module.DESCRIPTOR.services_by_name[name]
        assert [m.name for m in service.methods] == methods
    for grpc_module, stub in [(secagg_pb2_grpc, "SecureAggregationStub"),
                              (coordinator_pb2_grpc, "CoordinatorStub"),
                              (aggregator_pb2_grpc, "AggregatorControlStub"),
                              (admin_pb2_grpc, "AdminStub")]:
        assert hasattr(grpc_module, stub)


# ---- strategies --------------------------------------------------------------------------------

ids = st.text(min_size=1, max_size=12)
index = st.integers(1, 2**31 - 1)
blob = st.binary(max_size=48)


def fixed(size: int):
    return st.binary(min_size=size, max_size=size)


key = fixed(32)
signature = fixed(64)
refs = st.builds(SessionRef, ids, st.integers(0, 2**63 - 1), ids)
sum_keys = st.builds(SumPublicKeys, ids, key, key, key)
shares = st.builds(EncryptedShare, ids, index, index, fixed(SHARE_CIPHERTEXT_BYTES),
                   st.one_of(st.just(b""), fixed(sharecheck.check_bytes_for(3))))
checks = st.builds(ShareCheck, ids, blob)
complaints = st.builds(ShareComplaint, ids, index, index, signature)
revealed = st.builds(RevealedShareKey, ids, index, index, fixed(crypto.DH_PROOF_BYTES))
# Owners and one share per owner, as one block.
owned = st.integers(0, 5).flatmap(lambda m: st.tuples(st.lists(index, min_size=m, max_size=m).map(tuple),
                                                       fixed(m * shamir.SHARE_BYTES)))


def tuples(strategy, **kw):
    return st.lists(strategy, max_size=5, **kw).map(tuple)


CLIENT_MESSAGES = {
    AdvertiseKeys: st.builds(AdvertiseKeys, refs, index, tuples(sum_keys), signature),
    ShareKeysResponse: st.builds(ShareKeysResponse, refs, index, tuples(shares), tuples(checks)),
    ShareComplaints: st.builds(ShareComplaints, refs, index, tuples(complaints)),
    JustifyResponse: st.builds(JustifyResponse, refs, index, tuples(revealed)),
    MaskedInputResponse: st.builds(MaskedInputResponse, refs, ids, index, st.binary(max_size=512)),
    ConsistencyCheckResponse: st.builds(ConsistencyCheckResponse, refs, ids, index, signature),
    UnmaskResponse: st.builds(
        lambda ref, sum_id, sender, seeds, keys: UnmaskResponse(ref, sum_id, sender, *seeds, *keys),
        refs, ids, index, owned, owned),
}
neighbours = st.builds(NeighbourKeys, index, tuples(sum_keys), signature)
SERVER_MESSAGES = {
    ShareKeysRequest: st.builds(ShareKeysRequest, refs, tuples(neighbours)),
    ShareDelivery: st.builds(ShareDelivery, refs, tuples(shares)),
    JustifyRequest: st.builds(JustifyRequest, refs, tuples(complaints)),
    ShareVerdict: st.builds(ShareVerdict, refs, tuples(index), tuples(revealed)),
    MaskedInputRequest: st.builds(MaskedInputRequest, refs, ids),
    ConsistencyCheckRequest: st.builds(ConsistencyCheckRequest, refs, ids, tuples(index)),
    UnmaskRequest: st.builds(
        UnmaskRequest, refs, ids, tuples(index), st.lists(st.tuples(index, signature), max_size=5).map(tuple)
    ),
    Abort: st.builds(Abort, refs, st.text(max_size=40)),
}


@st.composite
def session_configs(draw):
    n = draw(st.integers(2, 5000))
    k = draw(st.integers(1, n - 1))
    t = draw(st.integers(1, k))
    sums = draw(st.lists(st.builds(SumSpec, ids, st.integers(1, 2**40), st.integers(1, 64)),
                         min_size=1, max_size=4, unique_by=lambda s: s.sum_id))
    return SessionConfig(
        ref=draw(refs),
        sums=tuple(sums),
        params=GraphParams(n, k, t),
        graph_seed=draw(st.binary(min_size=32, max_size=32)),
        consistency_check=draw(st.booleans()),
        min_survivors=draw(st.integers(2, n)),
        identities=_roster(n, draw(st.binary(max_size=8))),
    )


def _roster(n: int, salt: bytes) -> tuple[bytes, ...]:
    return tuple(hashlib.sha256(salt + b"|%d" % i).digest() for i in range(n))


VALUES = {
    SessionRef: refs,
    SumSpec: st.builds(SumSpec, ids, st.integers(1, 2**62), st.integers(1, 64)),
    SessionConfig: session_configs(),
    SumPublicKeys: sum_keys,
    EncryptedShare: shares,
    ShareCheck: checks,
    ShareComplaint: complaints,
    RevealedShareKey: revealed,
    NeighbourKeys: neighbours,
    **CLIENT_MESSAGES,
    **SERVER_MESSAGES,
}


def reparse(proto):
    return type(proto).FromString(proto.SerializeToString())


# ---- round trips -------------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(st.one_of(*VALUES.values()))
def test_every_message_round_trips(value):
    proto = to_proto(value)
    assert from_proto(reparse(proto)) == value


def test_every_protocol_dataclass_is_covered():
    from tally.secagg import messages

    dataclasses = {
        obj for obj in vars(messages).values()
        if isinstance(obj, type) and obj.__module__ == messages.__name__
        and hasattr(obj, "__dataclass_fields__")
    }
    # Not wire messages: routing (Outgoing) and the server's own results.
    local = {messages.Outgoing, messages.SumResult, messages.SessionAborted}
    assert dataclasses - local <= VALUES.keys()


@settings(max_examples=50, deadline=None)
@given(session_configs())
def test_session_config_bytes_are_canonical(config):
    canonical = session_config_bytes(config)
    again = from_proto(secagg_pb2.SessionConfig.FromString(canonical))
    assert session_config_bytes(again) == canonical
    seed = bytes(32) if config.graph_seed != bytes(32) else b"\x01" * 32
    other = dataclasses.replace(config, graph_seed=seed)
    assert session_config_bytes(other) != canonical
    # The roster is part of what the ticket signs: another key at one index is another config.
    swapped = dataclasses.replace(config, identities=(bytes(32),) + config.identities[1:])
    assert session_config_bytes(swapped) != canonical


@settings(max_examples=150, deadline=None)
@given(st.one_of(*CLIENT_MESSAGES.values()))
def test_client_messages_round_trip_through_the_stream_envelope(message):
    envelope = reparse(device_envelope(message))
    assert envelope.WhichOneof("message") is not None
    assert open_envelope(envelope) == message
    assert from_proto(envelope) == message


@settings(max_examples=150, deadline=None)
@given(st.one_of(*SERVER_MESSAGES.values()))
def test_server_messages_round_trip_through_the_stream_envelope(message):
    assert open_envelope(reparse(aggregator_envelope(message))) == message


def test_session_plumbing_travels_as_protos():
    join = secagg_pb2.Join(session_ticket=b"ticket", device_index=3, session_token="secret")
    assert join_from_metadata(join_metadata(join)) == join  # the Join rides in the metadata
    with pytest.raises(TypeError, match="does not travel in DeviceToAggregator"):
        device_envelope(join)
    done = secagg_pb2.SessionDone()  # no sums: the oneof must still be set
    assert open_envelope(reparse(aggregator_envelope(done))) == done
    with pytest.raises(TypeError, match="does not travel in DeviceToAggregator"):
        device_envelope(MaskedInputRequest(SessionRef("j", 1, "s"), "x"))
    with pytest.raises(TypeError, match="does not travel in AggregatorToDevice"):
        aggregator_envelope(join)


DTYPES = ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
          "float16", "float32", "float64", "complex64", "complex128"]


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(DTYPES).flatmap(lambda d: hnp.arrays(
    np.dtype(d), hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=5))))
def test_tensors_round_trip_bit_exactly(array):
    proto = reparse(tensor_to_proto("w", array))
    out = tensor_from_proto(proto)
    assert proto.dtype == array.dtype.name
    assert out.dtype == array.dtype and out.shape == array.shape
    assert out.tobytes() == array.tobytes()  # bit-exact: NaN payloads and -0.0 included
    assert out.flags.writeable


@pytest.mark.parametrize("dtype", ["float32", "int64", "uint16", "complex128"])
def test_tensor_bytes_are_little_endian_whatever_the_input_order(dtype):
    native = np.arange(24, dtype=dtype).reshape(2, 3, 4)
    swapped = native.astype(native.dtype.newbyteorder(">"))
    strided = native.T  # not C-contiguous
    for array in (native, swapped, strided):
        proto = tensor_to_proto("x", array)
        little = np.ascontiguousarray(array, dtype=np.dtype(dtype).newbyteorder("<"))
        assert proto.data == little.tobytes()
        out = tensor_from_proto(proto)
        assert out.dtype == np.dtype(dtype) and np.array_equal(out, array)


def test_named_tensors_round_trip():
    values = {"mean_loss": np.float64(0.25), "heads": np.ones((3, 2), np.float32),
              "counts": np.arange(4, dtype=np.int64)}
    out = tensors_from_proto(reparse(coordinator_pb2.Step(
        name="s", sum_id="s", broadcast=tensors_to_proto(values))).broadcast)
    assert list(out) == list(values)
    for name, array in values.items():
        assert out[name].dtype == np.asarray(array).dtype and np.array_equal(out[name], array)


@st.composite
def field_specs(draw):
    kind = draw(st.sampled_from(Kind))
    real = kind is Kind.REAL
    return Field(
        name=draw(ids),
        shape=draw(st.lists(st.integers(1, 6), max_size=3).map(tuple)),
        kind=kind,
        clip=draw(st.floats(1e-3, 1e3) if real else st.integers(1, 10**6).map(float)),
        frac_bits=draw(st.integers(0, 20)),
    )


@settings(max_examples=100, deadline=None)
@given(ids, st.lists(field_specs(), min_size=1, max_size=4, unique_by=lambda f: f.name))
def test_payload_schemas_round_trip(sum_id, fields):
    schema = PayloadSchema(tuple(fields))
    assert schema_from_proto(reparse(schema_to_proto(sum_id, schema))) == (sum_id, schema)


@settings(max_examples=100, deadline=None)
@given(st.data(), st.integers(1, 64), st.integers(1, 300))
def test_cohort_sums_round_trip_at_the_wire_width(data, bits, dim):
    spec = SumSpec("update", dim, bits)
    total = data.draw(hnp.arrays(np.uint64, dim, elements=st.integers(0, ring_mask(bits))))
    total = total.astype(ring_dtype(bits))
    result = SumResult("update", total, (1, 2, 4), (3,), ((5, "left"), (6, "proven bad")), (6,))
    proto = reparse(cohort_sum_to_proto("sess", spec, result))
    assert len(proto.total) == -(-dim * spec.wire_bits // 8)  # packed, never widened
    back = cohort_sum_from_proto(proto)
    assert back.sum_id == "update" and back.contributors == (1, 2, 4) and back.dropped == (3,)
    assert back.excluded == result.excluded and back.convicted == (6,)  # only a proven exclusion bans
    assert back.total.dtype == ring_dtype(bits) and np.array_equal(back.total, total)


def test_aborted_cohort_sum():
    proto = reparse(cohort_sum_to_proto("sess", SumSpec("u", 4, 20), SessionAborted("too few")))
    assert proto.total == b"" and cohort_sum_from_proto(proto) == SessionAborted("too few")


def test_a_cohort_runs_through_serialized_messages():
    """The real state machines, with every message serialized and parsed on the way."""
    config = from_proto(reparse(to_proto(SessionConfig(
        ref=SessionRef("job", 7, "cohort-0"),
        sums=(SumSpec("a", 6, 20), SumSpec("b", 3, 33)),
        params=GraphParams(5, 4, 3),
        graph_seed=bytes(range(32)),
        consistency_check=True,
        min_survivors=3,
        identities=roster(5),
    ))))
    rng = np.random.default_rng(0)
    inputs = {i: {s.sum_id: rng.integers(0, 2**s.bits, s.dim, dtype=np.uint64).astype(
        ring_dtype(s.bits)) for s in config.sums} for i in range(1, 6)}
    server = SecAggServer(config)
    clients = {i: lax_client(config, i) for i in range(1, 6)}
    uplink = deque()
    for i, client in clients.items():
        for sum_id, vector in inputs[i].items():
            client.provide_input(sum_id, vector)
        uplink.extend(reparse(device_envelope(m)) for m in client.start())
    late = 0
    while uplink:
        try:
            outgoing = server.receive(open_envelope(uplink.popleft()))
        except OutOfPhase:  # unmask answers after the server had enough shares, as in the driver
            late += 1
            continue
        for out in outgoing:
            message = open_envelope(reparse(aggregator_envelope(out.message)))
            replies = clients[out.recipient].receive(message)
            uplink.extend(reparse(device_envelope(m)) for m in replies)
    assert server.finished and server.aborted is None and late < 10
    for spec in config.sums:
        result = cohort_sum_from_proto(reparse(cohort_sum_to_proto(
            "cohort-0", spec, server.results[spec.sum_id])))
        expected = [sum(int(inputs[i][spec.sum_id][j]) for i in inputs) % 2**spec.bits
                    for j in range(spec.dim)]
        assert [int(v) for v in result.total] == expected
        assert result.contributors == (1, 2, 3, 4, 5)


# ---- malformed input ---------------------------------------------------------------------------

REF = secagg_pb2.SessionRef(job_id="j", round=1, session_id="s")


@pytest.mark.parametrize("proto, match", [
    (secagg_pb2.AdvertiseKeys(sender=1), r"AdvertiseKeys\.ref is missing"),
    (secagg_pb2.AdvertiseKeys(ref=REF),
     r"AdvertiseKeys\.sender: device indices are 1-based, got 0"),
    (secagg_pb2.MaskedInputResponse(ref=REF, sender=2), r"MaskedInputResponse\.sum_id is missing"),
    (secagg_pb2.MaskedInputRequest(ref=secagg_pb2.SessionRef(job_id="j"), sum_id="x"),
     r"SessionRef\.session_id is missing"),
    (secagg_pb2.ShareKeysResponse(ref=REF, sender=1, shares=[
        secagg_pb2.EncryptedShare(sum_id="a", sender=1, recipient=-4)]),
     r"EncryptedShare\.recipient: device indices are 1-based, got -4"),
    (secagg_pb2.UnmaskResponse(ref=REF, sum_id="a", sender=1, key_owners=[3, 0], key_shares=bytes(72)),
     r"UnmaskResponse\.key_owners: device indices are 1-based, got 0"),
    (secagg_pb2.ConsistencyCheckRequest(ref=REF, sum_id="a", survivors=[1, 0]), r"survivors"),
    (secagg_pb2.UnmaskRequest(ref=REF, sum_id="a", signatures=[secagg_pb2.SurvivorSignature()]),
     r"signatures\.signer"),
    # Fixed-size fields of any other size are refused before anything stores or relays them.
    (secagg_pb2.AdvertiseKeys(ref=REF, sender=1, keys=[secagg_pb2.SumPublicKeys(
        sum_id="a", cipher_public=bytes(32), mask_public=bytes(32), seed_commitment=bytes(32))],
        signature=bytes(20 << 20)), r"AdvertiseKeys\.signature must be 64 bytes, got 20971520"),
    (secagg_pb2.AdvertiseKeys(ref=REF, sender=1, keys=[secagg_pb2.SumPublicKeys(
        sum_id="a", cipher_public=bytes(33), mask_public=bytes(32), seed_commitment=bytes(32))],
        signature=bytes(64)), r"SumPublicKeys\.cipher_public must be 32 bytes, got 33"),
    (secagg_pb2.AdvertiseKeys(ref=REF, sender=1, keys=[secagg_pb2.SumPublicKeys(
        sum_id="a", cipher_public=bytes(32), mask_public=bytes(32))], signature=bytes(64)),
     r"SumPublicKeys\.seed_commitment must be 32 bytes, got 0"),
    (secagg_pb2.ConsistencyCheckResponse(ref=REF, sum_id="a", sender=1, signature=bytes(65)),
     r"ConsistencyCheckResponse\.signature must be 64 bytes"),
    (secagg_pb2.UnmaskResponse(ref=REF, sum_id="a", sender=1, seed_owners=[2], seed_shares=bytes(1000)),
     r"UnmaskResponse\.seed_shares must be 32 bytes per owner in seed_owners \(1\), got 1000"),
    (secagg_pb2.UnmaskResponse(ref=REF, sum_id="a", sender=1, key_owners=[2, 3], key_shares=bytes(32)),
     r"UnmaskResponse\.key_shares must be 32 bytes per owner in key_owners \(2\), got 32"),
    (secagg_pb2.ShareKeysResponse(ref=REF, sender=1, shares=[
        secagg_pb2.EncryptedShare(sum_id="a", sender=1, recipient=2, ciphertext=bytes(10))]),
     r"EncryptedShare\.ciphertext must be 112 bytes"),
    (secagg_pb2.MaskedInputRequest(ref=REF, sum_id="x" * 257), r"sum_id: at most 256 characters"),
    (secagg_pb2.DeviceToAggregator(), r"DeviceToAggregator carries no message"),
    (secagg_pb2.AggregatorToDevice(), r"AggregatorToDevice carries no message"),
    (secagg_pb2.SumSpec(sum_id="a", dim=0, bits=8), r"dim must be >= 1"),
    (secagg_pb2.SumSpec(sum_id="a", dim=3, bits=65), r"bits must be in 1..64"),
    (common_pb2.Tensor(), r"cannot convert a Tensor"),
])
def test_malformed_protos_are_refused_clearly(proto, match):
    with pytest.raises(WireError, match=match):
        from_proto(reparse(proto))


def _config_proto(**changes):
    proto = secagg_pb2.SessionConfig(
        ref=REF, sums=[secagg_pb2.SumSpec(sum_id="a", dim=4, bits=20)], n=5, k=4, t=3,
        graph_seed=bytes(32), min_survivors=3, identities=roster(5))
    for name, value in changes.items():
        if name in ("sums", "identities"):
            del getattr(proto, name)[:]
            getattr(proto, name).extend(value)
        else:
            setattr(proto, name, value)
    return proto


@pytest.mark.parametrize("changes, match", [
    ({"graph_seed": b"short"}, "graph_seed must be 32 bytes"),
    ({"sums": []}, "at least one sum"),
    ({"sums": [secagg_pb2.SumSpec(sum_id="a", dim=1, bits=8)] * 2}, "sum ids must be unique"),
    ({"n": 0}, r"SessionConfig\.n"),
    ({"k": 5}, r"SessionConfig\.k"),
    ({"t": 0}, r"SessionConfig\.t"),
    ({"min_survivors": 0}, "min_survivors"),
    ({"identities": roster(4)}, "one identity key per device: 4 for n=5"),
    ({"identities": roster(4) + (b"x" * 33,)}, r"SessionConfig\.identities must be 32 bytes, got 33"),
    ({"identities": roster(4) + roster(1)}, "same identity key"),
])
def test_malformed_session_configs_are_refused(changes, match):
    assert isinstance(from_proto(_config_proto()), SessionConfig)
    with pytest.raises(WireError, match=match):
        from_proto(_config_proto(**changes))


@pytest.mark.parametrize("tensor, match", [
    (common_pb2.Tensor(name="w", shape=[2, 3], dtype="float32", data=bytes(20)),
     r"tensor 'w': shape \(2, 3\) of float32 needs 24 bytes, got 20"),
    (common_pb2.Tensor(name="w", shape=[2], dtype="object", data=bytes(16)),
     "unsupported dtype 'object'"),
    (common_pb2.Tensor(name="w", shape=[1], dtype="", data=bytes(8)), "unsupported dtype ''"),
    (common_pb2.Tensor(name="w", shape=[-1, 2], dtype="int8", data=b""), "negative dimension"),
])
def test_malformed_tensors_are_refused(tensor, match):
    with pytest.raises(WireError, match=match):
        tensor_from_proto(tensor)


def test_tensor_misuse():
    with pytest.raises(WireError, match="expected a Tensor"):
        tensor_from_proto(secagg_pb2.SessionRef())
    with pytest.raises(ValueError, match="cannot go on the wire"):
        tensor_to_proto("s", np.array(["a", "b"]))
    with pytest.raises(ValueError, match="cannot go on the wire"):
        tensor_to_proto("o", np.array([object()]))
    with pytest.raises(TypeError, match="tensor name must be a str"):
        tensor_to_proto(3, np.zeros(2))
    twice = [tensor_to_proto("x", np.zeros(1)), tensor_to_proto("x", np.ones(1))]
    with pytest.raises(WireError, match="duplicate tensor name 'x'"):
        tensors_from_proto(twice)
    with pytest.raises(WireError, match="Tensor.name is missing"):
        tensors_from_proto([tensor_to_proto("", np.zeros(1))])


def test_malformed_schemas_are_refused():
    good = schema_to_proto("s", PayloadSchema((Field("w", (2,)),)))
    no_kind = aggregator_pb2.PayloadSchemaSpec()
    no_kind.CopyFrom(good)
    no_kind.fields[0].kind = aggregator_pb2.FIELD_KIND_UNSPECIFIED
    with pytest.raises(WireError, match="schema of sum 's': field 'w' has no kind"):
        schema_from_proto(no_kind)
    bad_clip = aggregator_pb2.PayloadSchemaSpec()
    bad_clip.CopyFrom(good)
    bad_clip.fields[0].clip = 0.0
    with pytest.raises(WireError, match="clip must be finite and > 0"):
        schema_from_proto(bad_clip)
    with pytest.raises(WireError, match="at least one field"):
        schema_from_proto(aggregator_pb2.PayloadSchemaSpec(sum_id="s"))
    with pytest.raises(WireError, match=r"PayloadSchemaSpec\.sum_id is missing"):
        schema_from_proto(aggregator_pb2.PayloadSchemaSpec(fields=good.fields))


def test_malformed_cohort_sums_are_refused():
    proto = cohort_sum_to_proto("sess", SumSpec("u", 4, 20),
                                SumResult("u", np.arange(4, dtype=np.uint32), (1, 2), ()))
    short = aggregator_pb2.CohortSum()
    short.CopyFrom(proto)
    short.total = proto.total[:-1]
    with pytest.raises(WireError, match="CohortSum 'u'.*must be 10 bytes, got 9"):
        cohort_sum_from_proto(short)
    wide = aggregator_pb2.CohortSum()
    wide.CopyFrom(proto)
    wide.bits = 0
    with pytest.raises(WireError, match="bits must be in 1..64"):
        cohort_sum_from_proto(wide)


def test_unknown_values_have_no_proto():
    with pytest.raises(TypeError, match="no protobuf form for dict"):
        to_proto({})


def test_stubs_serve_a_session_stream_over_real_grpc():
    """The generated service and stub work together: the Join (in metadata) answered by Joined,
    then Abort."""
    from concurrent import futures

    import grpc

    config = SessionConfig(SessionRef("j", 1, "s"), (SumSpec("a", 4, 20),), GraphParams(3, 2, 2),
                           bytes(32), min_survivors=2, identities=roster(3))

    class Servicer(secagg_pb2_grpc.SecureAggregationServicer):
        def Session(self, request_iterator, context):
            join = join_from_metadata(context.invocation_metadata())
            assert join.device_index == 2
            yield aggregator_envelope(secagg_pb2.Joined(config=to_proto(config)))
            keys = open_envelope(next(request_iterator))
            yield aggregator_envelope(Abort(keys.ref, f"test ends after {keys.sender}"))

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    secagg_pb2_grpc.add_SecureAggregationServicer_to_server(Servicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = secagg_pb2_grpc.SecureAggregationStub(channel)
            outgoing = [
                device_envelope(AdvertiseKeys(
                    config.ref, 2, (SumPublicKeys("a", bytes(32), bytes(32), bytes(32)),), bytes(64)
                )),
            ]
            metadata = join_metadata(secagg_pb2.Join(session_ticket=b"t", device_index=2, session_token="x"))
            replies = [open_envelope(m) for m in stub.Session(iter(outgoing), timeout=10, metadata=metadata)]
    finally:
        server.stop(None)
    assert from_proto(replies[0].config) == config
    assert replies[1] == Abort(config.ref, "test ends after 2")


# ---- masked inputs in chunks (tally.wire.chunks) -----------------------------------------------


def _masked_envelope(data: bytes, sum_id: str = "update") -> secagg_pb2.DeviceToAggregator:
    ref = secagg_pb2.SessionRef(job_id="j", round=1, session_id="s")
    return secagg_pb2.DeviceToAggregator(masked_input_response=secagg_pb2.MaskedInputResponse(
        ref=ref, sum_id=sum_id, sender=3, data=data))


@given(st.binary(min_size=0, max_size=300), st.integers(1, 64))
def test_chunks_reassemble_to_the_masked_input_they_were_split_from(data, chunk_bytes):
    envelope = _masked_envelope(data)
    parts = split_masked_input(envelope, chunk_bytes)
    assert all(len(p.masked_input_response.data) <= chunk_bytes for p in parts)
    assert [p.masked_input_response.more for p in parts] == [True] * (len(parts) - 1) + [False]
    assembler = MaskedInputAssembler(lambda sum_id: len(data) if sum_id == "update" else None)
    outputs = [assembler.add(p) for p in parts]
    assert outputs[:-1] == [None] * (len(parts) - 1)
    assert outputs[-1] == envelope
    other = secagg_pb2.DeviceToAggregator(advertise_keys=secagg_pb2.AdvertiseKeys(sender=3))
    assert assembler.add(other) is other  # nothing left pending


@pytest.mark.parametrize("spoil, message", [
    (lambda parts: parts.pop(0), "starts at offset 4, not 0"),
    (lambda parts: parts.__setitem__(1, parts[2]), "offset 8, expected 4"),
    (lambda parts: parts[1].masked_input_response.__setattr__("sender", 4),
     "arrived before the last chunk"),
    (lambda parts: parts.insert(1, secagg_pb2.DeviceToAggregator(
        advertise_keys=secagg_pb2.AdvertiseKeys(sender=3))), "advertise_keys arrived before the last chunk"),
    (lambda parts: parts[-1].masked_input_response.__setattr__("data", b"\0" * 5),
     "larger than its 10 packed bytes"),
])
def test_chunks_out_of_order_interleaved_or_oversized_are_refused(spoil, message):
    parts = split_masked_input(_masked_envelope(bytes(range(10))), 4)
    spoil(parts)
    assembler = MaskedInputAssembler(lambda sum_id: 10)
    with pytest.raises(ChunkError, match=message):
        for part in parts:
            assembler.add(part)


def test_a_chunked_input_for_an_unknown_sum_is_refused():
    parts = split_masked_input(_masked_envelope(bytes(10), sum_id="nope"), 4)
    with pytest.raises(ChunkError, match="'nope', which this session does not have"):
        MaskedInputAssembler(lambda sum_id: None).add(parts[0])
