from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SessionRef(_message.Message):
    __slots__ = ("job_id", "round", "session_id")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    round: int
    session_id: str
    def __init__(self, job_id: _Optional[str] = ..., round: _Optional[int] = ..., session_id: _Optional[str] = ...) -> None: ...

class SumSpec(_message.Message):
    __slots__ = ("sum_id", "dim", "bits")
    SUM_ID_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    BITS_FIELD_NUMBER: _ClassVar[int]
    sum_id: str
    dim: int
    bits: int
    def __init__(self, sum_id: _Optional[str] = ..., dim: _Optional[int] = ..., bits: _Optional[int] = ...) -> None: ...

class SessionConfig(_message.Message):
    __slots__ = ("ref", "sums", "n", "k", "t", "graph_seed", "consistency_check", "min_survivors", "plain", "identities")
    REF_FIELD_NUMBER: _ClassVar[int]
    SUMS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    T_FIELD_NUMBER: _ClassVar[int]
    GRAPH_SEED_FIELD_NUMBER: _ClassVar[int]
    CONSISTENCY_CHECK_FIELD_NUMBER: _ClassVar[int]
    MIN_SURVIVORS_FIELD_NUMBER: _ClassVar[int]
    PLAIN_FIELD_NUMBER: _ClassVar[int]
    IDENTITIES_FIELD_NUMBER: _ClassVar[int]
    ref: SessionRef
    sums: _containers.RepeatedCompositeFieldContainer[SumSpec]
    n: int
    k: int
    t: int
    graph_seed: bytes
    consistency_check: bool
    min_survivors: int
    plain: bool
    identities: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, ref: _Optional[_Union[SessionRef, _Mapping]] = ..., sums: _Optional[_Iterable[_Union[SumSpec, _Mapping]]] = ..., n: _Optional[int] = ..., k: _Optional[int] = ..., t: _Optional[int] = ..., graph_seed: _Optional[bytes] = ..., consistency_check: _Optional[bool] = ..., min_survivors: _Optional[int] = ..., plain: _Optional[bool] = ..., identities: _Optional[_Iterable[bytes]] = ...) -> None: ...

class PhaseDeadlines(_message.Message):
    __slots__ = ("advertise_keys_seconds", "share_keys_seconds", "masked_input_seconds", "consistency_check_seconds", "unmask_seconds")
    ADVERTISE_KEYS_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SHARE_KEYS_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MASKED_INPUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CONSISTENCY_CHECK_SECONDS_FIELD_NUMBER: _ClassVar[int]
    UNMASK_SECONDS_FIELD_NUMBER: _ClassVar[int]
    advertise_keys_seconds: float
    share_keys_seconds: float
    masked_input_seconds: float
    consistency_check_seconds: float
    unmask_seconds: float
    def __init__(self, advertise_keys_seconds: _Optional[float] = ..., share_keys_seconds: _Optional[float] = ..., masked_input_seconds: _Optional[float] = ..., consistency_check_seconds: _Optional[float] = ..., unmask_seconds: _Optional[float] = ...) -> None: ...

class SumPublicKeys(_message.Message):
    __slots__ = ("sum_id", "cipher_public", "mask_public", "seed_commitment")
    SUM_ID_FIELD_NUMBER: _ClassVar[int]
    CIPHER_PUBLIC_FIELD_NUMBER: _ClassVar[int]
    MASK_PUBLIC_FIELD_NUMBER: _ClassVar[int]
    SEED_COMMITMENT_FIELD_NUMBER: _ClassVar[int]
    sum_id: str
    cipher_public: bytes
    mask_public: bytes
    seed_commitment: bytes
    def __init__(self, sum_id: _Optional[str] = ..., cipher_public: _Optional[bytes] = ..., mask_public: _Optional[bytes] = ..., seed_commitment: _Optional[bytes] = ...) -> None: ...

class AdvertiseKeys(_message.Message):
    __slots__ = ("ref", "sender", "keys", "signature")
    REF_FIELD_NUMBER: _ClassVar[int]
    SENDER_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    ref: SessionRef
    sender: int
    keys: _containers.RepeatedCompositeFieldContainer[SumPublicKeys]
    signature: bytes
    def __init__(self, ref: _Optional[_Union[SessionRef, _Mapping]] = ..., sender: _Optional[int] = ..., keys: _Optional[_Iterable[_Union[SumPublicKeys, _Mapping]]] = ..., signature: _Optional[bytes] = ...) -> None: ...

