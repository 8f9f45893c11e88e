import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from tally.wire.v1 import aggregator_pb2 as _aggregator_pb2
from tally.wire.v1 import common_pb2 as _common_pb2
from tally.wire.v1 import secagg_pb2 as _secagg_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RegisterRequest(_message.Message):
    __slots__ = ("device_id", "population", "attestation", "identity_public", "enrolment_credential", "timestamp", "signature")
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    POPULATION_FIELD_NUMBER: _ClassVar[int]
    ATTESTATION_FIELD_NUMBER: _ClassVar[int]
    IDENTITY_PUBLIC_FIELD_NUMBER: _ClassVar[int]
    ENROLMENT_CREDENTIAL_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    device_id: str
    population: str
    attestation: str
    identity_public: bytes
    enrolment_credential: bytes
    timestamp: float
    signature: bytes
    def __init__(self, device_id: _Optional[str] = ..., population: _Optional[str] = ..., attestation: _Optional[str] = ..., identity_public: _Optional[bytes] = ..., enrolment_credential: _Optional[bytes] = ..., timestamp: _Optional[float] = ..., signature: _Optional[bytes] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("token", "expires_at", "coordinator_key")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_KEY_FIELD_NUMBER: _ClassVar[int]
    token: str
    expires_at: _timestamp_pb2.Timestamp
    coordinator_key: bytes
    def __init__(self, token: _Optional[str] = ..., expires_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., coordinator_key: _Optional[bytes] = ...) -> None: ...

class Capabilities(_message.Message):
    __slots__ = ("accelerator", "sdk_version", "algorithms", "models", "trainer_capabilities")
    ACCELERATOR_FIELD_NUMBER: _ClassVar[int]
    SDK_VERSION_FIELD_NUMBER: _ClassVar[int]
    ALGORITHMS_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    TRAINER_CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    accelerator: str
    sdk_version: str
    algorithms: _containers.RepeatedCompositeFieldContainer[InstalledAlgorithm]
    models: _containers.RepeatedCompositeFieldContainer[InstalledModel]
    trainer_capabilities: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, accelerator: _Optional[str] = ..., sdk_version: _Optional[str] = ..., algorithms: _Optional[_Iterable[_Union[InstalledAlgorithm, _Mapping]]] = ..., models: _Optional[_Iterable[_Union[InstalledModel, _Mapping]]] = ..., trainer_capabilities: _Optional[_Iterable[str]] = ...) -> None: ...

class InstalledAlgorithm(_message.Message):
    __slots__ = ("name", "version")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: str
    def __init__(self, name: _Optional[str] = ..., version: _Optional[str] = ...) -> None: ...

class InstalledModel(_message.Message):
    __slots__ = ("name", "version")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: str
    def __init__(self, name: _Optional[str] = ..., version: _Optional[str] = ...) -> None: ...

class TaskReport(_message.Message):
    __slots__ = ("job_id", "round", "task_id", "outcome", "reason", "detail", "sent_input")
    class Outcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        OUTCOME_UNSPECIFIED: _ClassVar[TaskReport.Outcome]
        COMPLETED: _ClassVar[TaskReport.Outcome]
        DROPPED: _ClassVar[TaskReport.Outcome]
        ABORTED: _ClassVar[TaskReport.Outcome]
        REFUSED: _ClassVar[TaskReport.Outcome]
    OUTCOME_UNSPECIFIED: TaskReport.Outcome
    COMPLETED: TaskReport.Outcome
    DROPPED: TaskReport.Outcome
    ABORTED: TaskReport.Outcome
    REFUSED: TaskReport.Outcome
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    SENT_INPUT_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    round: int
    task_id: str
    outcome: TaskReport.Outcome
    reason: str
    detail: str
    sent_input: bool
    def __init__(self, job_id: _Optional[str] = ..., round: _Optional[int] = ..., task_id: _Optional[str] = ..., outcome: _Optional[_Union[TaskReport.Outcome, str]] = ..., reason: _Optional[str] = ..., detail: _Optional[str] = ..., sent_input: _Optional[bool] = ...) -> None: ...

