from tally.wire.v1 import secagg_pb2 as _secagg_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FieldKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FIELD_KIND_UNSPECIFIED: _ClassVar[FieldKind]
    FIELD_KIND_REAL: _ClassVar[FieldKind]
    FIELD_KIND_COUNT: _ClassVar[FieldKind]
FIELD_KIND_UNSPECIFIED: FieldKind
FIELD_KIND_REAL: FieldKind
FIELD_KIND_COUNT: FieldKind

class FieldSpec(_message.Message):
    __slots__ = ("name", "shape", "kind", "clip", "frac_bits")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    CLIP_FIELD_NUMBER: _ClassVar[int]
    FRAC_BITS_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    kind: FieldKind
    clip: float
    frac_bits: int
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., kind: _Optional[_Union[FieldKind, str]] = ..., clip: _Optional[float] = ..., frac_bits: _Optional[int] = ...) -> None: ...

class PayloadSchemaSpec(_message.Message):
    __slots__ = ("sum_id", "fields")
    SUM_ID_FIELD_NUMBER: _ClassVar[int]
    FIELDS_FIELD_NUMBER: _ClassVar[int]
    sum_id: str
    fields: _containers.RepeatedCompositeFieldContainer[FieldSpec]
    def __init__(self, sum_id: _Optional[str] = ..., fields: _Optional[_Iterable[_Union[FieldSpec, _Mapping]]] = ...) -> None: ...

class DeviceGrant(_message.Message):
    __slots__ = ("device_index", "token_sha256")
    DEVICE_INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_SHA256_FIELD_NUMBER: _ClassVar[int]
    device_index: int
    token_sha256: bytes
    def __init__(self, device_index: _Optional[int] = ..., token_sha256: _Optional[bytes] = ...) -> None: ...

class OpenSessionRequest(_message.Message):
    __slots__ = ("session_ticket", "config", "schemas", "deadlines", "devices", "owner_token_sha256")
    SESSION_TICKET_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    SCHEMAS_FIELD_NUMBER: _ClassVar[int]
    DEADLINES_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    OWNER_TOKEN_SHA256_FIELD_NUMBER: _ClassVar[int]
    session_ticket: bytes
    config: _secagg_pb2.SessionConfig
    schemas: _containers.RepeatedCompositeFieldContainer[PayloadSchemaSpec]
    deadlines: _secagg_pb2.PhaseDeadlines
    devices: _containers.RepeatedCompositeFieldContainer[DeviceGrant]
    owner_token_sha256: bytes
    def __init__(self, session_ticket: _Optional[bytes] = ..., config: _Optional[_Union[_secagg_pb2.SessionConfig, _Mapping]] = ..., schemas: _Optional[_Iterable[_Union[PayloadSchemaSpec, _Mapping]]] = ..., deadlines: _Optional[_Union[_secagg_pb2.PhaseDeadlines, _Mapping]] = ..., devices: _Optional[_Iterable[_Union[DeviceGrant, _Mapping]]] = ..., owner_token_sha256: _Optional[bytes] = ...) -> None: ...

class OpenSessionResponse(_message.Message):
    __slots__ = ("session_id", "address")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    address: str
    def __init__(self, session_id: _Optional[str] = ..., address: _Optional[str] = ...) -> None: ...

class AwaitResultRequest(_message.Message):
    __slots__ = ("session_id", "sum_id")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SUM_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    sum_id: str
    def __init__(self, session_id: _Optional[str] = ..., sum_id: _Optional[str] = ...) -> None: ...

class CohortSum(_message.Message):
    __slots__ = ("session_id", "sum_id", "total", "bits", "dim", "contributors", "dropped", "aborted_reason", "excluded")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SUM_ID_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    BITS_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    CONTRIBUTORS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    ABORTED_REASON_FIELD_NUMBER: _ClassVar[int]
    EXCLUDED_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    sum_id: str
    total: bytes
    bits: int
    dim: int
    contributors: _containers.RepeatedScalarFieldContainer[int]
    dropped: _containers.RepeatedScalarFieldContainer[int]
    aborted_reason: str
    excluded: _containers.RepeatedCompositeFieldContainer[ExcludedDevice]
    def __init__(self, session_id: _Optional[str] = ..., sum_id: _Optional[str] = ..., total: _Optional[bytes] = ..., bits: _Optional[int] = ..., dim: _Optional[int] = ..., contributors: _Optional[_Iterable[int]] = ..., dropped: _Optional[_Iterable[int]] = ..., aborted_reason: _Optional[str] = ..., excluded: _Optional[_Iterable[_Union[ExcludedDevice, _Mapping]]] = ...) -> None: ...

class ExcludedDevice(_message.Message):
    __slots__ = ("index", "reason", "proven")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    PROVEN_FIELD_NUMBER: _ClassVar[int]
    index: int
    reason: str
    proven: bool
    def __init__(self, index: _Optional[int] = ..., reason: _Optional[str] = ..., proven: _Optional[bool] = ...) -> None: ...

class CloseSessionRequest(_message.Message):
    __slots__ = ("session_id", "reason")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    reason: str
    def __init__(self, session_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class CloseSessionResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class FenceRequest(_message.Message):
    __slots__ = ("leader_epoch",)
    LEADER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    leader_epoch: bytes
    def __init__(self, leader_epoch: _Optional[bytes] = ...) -> None: ...

class FenceResponse(_message.Message):
    __slots__ = ("leader_epoch",)
    LEADER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    leader_epoch: int
    def __init__(self, leader_epoch: _Optional[int] = ...) -> None: ...
