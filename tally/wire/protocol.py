"""The secure-aggregation protocol's values and the stream envelopes that carry them, to and from
their protobuf form.

The state machines (``tally.secagg``) know nothing of protobuf; the services call ``to_proto`` on
what a state machine emits and ``from_proto`` on what arrives, and wrap and open the session
stream's messages with ``device_envelope``, ``aggregator_envelope`` and ``open_envelope``.

``from_proto`` is the trust boundary for structure (``tally.wire.fields``): a message of the
wrong type, a missing oneof, a missing submessage, a zero where a 1-based device index or a
non-empty id is required, or a fixed-size field (keys, commitments, signatures, share
ciphertexts) of any other size raises ``WireError`` naming the message and field. Whether a
message makes sense in its session (indices within the cohort, phase, signatures) is left to the
state machines, which answer with their own errors.

Encoders fill a message in place, so wrapping a large masked input in its stream envelope
copies its bytes once, not once per layer.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeVar, cast, overload

from google.protobuf.message import Message

from tally.secagg import crypto, shamir, sharecheck
from tally.secagg.config import SessionConfig
from tally.secagg.layouts import COMMITMENT_BYTES, SHARE_CIPHERTEXT_BYTES
from tally.secagg.messages import (
    Abort,
    AdvertiseKeys,
    ClientMessage,
    ConsistencyCheckRequest,
    ConsistencyCheckResponse,
    EncryptedShare,
    JustifyRequest,
    JustifyResponse,
    MaskedInputRequest,
    MaskedInputResponse,
    NeighbourKeys,
    RevealedShareKey,
    ServerMessage,
    SessionRef,
    ShareCheck,
    ShareComplaint,
    ShareComplaints,
    ShareDelivery,
    ShareKeysRequest,
    ShareKeysResponse,
    ShareVerdict,
    SumPublicKeys,
    SumSpec,
    UnmaskRequest,
    UnmaskResponse,
)
from tally.secagg.params import GraphParams
from tally.wire.fields import (
    WireError,
    device_index,
    device_indices,
    fixed_bytes,
    id_text,
    message_name,
    submessage,
)
from tally.wire.v1 import secagg_pb2


def _ref(proto: Message) -> SessionRef:
    return _session_ref_from(cast(secagg_pb2.SessionRef, submessage(proto, "ref")))  # every ref field is one


# ---- session and sums --------------------------------------------------------------------------


def _session_ref_to(v: SessionRef, out: secagg_pb2.SessionRef) -> None:
    out.SetInParent()  # present even if every field is empty, so the decoder can tell
    out.job_id, out.round, out.session_id = v.job_id, v.round, v.session_id


def _session_ref_from(p: secagg_pb2.SessionRef) -> SessionRef:
    if p.round < 0:
        raise WireError(f"SessionRef.round must be >= 0, got {p.round}")
    return SessionRef(id_text(p, "job_id"), int(p.round), id_text(p, "session_id"))


def _sum_spec_to(v: SumSpec, out: secagg_pb2.SumSpec) -> None:
    out.sum_id, out.dim, out.bits = v.sum_id, v.dim, v.bits


def _sum_spec_from(p: secagg_pb2.SumSpec) -> SumSpec:
    if p.dim < 1:
        raise WireError(f"SumSpec {p.sum_id!r}: dim must be >= 1, got {p.dim}")
    if not 1 <= p.bits <= 64:
        raise WireError(f"SumSpec {p.sum_id!r}: bits must be in 1..64, got {p.bits}")
    return SumSpec(id_text(p, "sum_id"), int(p.dim), int(p.bits))


def _session_config_to(v: SessionConfig, out: secagg_pb2.SessionConfig) -> None:
    _session_ref_to(v.ref, out.ref)
    for spec in v.sums:
        _sum_spec_to(spec, out.sums.add())
    out.n, out.k, out.t = v.params.n, v.params.k, v.params.t
    out.graph_seed = v.graph_seed
    out.consistency_check = v.consistency_check
    out.min_survivors = v.min_survivors
    out.plain = v.plain
    out.identities.extend(v.identities)


def _session_config_from(p: secagg_pb2.SessionConfig) -> SessionConfig:
    ref = _ref(p)
    if p.n < 2:
        raise WireError(f"SessionConfig.n: a cohort has at least 2 devices, got {p.n}")
    if not 1 <= p.k < p.n:
        raise WireError(f"SessionConfig.k: graph degree must be in 1..n-1={p.n - 1}, got {p.k}")
    if not 1 <= p.t <= p.k:
        raise WireError(f"SessionConfig.t: threshold must be in 1..k={p.k}, got {p.t}")
    sums = tuple(_sum_spec_from(s) for s in p.sums)
    try:
        return SessionConfig(
            ref=ref,
            sums=sums,
            params=GraphParams(int(p.n), int(p.k), int(p.t)),
            graph_seed=p.graph_seed,
            consistency_check=p.consistency_check,
            min_survivors=int(p.min_survivors),
            identities=tuple(fixed_bytes(p, "identities", crypto.PUBLIC_KEY_BYTES, k) for k in p.identities),
            plain=p.plain,
        )
    except ValueError as exc:
        raise WireError(f"SessionConfig: {exc}") from exc


# ---- device -> aggregator ----------------------------------------------------------------------


def _sum_keys_to(v: SumPublicKeys, out: secagg_pb2.SumPublicKeys) -> None:
    out.sum_id, out.cipher_public, out.mask_public = v.sum_id, v.cipher_public, v.mask_public
    out.seed_commitment = v.seed_commitment


def _sum_keys_from(p: secagg_pb2.SumPublicKeys) -> SumPublicKeys:
    return SumPublicKeys(
        id_text(p, "sum_id"),
        fixed_bytes(p, "cipher_public", crypto.PUBLIC_KEY_BYTES),
        fixed_bytes(p, "mask_public", crypto.PUBLIC_KEY_BYTES),
        fixed_bytes(p, "seed_commitment", COMMITMENT_BYTES),
    )


def _advertise_keys_to(v: AdvertiseKeys, out: secagg_pb2.AdvertiseKeys) -> None:
    _session_ref_to(v.ref, out.ref)
    out.sender = v.sender
    for keys in v.keys:
        _sum_keys_to(keys, out.keys.add())
    out.signature = v.signature


def _advertise_keys_from(p: secagg_pb2.AdvertiseKeys) -> AdvertiseKeys:
    return AdvertiseKeys(
        _ref(p), device_index(p, "sender"), tuple(map(_sum_keys_from, p.keys)),
        fixed_bytes(p, "signature", crypto.SIGNATURE_BYTES),
    )


def _share_to(v: EncryptedShare, out: secagg_pb2.EncryptedShare) -> None:
    out.sum_id, out.sender, out.recipient, out.ciphertext, out.check = (
        v.sum_id, v.sender, v.recipient, v.ciphertext, v.check
    )


def _share_from(p: secagg_pb2.EncryptedShare) -> EncryptedShare:
    if p.check and (len(p.check) <= sharecheck.check_bytes_for(0) or
                    (len(p.check) - sharecheck.check_bytes_for(0)) % sharecheck.SCALAR):
        raise WireError(f"{message_name(p)}.check must be empty or a digest, a point and whole scalars, "
                        f"got {len(p.check)} bytes")
    return EncryptedShare(
        id_text(p, "sum_id"), device_index(p, "sender"), device_index(p, "recipient"),
        fixed_bytes(p, "ciphertext", SHARE_CIPHERTEXT_BYTES), p.check,
    )


def _share_check_to(v: ShareCheck, out: secagg_pb2.ShareCheck) -> None:
    out.sum_id, out.coefficients = v.sum_id, v.coefficients


def _share_check_from(p: secagg_pb2.ShareCheck) -> ShareCheck:
    return ShareCheck(id_text(p, "sum_id"), p.coefficients)


def _share_keys_response_to(v: ShareKeysResponse, out: secagg_pb2.ShareKeysResponse) -> None:
    _session_ref_to(v.ref, out.ref)
    out.sender = v.sender
    for share in v.shares:
        _share_to(share, out.shares.add())
    for check in v.checks:
        _share_check_to(check, out.checks.add())


def _share_keys_response_from(p: secagg_pb2.ShareKeysResponse) -> ShareKeysResponse:
    return ShareKeysResponse(_ref(p), device_index(p, "sender"), tuple(map(_share_from, p.shares)),
                             tuple(map(_share_check_from, p.checks)))


def _complaint_to(v: ShareComplaint, out: secagg_pb2.ShareComplaint) -> None:
    out.sum_id, out.dealer, out.holder, out.signature = v.sum_id, v.dealer, v.holder, v.signature


def _complaint_from(p: secagg_pb2.ShareComplaint) -> ShareComplaint:
    return ShareComplaint(id_text(p, "sum_id"), device_index(p, "dealer"), device_index(p, "holder"),
                          fixed_bytes(p, "signature", crypto.SIGNATURE_BYTES))


def _complaints_to(v: ShareComplaints, out: secagg_pb2.ShareComplaints) -> None:
    _session_ref_to(v.ref, out.ref)
    out.sender = v.sender
    for complaint in v.complaints:
        _complaint_to(complaint, out.complaints.add())


def _complaints_from(p: secagg_pb2.ShareComplaints) -> ShareComplaints:
    return ShareComplaints(_ref(p), device_index(p, "sender"), tuple(map(_complaint_from, p.complaints)))


def _revealed_to(v: RevealedShareKey, out: secagg_pb2.RevealedShareKey) -> None:
    out.sum_id, out.dealer, out.holder, out.key = v.sum_id, v.dealer, v.holder, v.key


def _revealed_from(p: secagg_pb2.RevealedShareKey) -> RevealedShareKey:
    return RevealedShareKey(id_text(p, "sum_id"), device_index(p, "dealer"), device_index(p, "holder"),
                            fixed_bytes(p, "key", crypto.DH_PROOF_BYTES))


def _justify_response_to(v: JustifyResponse, out: secagg_pb2.JustifyResponse) -> None:
    _session_ref_to(v.ref, out.ref)
    out.sender = v.sender
    for key in v.keys:
        _revealed_to(key, out.keys.add())


def _justify_response_from(p: secagg_pb2.JustifyResponse) -> JustifyResponse:
    return JustifyResponse(_ref(p), device_index(p, "sender"), tuple(map(_revealed_from, p.keys)))


def _masked_input_response_to(v: MaskedInputResponse, out: secagg_pb2.MaskedInputResponse) -> None:
    _session_ref_to(v.ref, out.ref)
    out.sum_id, out.sender, out.data = v.sum_id, v.sender, v.data


def _masked_input_response_from(p: secagg_pb2.MaskedInputResponse) -> MaskedInputResponse:
    return MaskedInputResponse(_ref(p), id_text(p, "sum_id"), device_index(p, "sender"), p.data)


def _consistency_response_to(
    v: ConsistencyCheckResponse, out: secagg_pb2.ConsistencyCheckResponse
) -> None:
    _session_ref_to(v.ref, out.ref)
    out.sum_id, out.sender, out.signature = v.sum_id, v.sender, v.signature


def _consistency_response_from(
    p: secagg_pb2.ConsistencyCheckResponse,
) -> ConsistencyCheckResponse:
    return ConsistencyCheckResponse(
        _ref(p), id_text(p, "sum_id"), device_index(p, "sender"), fixed_bytes(p, "signature", crypto.SIGNATURE_BYTES)
    )


def _owned_from(p: Message, owners: str, shares: str) -> tuple[tuple[int, ...], bytes]:
    """Owner indices and their shares' block, which must hold one share per owner."""
    indices = device_indices(p, owners)
    block = getattr(p, shares)
    if len(block) != len(indices) * shamir.SHARE_BYTES:
        raise WireError(f"{message_name(p)}.{shares} must be {shamir.SHARE_BYTES} bytes per owner in {owners} "
                        f"({len(indices)}), got {len(block)}")
    return indices, block