class CheckInRequest(_message.Message):
    __slots__ = ("capabilities", "reports", "input_ledger", "privacy_budget_spent")
    CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    REPORTS_FIELD_NUMBER: _ClassVar[int]
    INPUT_LEDGER_FIELD_NUMBER: _ClassVar[int]
    PRIVACY_BUDGET_SPENT_FIELD_NUMBER: _ClassVar[int]
    capabilities: Capabilities
    reports: _containers.RepeatedCompositeFieldContainer[TaskReport]
    input_ledger: InputLedger
    privacy_budget_spent: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, capabilities: _Optional[_Union[Capabilities, _Mapping]] = ..., reports: _Optional[_Iterable[_Union[TaskReport, _Mapping]]] = ..., input_ledger: _Optional[_Union[InputLedger, _Mapping]] = ..., privacy_budget_spent: _Optional[_Iterable[str]] = ...) -> None: ...

class InputLedger(_message.Message):
    __slots__ = ("latest_round", "ledger_id")
    class LatestRoundEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    LATEST_ROUND_FIELD_NUMBER: _ClassVar[int]
    LEDGER_ID_FIELD_NUMBER: _ClassVar[int]
    latest_round: _containers.ScalarMap[str, int]
    ledger_id: str
    def __init__(self, latest_round: _Optional[_Mapping[str, int]] = ..., ledger_id: _Optional[str] = ...) -> None: ...

class RetryAfter(_message.Message):
    __slots__ = ("seconds", "reason", "population_idle")
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    POPULATION_IDLE_FIELD_NUMBER: _ClassVar[int]
    seconds: float
    reason: str
    population_idle: bool
    def __init__(self, seconds: _Optional[float] = ..., reason: _Optional[str] = ..., population_idle: _Optional[bool] = ...) -> None: ...

class Step(_message.Message):
    __slots__ = ("name", "sum_id", "broadcast", "schema", "reveal", "personal")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SUM_ID_FIELD_NUMBER: _ClassVar[int]
    BROADCAST_FIELD_NUMBER: _ClassVar[int]
    SCHEMA_FIELD_NUMBER: _ClassVar[int]
    REVEAL_FIELD_NUMBER: _ClassVar[int]
    PERSONAL_FIELD_NUMBER: _ClassVar[int]
    name: str
    sum_id: str
    broadcast: _containers.RepeatedCompositeFieldContainer[_common_pb2.Tensor]
    schema: _aggregator_pb2.PayloadSchemaSpec
    reveal: bool
    personal: bool
    def __init__(self, name: _Optional[str] = ..., sum_id: _Optional[str] = ..., broadcast: _Optional[_Iterable[_Union[_common_pb2.Tensor, _Mapping]]] = ..., schema: _Optional[_Union[_aggregator_pb2.PayloadSchemaSpec, _Mapping]] = ..., reveal: _Optional[bool] = ..., personal: _Optional[bool] = ...) -> None: ...

class TaskAssignment(_message.Message):
    __slots__ = ("job_id", "round", "task_id", "algorithm", "step", "model_version", "model_digest", "model_size", "chunk_size", "aggregator_address", "session_ticket", "device_index", "session_token", "session", "deadlines", "algorithm_options", "adaptation", "algorithm_version", "model_kind", "model_kind_version")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    MODEL_DIGEST_FIELD_NUMBER: _ClassVar[int]
    MODEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    CHUNK_SIZE_FIELD_NUMBER: _ClassVar[int]
    AGGREGATOR_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SESSION_TICKET_FIELD_NUMBER: _ClassVar[int]
    DEVICE_INDEX_FIELD_NUMBER: _ClassVar[int]
    SESSION_TOKEN_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    DEADLINES_FIELD_NUMBER: _ClassVar[int]
    ALGORITHM_OPTIONS_FIELD_NUMBER: _ClassVar[int]
    ADAPTATION_FIELD_NUMBER: _ClassVar[int]
    ALGORITHM_VERSION_FIELD_NUMBER: _ClassVar[int]
    MODEL_KIND_FIELD_NUMBER: _ClassVar[int]
    MODEL_KIND_VERSION_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    round: int
    task_id: str
    algorithm: str
    step: Step
    model_version: str
    model_digest: str
    model_size: int
    chunk_size: int
    aggregator_address: str
    session_ticket: bytes
    device_index: int
    session_token: str
    session: _secagg_pb2.SessionConfig
    deadlines: _secagg_pb2.PhaseDeadlines
    algorithm_options: str
    adaptation: str
    algorithm_version: str
    model_kind: str
    model_kind_version: str
    def __init__(self, job_id: _Optional[str] = ..., round: _Optional[int] = ..., task_id: _Optional[str] = ..., algorithm: _Optional[str] = ..., step: _Optional[_Union[Step, _Mapping]] = ..., model_version: _Optional[str] = ..., model_digest: _Optional[str] = ..., model_size: _Optional[int] = ..., chunk_size: _Optional[int] = ..., aggregator_address: _Optional[str] = ..., session_ticket: _Optional[bytes] = ..., device_index: _Optional[int] = ..., session_token: _Optional[str] = ..., session: _Optional[_Union[_secagg_pb2.SessionConfig, _Mapping]] = ..., deadlines: _Optional[_Union[_secagg_pb2.PhaseDeadlines, _Mapping]] = ..., algorithm_options: _Optional[str] = ..., adaptation: _Optional[str] = ..., algorithm_version: _Optional[str] = ..., model_kind: _Optional[str] = ..., model_kind_version: _Optional[str] = ...) -> None: ...