class EncryptedShare(_message.Message):
    __slots__ = ("sum_id", "sender", "recipient", "ciphertext", "check")
    SUM_ID_FIELD_NUMBER: _ClassVar[int]
    SENDER_FIELD_NUMBER: _ClassVar[int]
    RECIPIENT_FIELD_NUMBER: _ClassVar[int]
    CIPHERTEXT_FIELD_NUMBER: _ClassVar[int]
    CHECK_FIELD_NUMBER: _ClassVar[int]
    sum_id: str
    sender: int
    recipient: int
    ciphertext: bytes
    check: bytes
    def __init__(self, sum_id: _Optional[str] = ..., sender: _Optional[int] = ..., recipient: _Optional[int] = ..., ciphertext: _Optional[bytes] = ..., check: _Optional[bytes] = ...) -> None: ...

class ShareCheck(_message.Message):
    __slots__ = ("sum_id", "coefficients")
    SUM_ID_FIELD_NUMBER: _ClassVar[int]
    COEFFICIENTS_FIELD_NUMBER: _ClassVar[int]
    sum_id: str
    coefficients: bytes
    def __init__(self, sum_id: _Optional[str] = ..., coefficients: _Optional[bytes] = ...) -> None: ...

class ShareKeysResponse(_message.Message):
    __slots__ = ("ref", "sender", "shares", "checks")
    REF_FIELD_NUMBER: _ClassVar[int]
    SENDER_FIELD_NUMBER: _ClassVar[int]
    SHARES_FIELD_NUMBER: _ClassVar[int]
    CHECKS_FIELD_NUMBER: _ClassVar[int]
    ref: SessionRef
    sender: int
    shares: _containers.RepeatedCompositeFieldContainer[EncryptedShare]
    checks: _containers.RepeatedCompositeFieldContainer[ShareCheck]
    def __init__(self, ref: _Optional[_Union[SessionRef, _Mapping]] = ..., sender: _Optional[int] = ..., shares: _Optional[_Iterable[_Union[EncryptedShare, _Mapping]]] = ..., checks: _Optional[_Iterable[_Union[ShareCheck, _Mapping]]] = ...) -> None: ...

class ShareComplaint(_message.Message):
    __slots__ = ("sum_id", "dealer", "holder", "signature")
    SUM_ID_FIELD_NUMBER: _ClassVar[int]
    DEALER_FIELD_NUMBER: _ClassVar[int]
    HOLDER_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    sum_id: str
    dealer: int
    holder: int
    signature: bytes
    def __init__(self, sum_id: _Optional[str] = ..., dealer: _Optional[int] = ..., holder: _Optional[int] = ..., signature: _Optional[bytes] = ...) -> None: ...

class ShareComplaints(_message.Message):
    __slots__ = ("ref", "sender", "complaints")
    REF_FIELD_NUMBER: _ClassVar[int]
    SENDER_FIELD_NUMBER: _ClassVar[int]
    COMPLAINTS_FIELD_NUMBER: _ClassVar[int]
    ref: SessionRef
    sender: int
    complaints: _containers.RepeatedCompositeFieldContainer[ShareComplaint]
    def __init__(self, ref: _Optional[_Union[SessionRef, _Mapping]] = ..., sender: _Optional[int] = ..., complaints: _Optional[_Iterable[_Union[ShareComplaint, _Mapping]]] = ...) -> None: ...

class RevealedShareKey(_message.Message):
    __slots__ = ("sum_id", "dealer", "holder", "key")
    SUM_ID_FIELD_NUMBER: _ClassVar[int]
    DEALER_FIELD_NUMBER: _ClassVar[int]
    HOLDER_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    sum_id: str
    dealer: int
    holder: int
    key: bytes
    def __init__(self, sum_id: _Optional[str] = ..., dealer: _Optional[int] = ..., holder: _Optional[int] = ..., key: _Optional[bytes] = ...) -> None: ...

class JustifyResponse(_message.Message):
    __slots__ = ("ref", "sender", "keys")
    REF_FIELD_NUMBER: _ClassVar[int]
    SENDER_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    ref: SessionRef
    sender: int
    keys: _containers.RepeatedCompositeFieldContainer[RevealedShareKey]
    def __init__(self, ref: _Optional[_Union[SessionRef, _Mapping]] = ..., sender: _Optional[int] = ..., keys: _Optional[_Iterable[_Union[RevealedShareKey, _Mapping]]] = ...) -> None: ...