def _unmask_response_to(v: UnmaskResponse, out: secagg_pb2.UnmaskResponse) -> None:
    _session_ref_to(v.ref, out.ref)
    out.sum_id, out.sender = v.sum_id, v.sender
    out.seed_owners.extend(v.seed_owners)
    out.seed_shares = v.seed_shares
    out.key_owners.extend(v.key_owners)
    out.key_shares = v.key_shares


def _unmask_response_from(p: secagg_pb2.UnmaskResponse) -> UnmaskResponse:
    return UnmaskResponse(
        _ref(p),
        id_text(p, "sum_id"),
        device_index(p, "sender"),
        *_owned_from(p, "seed_owners", "seed_shares"),
        *_owned_from(p, "key_owners", "key_shares"),
    )


# ---- aggregator -> device ----------------------------------------------------------------------


def _neighbour_to(v: NeighbourKeys, out: secagg_pb2.NeighbourKeys) -> None:
    out.index = v.index
    for keys in v.keys:
        _sum_keys_to(keys, out.keys.add())
    out.signature = v.signature


def _neighbour_from(p: secagg_pb2.NeighbourKeys) -> NeighbourKeys:
    return NeighbourKeys(
        device_index(p, "index"), tuple(map(_sum_keys_from, p.keys)),
        fixed_bytes(p, "signature", crypto.SIGNATURE_BYTES),
    )