class CheckInResponse(_message.Message):
    __slots__ = ("retry_after", "task")
    RETRY_AFTER_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    retry_after: RetryAfter
    task: TaskAssignment
    def __init__(self, retry_after: _Optional[_Union[RetryAfter, _Mapping]] = ..., task: _Optional[_Union[TaskAssignment, _Mapping]] = ...) -> None: ...

class DownloadModelRequest(_message.Message):
    __slots__ = ("model_version", "digest", "offset")
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    model_version: str
    digest: str
    offset: int
    def __init__(self, model_version: _Optional[str] = ..., digest: _Optional[str] = ..., offset: _Optional[int] = ...) -> None: ...

class ModelChunk(_message.Message):
    __slots__ = ("offset", "data", "total_size", "digest")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SIZE_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    offset: int
    data: bytes
    total_size: int
    digest: str
    def __init__(self, offset: _Optional[int] = ..., data: _Optional[bytes] = ..., total_size: _Optional[int] = ..., digest: _Optional[str] = ...) -> None: ...

class GetStepRequest(_message.Message):
    __slots__ = ("job_id", "round", "task_id", "sum_id")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    SUM_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    round: int
    task_id: str
    sum_id: str
    def __init__(self, job_id: _Optional[str] = ..., round: _Optional[int] = ..., task_id: _Optional[str] = ..., sum_id: _Optional[str] = ...) -> None: ...

class GetStepResponse(_message.Message):
    __slots__ = ("retry_after", "step")
    RETRY_AFTER_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    retry_after: RetryAfter
    step: Step
    def __init__(self, retry_after: _Optional[_Union[RetryAfter, _Mapping]] = ..., step: _Optional[_Union[Step, _Mapping]] = ...) -> None: ...

class RoundStatusRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class RoundStatusResponse(_message.Message):
    __slots__ = ("job_state", "round", "phase", "step", "committed_round", "next_check_in_seconds", "model_version", "model_digest")
    JOB_STATE_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_ROUND_FIELD_NUMBER: _ClassVar[int]
    NEXT_CHECK_IN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    MODEL_DIGEST_FIELD_NUMBER: _ClassVar[int]
    job_state: _common_pb2.JobState
    round: int
    phase: _common_pb2.RoundPhase
    step: str
    committed_round: int
    next_check_in_seconds: float
    model_version: str
    model_digest: str
    def __init__(self, job_state: _Optional[_Union[_common_pb2.JobState, str]] = ..., round: _Optional[int] = ..., phase: _Optional[_Union[_common_pb2.RoundPhase, str]] = ..., step: _Optional[str] = ..., committed_round: _Optional[int] = ..., next_check_in_seconds: _Optional[float] = ..., model_version: _Optional[str] = ..., model_digest: _Optional[str] = ...) -> None: ...

class RevealRequest(_message.Message):
    __slots__ = ("job_id", "round", "task_id", "step", "values")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    round: int
    task_id: str
    step: str
    values: _containers.RepeatedCompositeFieldContainer[_common_pb2.Tensor]
    def __init__(self, job_id: _Optional[str] = ..., round: _Optional[int] = ..., task_id: _Optional[str] = ..., step: _Optional[str] = ..., values: _Optional[_Iterable[_Union[_common_pb2.Tensor, _Mapping]]] = ...) -> None: ...

class RevealResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