class MaskedInputResponse(_message.Message):
    __slots__ = ("ref", "sum_id", "sender", "data", "offset", "more")
    REF_FIELD_NUMBER: _ClassVar[int]
    SUM_ID_FIELD_NUMBER: _ClassVar[int]
    SENDER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    MORE_FIELD_NUMBER: _ClassVar[int]
    ref: SessionRef
    sum_id: str
    sender: int
    data: bytes
    offset: int
    more: bool
    def __init__(self, ref: _Optional[_Union[SessionRef, _Mapping]] = ..., sum_id: _Optional[str] = ..., sender: _Optional[int] = ..., data: _Optional[bytes] = ..., offset: _Optional[int] = ..., more: _Optional[bool] = ...) -> None: ...

class ConsistencyCheckResponse(_message.Message):
    __slots__ = ("ref", "sum_id", "sender", "signature")
    REF_FIELD_NUMBER: _ClassVar[int]
    SUM_ID_FIELD_NUMBER: _ClassVar[int]
    SENDER_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    ref: SessionRef
    sum_id: str
    sender: int
    signature: bytes
    def __init__(self, ref: _Optional[_Union[SessionRef, _Mapping]] = ..., sum_id: _Optional[str] = ..., sender: _Optional[int] = ..., signature: _Optional[bytes] = ...) -> None: ...

class UnmaskResponse(_message.Message):
    __slots__ = ("ref", "sum_id", "sender", "seed_owners", "seed_shares", "key_owners", "key_shares")
    REF_FIELD_NUMBER: _ClassVar[int]
    SUM_ID_FIELD_NUMBER: _ClassVar[int]
    SENDER_FIELD_NUMBER: _ClassVar[int]
    SEED_OWNERS_FIELD_NUMBER: _ClassVar[int]
    SEED_SHARES_FIELD_NUMBER: _ClassVar[int]
    KEY_OWNERS_FIELD_NUMBER: _ClassVar[int]
    KEY_SHARES_FIELD_NUMBER: _ClassVar[int]
    ref: SessionRef
    sum_id: str
    sender: int
    seed_owners: _containers.RepeatedScalarFieldContainer[int]
    seed_shares: bytes
    key_owners: _containers.RepeatedScalarFieldContainer[int]
    key_shares: bytes
    def __init__(self, ref: _Optional[_Union[SessionRef, _Mapping]] = ..., sum_id: _Optional[str] = ..., sender: _Optional[int] = ..., seed_owners: _Optional[_Iterable[int]] = ..., seed_shares: _Optional[bytes] = ..., key_owners: _Optional[_Iterable[int]] = ..., key_shares: _Optional[bytes] = ...) -> None: ...

class NeighbourKeys(_message.Message):
    __slots__ = ("index", "keys", "signature")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    index: int
    keys: _containers.RepeatedCompositeFieldContainer[SumPublicKeys]
    signature: bytes
    def __init__(self, index: _Optional[int] = ..., keys: _Optional[_Iterable[_Union[SumPublicKeys, _Mapping]]] = ..., signature: _Optional[bytes] = ...) -> None: ...

class ShareKeysRequest(_message.Message):
    __slots__ = ("ref", "neighbours")
    REF_FIELD_NUMBER: _ClassVar[int]
    NEIGHBOURS_FIELD_NUMBER: _ClassVar[int]
    ref: SessionRef
    neighbours: _containers.RepeatedCompositeFieldContainer[NeighbourKeys]
    def __init__(self, ref: _Optional[_Union[SessionRef, _Mapping]] = ..., neighbours: _Optional[_Iterable[_Union[NeighbourKeys, _Mapping]]] = ...) -> None: ...

class ShareDelivery(_message.Message):
    __slots__ = ("ref", "shares")
    REF_FIELD_NUMBER: _ClassVar[int]
    SHARES_FIELD_NUMBER: _ClassVar[int]
    ref: SessionRef
    shares: _containers.RepeatedCompositeFieldContainer[EncryptedShare]
    def __init__(self, ref: _Optional[_Union[SessionRef, _Mapping]] = ..., shares: _Optional[_Iterable[_Union[EncryptedShare, _Mapping]]] = ...) -> None: ...