def _share_keys_request_to(v: ShareKeysRequest, out: secagg_pb2.ShareKeysRequest) -> None:
    _session_ref_to(v.ref, out.ref)
    for neighbour in v.neighbours:
        _neighbour_to(neighbour, out.neighbours.add())


def _share_keys_request_from(p: secagg_pb2.ShareKeysRequest) -> ShareKeysRequest:
    return ShareKeysRequest(_ref(p), tuple(map(_neighbour_from, p.neighbours)))


def _share_delivery_to(v: ShareDelivery, out: secagg_pb2.ShareDelivery) -> None:
    _session_ref_to(v.ref, out.ref)
    for share in v.shares:
        _share_to(share, out.shares.add())


def _share_delivery_from(p: secagg_pb2.ShareDelivery) -> ShareDelivery:
    return ShareDelivery(_ref(p), tuple(map(_share_from, p.shares)))


def _justify_request_to(v: JustifyRequest, out: secagg_pb2.JustifyRequest) -> None:
    _session_ref_to(v.ref, out.ref)
    for complaint in v.complaints:
        _complaint_to(complaint, out.complaints.add())


def _justify_request_from(p: secagg_pb2.JustifyRequest) -> JustifyRequest:
    return JustifyRequest(_ref(p), tuple(map(_complaint_from, p.complaints)))


def _verdict_to(v: ShareVerdict, out: secagg_pb2.ShareVerdict) -> None:
    _session_ref_to(v.ref, out.ref)
    out.excluded.extend(v.excluded)
    for key in v.keys:
        _revealed_to(key, out.keys.add())


def _verdict_from(p: secagg_pb2.ShareVerdict) -> ShareVerdict:
    return ShareVerdict(_ref(p), device_indices(p, "excluded"), tuple(map(_revealed_from, p.keys)))


def _masked_input_request_to(v: MaskedInputRequest, out: secagg_pb2.MaskedInputRequest) -> None:
    _session_ref_to(v.ref, out.ref)
    out.sum_id = v.sum_id


def _masked_input_request_from(p: secagg_pb2.MaskedInputRequest) -> MaskedInputRequest:
    return MaskedInputRequest(_ref(p), id_text(p, "sum_id"))


def _consistency_request_to(
    v: ConsistencyCheckRequest, out: secagg_pb2.ConsistencyCheckRequest
) -> None:
    _session_ref_to(v.ref, out.ref)
    out.sum_id = v.sum_id
    out.survivors.extend(v.survivors)


def _consistency_request_from(p: secagg_pb2.ConsistencyCheckRequest) -> ConsistencyCheckRequest:
    return ConsistencyCheckRequest(_ref(p), id_text(p, "sum_id"), device_indices(p, "survivors"))


def _unmask_request_to(v: UnmaskRequest, out: secagg_pb2.UnmaskRequest) -> None:
    _session_ref_to(v.ref, out.ref)
    out.sum_id = v.sum_id
    out.survivors.extend(v.survivors)
    for signer, signature in v.signatures:
        item = out.signatures.add()
        item.signer, item.signature = signer, signature