class JustifyRequest(_message.Message):
    __slots__ = ("ref", "complaints")
    REF_FIELD_NUMBER: _ClassVar[int]
    COMPLAINTS_FIELD_NUMBER: _ClassVar[int]
    ref: SessionRef
    complaints: _containers.RepeatedCompositeFieldContainer[ShareComplaint]
    def __init__(self, ref: _Optional[_Union[SessionRef, _Mapping]] = ..., complaints: _Optional[_Iterable[_Union[ShareComplaint, _Mapping]]] = ...) -> None: ...

class ShareVerdict(_message.Message):
    __slots__ = ("ref", "excluded", "keys")
    REF_FIELD_NUMBER: _ClassVar[int]
    EXCLUDED_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    ref: SessionRef
    excluded: _containers.RepeatedScalarFieldContainer[int]
    keys: _containers.RepeatedCompositeFieldContainer[RevealedShareKey]
    def __init__(self, ref: _Optional[_Union[SessionRef, _Mapping]] = ..., excluded: _Optional[_Iterable[int]] = ..., keys: _Optional[_Iterable[_Union[RevealedShareKey, _Mapping]]] = ...) -> None: ...

class MaskedInputRequest(_message.Message):
    __slots__ = ("ref", "sum_id")
    REF_FIELD_NUMBER: _ClassVar[int]
    SUM_ID_FIELD_NUMBER: _ClassVar[int]
    ref: SessionRef
    sum_id: str
    def __init__(self, ref: _Optional[_Union[SessionRef, _Mapping]] = ..., sum_id: _Optional[str] = ...) -> None: ...

class ConsistencyCheckRequest(_message.Message):
    __slots__ = ("ref", "sum_id", "survivors")
    REF_FIELD_NUMBER: _ClassVar[int]
    SUM_ID_FIELD_NUMBER: _ClassVar[int]
    SURVIVORS_FIELD_NUMBER: _ClassVar[int]
    ref: SessionRef
    sum_id: str
    survivors: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ref: _Optional[_Union[SessionRef, _Mapping]] = ..., sum_id: _Optional[str] = ..., survivors: _Optional[_Iterable[int]] = ...) -> None: ...

class SurvivorSignature(_message.Message):
    __slots__ = ("signer", "signature")
    SIGNER_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    signer: int
    signature: bytes
    def __init__(self, signer: _Optional[int] = ..., signature: _Optional[bytes] = ...) -> None: ...

class UnmaskRequest(_message.Message):
    __slots__ = ("ref", "sum_id", "survivors", "signatures")
    REF_FIELD_NUMBER: _ClassVar[int]
    SUM_ID_FIELD_NUMBER: _ClassVar[int]
    SURVIVORS_FIELD_NUMBER: _ClassVar[int]
    SIGNATURES_FIELD_NUMBER: _ClassVar[int]
    ref: SessionRef
    sum_id: str
    survivors: _containers.RepeatedScalarFieldContainer[int]
    signatures: _containers.RepeatedCompositeFieldContainer[SurvivorSignature]
    def __init__(self, ref: _Optional[_Union[SessionRef, _Mapping]] = ..., sum_id: _Optional[str] = ..., survivors: _Optional[_Iterable[int]] = ..., signatures: _Optional[_Iterable[_Union[SurvivorSignature, _Mapping]]] = ...) -> None: ...

class Abort(_message.Message):
    __slots__ = ("ref", "reason")
    REF_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    ref: SessionRef
    reason: str
    def __init__(self, ref: _Optional[_Union[SessionRef, _Mapping]] = ..., reason: _Optional[str] = ...) -> None: ...

class Join(_message.Message):
    __slots__ = ("session_ticket", "device_index", "session_token")
    SESSION_TICKET_FIELD_NUMBER: _ClassVar[int]
    DEVICE_INDEX_FIELD_NUMBER: _ClassVar[int]
    SESSION_TOKEN_FIELD_NUMBER: _ClassVar[int]
    session_ticket: bytes
    device_index: int
    session_token: str
    def __init__(self, session_ticket: _Optional[bytes] = ..., device_index: _Optional[int] = ..., session_token: _Optional[str] = ...) -> None: ...

class Joined(_message.Message):
    __slots__ = ("config", "deadlines")
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    DEADLINES_FIELD_NUMBER: _ClassVar[int]
    config: SessionConfig
    deadlines: PhaseDeadlines
    def __init__(self, config: _Optional[_Union[SessionConfig, _Mapping]] = ..., deadlines: _Optional[_Union[PhaseDeadlines, _Mapping]] = ...) -> None: ...