def _unmask_request_from(p: secagg_pb2.UnmaskRequest) -> UnmaskRequest:
    signatures = tuple(
        (device_index(p, "signatures.signer", s.signer),
         fixed_bytes(p, "signatures.signature", crypto.SIGNATURE_BYTES, s.signature))
        for s in p.signatures
    )
    return UnmaskRequest(_ref(p), id_text(p, "sum_id"), device_indices(p, "survivors"), signatures)


def _abort_to(v: Abort, out: secagg_pb2.Abort) -> None:
    _session_ref_to(v.ref, out.ref)
    out.reason = v.reason


def _abort_from(p: secagg_pb2.Abort) -> Abort:
    return Abort(_ref(p), p.reason)


# ---- dispatch ----------------------------------------------------------------------------------

# value type -> (protobuf class, fill(value, out), decode(proto))
_CODECS: dict[type, tuple[type[Message], Callable[[Any, Any], None], Callable[[Any], Any]]] = {
    SessionRef: (secagg_pb2.SessionRef, _session_ref_to, _session_ref_from),
    SumSpec: (secagg_pb2.SumSpec, _sum_spec_to, _sum_spec_from),
    SessionConfig: (secagg_pb2.SessionConfig, _session_config_to, _session_config_from),
    SumPublicKeys: (secagg_pb2.SumPublicKeys, _sum_keys_to, _sum_keys_from),
    AdvertiseKeys: (secagg_pb2.AdvertiseKeys, _advertise_keys_to, _advertise_keys_from),
    EncryptedShare: (secagg_pb2.EncryptedShare, _share_to, _share_from),
    ShareCheck: (secagg_pb2.ShareCheck, _share_check_to, _share_check_from),
    ShareComplaint: (secagg_pb2.ShareComplaint, _complaint_to, _complaint_from),
    RevealedShareKey: (secagg_pb2.RevealedShareKey, _revealed_to, _revealed_from),
    ShareComplaints: (secagg_pb2.ShareComplaints, _complaints_to, _complaints_from),
    JustifyResponse: (secagg_pb2.JustifyResponse, _justify_response_to, _justify_response_from),
    JustifyRequest: (secagg_pb2.JustifyRequest, _justify_request_to, _justify_request_from),
    ShareVerdict: (secagg_pb2.ShareVerdict, _verdict_to, _verdict_from),
    ShareKeysResponse: (
        secagg_pb2.ShareKeysResponse, _share_keys_response_to, _share_keys_response_from
    ),
    MaskedInputResponse: (
        secagg_pb2.MaskedInputResponse, _masked_input_response_to, _masked_input_response_from
    ),
    ConsistencyCheckResponse: (
        secagg_pb2.ConsistencyCheckResponse, _consistency_response_to, _consistency_response_from
    ),
    UnmaskResponse: (secagg_pb2.UnmaskResponse, _unmask_response_to, _unmask_response_from),
    NeighbourKeys: (secagg_pb2.NeighbourKeys, _neighbour_to, _neighbour_from),
    ShareKeysRequest: (
        secagg_pb2.ShareKeysRequest, _share_keys_request_to, _share_keys_request_from
    ),
    ShareDelivery: (secagg_pb2.ShareDelivery, _share_delivery_to, _share_delivery_from),
    MaskedInputRequest: (
        secagg_pb2.MaskedInputRequest, _masked_input_request_to, _masked_input_request_from
    ),
    ConsistencyCheckRequest: (
        secagg_pb2.ConsistencyCheckRequest, _consistency_request_to, _consistency_request_from
    ),
    UnmaskRequest: (secagg_pb2.UnmaskRequest, _unmask_request_to, _unmask_request_from),
    Abort: (secagg_pb2.Abort, _abort_to, _abort_from),
}
_DECODERS: dict[type[Message], Callable[[Any], Any]] = {
    proto: decode for proto, _, decode in _CODECS.values()
}

# The oneof field of each stream envelope that carries a protocol message.
_DEVICE_FIELDS: dict[type, str] = {
    AdvertiseKeys: "advertise_keys",
    ShareKeysResponse: "share_keys_response",
    ShareComplaints: "share_complaints",
    JustifyResponse: "justify_response",
    MaskedInputResponse: "masked_input_response",
    ConsistencyCheckResponse: "consistency_check_response",
    UnmaskResponse: "unmask_response",
}
_AGGREGATOR_FIELDS: dict[type, str] = {
    ShareKeysRequest: "share_keys_request",
    ShareDelivery: "share_delivery",
    JustifyRequest: "justify_request",
    ShareVerdict: "share_verdict",
    MaskedInputRequest: "masked_input_request",
    ConsistencyCheckRequest: "consistency_check_request",
    UnmaskRequest: "unmask_request",
    Abort: "abort",
    secagg_pb2.Joined: "joined",
    secagg_pb2.SessionDone: "session_done",
}


@overload
def to_proto(value: SessionConfig) -> secagg_pb2.SessionConfig: ...
@overload
def to_proto(value: Any) -> Message: ...
def to_proto(value: Any) -> Message:
    """The protobuf form of a protocol message, SessionConfig, SumSpec or SessionRef."""
    try:
        proto, fill, _ = _CODECS[type(value)]
    except KeyError:
        raise TypeError(f"no protobuf form for {type(value).__name__}") from None
    out = proto()
    fill(value, out)
    return out


def session_config_bytes(config: SessionConfig) -> bytes:
    """Canonical bytes of a session configuration (deterministic serialization): what the session
    ticket's config digest covers, so devices and aggregator can check they run the same session."""
    return to_proto(config).SerializeToString(deterministic=True)


def from_proto(proto: Message) -> Any:
    """The value a protobuf message describes; stream envelopes are opened (``open_envelope``)."""
    decode = _DECODERS.get(type(proto))
    if decode is None:
        if isinstance(proto, (secagg_pb2.DeviceToAggregator, secagg_pb2.AggregatorToDevice)):
            return open_envelope(proto)
        raise WireError(f"cannot convert a {type(proto).__name__} to a protocol value")
    return decode(proto)


E = TypeVar("E", bound=Message)


def _wrap(envelope: E, fields: Mapping[type, str], message: Any) -> E:
    field = fields.get(type(message))
    if field is None:
        raise TypeError(f"a {type(message).__name__} does not travel in {message_name(envelope)}")
    target = getattr(envelope, field)
    target.SetInParent()  # selects the oneof even for an empty message (SessionDone of no sums)
    if isinstance(message, Message):
        target.CopyFrom(message)
    else:
        _CODECS[type(message)][1](message, target)
    return envelope


def device_envelope(message: ClientMessage) -> secagg_pb2.DeviceToAggregator:
    """Wrap what a device sends (a client protocol message; its Join rides in metadata)."""
    return _wrap(secagg_pb2.DeviceToAggregator(), _DEVICE_FIELDS, message)


def aggregator_envelope(
    message: ServerMessage | secagg_pb2.Joined | secagg_pb2.SessionDone,
) -> secagg_pb2.AggregatorToDevice:
    """Wrap what the aggregator sends (a server protocol message, or Joined/SessionDone)."""
    return _wrap(secagg_pb2.AggregatorToDevice(), _AGGREGATOR_FIELDS, message)


@overload
def open_envelope(envelope: secagg_pb2.DeviceToAggregator) -> ClientMessage: ...
@overload
def open_envelope(
    envelope: secagg_pb2.AggregatorToDevice,
) -> ServerMessage | secagg_pb2.Joined | secagg_pb2.SessionDone: ...
def open_envelope(envelope: secagg_pb2.DeviceToAggregator | secagg_pb2.AggregatorToDevice) -> Any:
    """The message a stream envelope carries: a protocol value, or the Joined or SessionDone
    proto as is (session plumbing, which the services handle themselves)."""
    if not isinstance(envelope, (secagg_pb2.DeviceToAggregator, secagg_pb2.AggregatorToDevice)):
        raise WireError(f"not a stream envelope: {type(envelope).__name__}")
    field = envelope.WhichOneof("message")
    if field is None:
        raise WireError(f"{message_name(envelope)} carries no message")
    inner = getattr(envelope, field)
    decode = _DECODERS.get(type(inner))
    return inner if decode is None else decode(inner)