class SessionDone(_message.Message):
    __slots__ = ("sum_ids",)
    SUM_IDS_FIELD_NUMBER: _ClassVar[int]
    sum_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, sum_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class DeviceToAggregator(_message.Message):
    __slots__ = ("advertise_keys", "share_keys_response", "masked_input_response", "consistency_check_response", "unmask_response", "share_complaints", "justify_response")
    ADVERTISE_KEYS_FIELD_NUMBER: _ClassVar[int]
    SHARE_KEYS_RESPONSE_FIELD_NUMBER: _ClassVar[int]
    MASKED_INPUT_RESPONSE_FIELD_NUMBER: _ClassVar[int]
    CONSISTENCY_CHECK_RESPONSE_FIELD_NUMBER: _ClassVar[int]
    UNMASK_RESPONSE_FIELD_NUMBER: _ClassVar[int]
    SHARE_COMPLAINTS_FIELD_NUMBER: _ClassVar[int]
    JUSTIFY_RESPONSE_FIELD_NUMBER: _ClassVar[int]
    advertise_keys: AdvertiseKeys
    share_keys_response: ShareKeysResponse
    masked_input_response: MaskedInputResponse
    consistency_check_response: ConsistencyCheckResponse
    unmask_response: UnmaskResponse
    share_complaints: ShareComplaints
    justify_response: JustifyResponse
    def __init__(self, advertise_keys: _Optional[_Union[AdvertiseKeys, _Mapping]] = ..., share_keys_response: _Optional[_Union[ShareKeysResponse, _Mapping]] = ..., masked_input_response: _Optional[_Union[MaskedInputResponse, _Mapping]] = ..., consistency_check_response: _Optional[_Union[ConsistencyCheckResponse, _Mapping]] = ..., unmask_response: _Optional[_Union[UnmaskResponse, _Mapping]] = ..., share_complaints: _Optional[_Union[ShareComplaints, _Mapping]] = ..., justify_response: _Optional[_Union[JustifyResponse, _Mapping]] = ...) -> None: ...

class AggregatorToDevice(_message.Message):
    __slots__ = ("joined", "share_keys_request", "share_delivery", "masked_input_request", "consistency_check_request", "unmask_request", "abort", "session_done", "justify_request", "share_verdict")
    JOINED_FIELD_NUMBER: _ClassVar[int]
    SHARE_KEYS_REQUEST_FIELD_NUMBER: _ClassVar[int]
    SHARE_DELIVERY_FIELD_NUMBER: _ClassVar[int]
    MASKED_INPUT_REQUEST_FIELD_NUMBER: _ClassVar[int]
    CONSISTENCY_CHECK_REQUEST_FIELD_NUMBER: _ClassVar[int]
    UNMASK_REQUEST_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    SESSION_DONE_FIELD_NUMBER: _ClassVar[int]
    JUSTIFY_REQUEST_FIELD_NUMBER: _ClassVar[int]
    SHARE_VERDICT_FIELD_NUMBER: _ClassVar[int]
    joined: Joined
    share_keys_request: ShareKeysRequest
    share_delivery: ShareDelivery
    masked_input_request: MaskedInputRequest
    consistency_check_request: ConsistencyCheckRequest
    unmask_request: UnmaskRequest
    abort: Abort
    session_done: SessionDone
    justify_request: JustifyRequest
    share_verdict: ShareVerdict
    def __init__(self, joined: _Optional[_Union[Joined, _Mapping]] = ..., share_keys_request: _Optional[_Union[ShareKeysRequest, _Mapping]] = ..., share_delivery: _Optional[_Union[ShareDelivery, _Mapping]] = ..., masked_input_request: _Optional[_Union[MaskedInputRequest, _Mapping]] = ..., consistency_check_request: _Optional[_Union[ConsistencyCheckRequest, _Mapping]] = ..., unmask_request: _Optional[_Union[UnmaskRequest, _Mapping]] = ..., abort: _Optional[_Union[Abort, _Mapping]] = ..., session_done: _Optional[_Union[SessionDone, _Mapping]] = ..., justify_request: _Optional[_Union[JustifyRequest, _Mapping]] = ..., share_verdict: _Optional[_Union[ShareVerdict, _Mapping]] = ...) -> None: ...
