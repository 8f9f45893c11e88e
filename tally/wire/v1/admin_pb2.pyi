import datetime

from google.protobuf import struct_pb2 as _struct_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from tally.wire.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SubmitJobRequest(_message.Message):
    __slots__ = ("spec_yaml", "spec_struct")
    SPEC_YAML_FIELD_NUMBER: _ClassVar[int]
    SPEC_STRUCT_FIELD_NUMBER: _ClassVar[int]
    spec_yaml: str
    spec_struct: _struct_pb2.Struct
    def __init__(self, spec_yaml: _Optional[str] = ..., spec_struct: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ...) -> None: ...

class Job(_message.Message):
    __slots__ = ("job_id", "name", "algorithm", "state", "round", "phase", "step", "committed_round", "spec_yaml", "created_at", "updated_at", "message", "task_reports", "rounds", "warnings", "attempts", "selection", "algorithm_version", "able_devices", "declared_devices", "devices_out_of_budget", "model_kind", "model_kind_version", "needs")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_ROUND_FIELD_NUMBER: _ClassVar[int]
    SPEC_YAML_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    UPDATED_AT_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    TASK_REPORTS_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    WARNINGS_FIELD_NUMBER: _ClassVar[int]
    ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    SELECTION_FIELD_NUMBER: _ClassVar[int]
    ALGORITHM_VERSION_FIELD_NUMBER: _ClassVar[int]
    ABLE_DEVICES_FIELD_NUMBER: _ClassVar[int]
    DECLARED_DEVICES_FIELD_NUMBER: _ClassVar[int]
    DEVICES_OUT_OF_BUDGET_FIELD_NUMBER: _ClassVar[int]
    MODEL_KIND_FIELD_NUMBER: _ClassVar[int]
    MODEL_KIND_VERSION_FIELD_NUMBER: _ClassVar[int]
    NEEDS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    name: str
    algorithm: str
    state: _common_pb2.JobState
    round: int
    phase: _common_pb2.RoundPhase
    step: str
    committed_round: int
    spec_yaml: str
    created_at: _timestamp_pb2.Timestamp
    updated_at: _timestamp_pb2.Timestamp
    message: str
    task_reports: _containers.RepeatedCompositeFieldContainer[TaskReportCount]
    rounds: int
    warnings: _containers.RepeatedScalarFieldContainer[str]
    attempts: _containers.RepeatedCompositeFieldContainer[RoundAttempt]
    selection: str
    algorithm_version: str
    able_devices: int
    declared_devices: int
    devices_out_of_budget: int
    model_kind: str
    model_kind_version: str
    needs: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, job_id: _Optional[str] = ..., name: _Optional[str] = ..., algorithm: _Optional[str] = ..., state: _Optional[_Union[_common_pb2.JobState, str]] = ..., round: _Optional[int] = ..., phase: _Optional[_Union[_common_pb2.RoundPhase, str]] = ..., step: _Optional[str] = ..., committed_round: _Optional[int] = ..., spec_yaml: _Optional[str] = ..., created_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., updated_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., message: _Optional[str] = ..., task_reports: _Optional[_Iterable[_Union[TaskReportCount, _Mapping]]] = ..., rounds: _Optional[int] = ..., warnings: _Optional[_Iterable[str]] = ..., attempts: _Optional[_Iterable[_Union[RoundAttempt, _Mapping]]] = ..., selection: _Optional[str] = ..., algorithm_version: _Optional[str] = ..., able_devices: _Optional[int] = ..., declared_devices: _Optional[int] = ..., devices_out_of_budget: _Optional[int] = ..., model_kind: _Optional[str] = ..., model_kind_version: _Optional[str] = ..., needs: _Optional[_Iterable[str]] = ...) -> None: ...

class RoundAttempt(_message.Message):
    __slots__ = ("attempt", "state", "started_at", "finished_at", "message")
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    FINISHED_AT_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    attempt: int
    state: str
    started_at: _timestamp_pb2.Timestamp
    finished_at: _timestamp_pb2.Timestamp
    message: str
    def __init__(self, attempt: _Optional[int] = ..., state: _Optional[str] = ..., started_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., finished_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., message: _Optional[str] = ...) -> None: ...

class TaskReportCount(_message.Message):
    __slots__ = ("outcome", "reason", "count", "example")
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    EXAMPLE_FIELD_NUMBER: _ClassVar[int]
    outcome: str
    reason: str
    count: int
    example: str
    def __init__(self, outcome: _Optional[str] = ..., reason: _Optional[str] = ..., count: _Optional[int] = ..., example: _Optional[str] = ...) -> None: ...

class GetJobRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class ListJobsRequest(_message.Message):
    __slots__ = ("states", "page_size", "page_token")
    STATES_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    states: _containers.RepeatedScalarFieldContainer[_common_pb2.JobState]
    page_size: int
    page_token: str
    def __init__(self, states: _Optional[_Iterable[_Union[_common_pb2.JobState, str]]] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListJobsResponse(_message.Message):
    __slots__ = ("jobs", "next_page_token")
    JOBS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[Job]
    next_page_token: str
    def __init__(self, jobs: _Optional[_Iterable[_Union[Job, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class RevokeDeviceRequest(_message.Message):
    __slots__ = ("device_id",)
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    device_id: str
    def __init__(self, device_id: _Optional[str] = ...) -> None: ...

class RevokedDevice(_message.Message):
    __slots__ = ("device_id",)
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    device_id: str
    def __init__(self, device_id: _Optional[str] = ...) -> None: ...

class CancelJobRequest(_message.Message):
    __slots__ = ("job_id", "reason")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    reason: str
    def __init__(self, job_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class WatchJobRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class JobEvent(_message.Message):
    __slots__ = ("job_id", "round", "phase", "step", "state", "metrics", "message", "time")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    round: int
    phase: _common_pb2.RoundPhase
    step: str
    state: _common_pb2.JobState
    metrics: _containers.ScalarMap[str, float]
    message: str
    time: _timestamp_pb2.Timestamp
    def __init__(self, job_id: _Optional[str] = ..., round: _Optional[int] = ..., phase: _Optional[_Union[_common_pb2.RoundPhase, str]] = ..., step: _Optional[str] = ..., state: _Optional[_Union[_common_pb2.JobState, str]] = ..., metrics: _Optional[_Mapping[str, float]] = ..., message: _Optional[str] = ..., time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class GetJobMetricsRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class RoundMetrics(_message.Message):
    __slots__ = ("round", "metrics", "committed_at")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    ROUND_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_AT_FIELD_NUMBER: _ClassVar[int]
    round: int
    metrics: _containers.ScalarMap[str, float]
    committed_at: _timestamp_pb2.Timestamp
    def __init__(self, round: _Optional[int] = ..., metrics: _Optional[_Mapping[str, float]] = ..., committed_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class JobMetrics(_message.Message):
    __slots__ = ("job_id", "rounds")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    rounds: _containers.RepeatedCompositeFieldContainer[RoundMetrics]
    def __init__(self, job_id: _Optional[str] = ..., rounds: _Optional[_Iterable[_Union[RoundMetrics, _Mapping]]] = ...) -> None: ...

class GetModelRequest(_message.Message):
    __slots__ = ("job_id", "round")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    round: int
    def __init__(self, job_id: _Optional[str] = ..., round: _Optional[int] = ...) -> None: ...

class ModelFileChunk(_message.Message):
    __slots__ = ("round", "digest", "total_bytes", "offset", "data")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    round: int
    digest: str
    total_bytes: int
    offset: int
    data: bytes
    def __init__(self, round: _Optional[int] = ..., digest: _Optional[str] = ..., total_bytes: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class GetRoundSumsRequest(_message.Message):
    __slots__ = ("job_id", "round")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    round: int
    def __init__(self, job_id: _Optional[str] = ..., round: _Optional[int] = ...) -> None: ...

class CohortSumFingerprint(_message.Message):
    __slots__ = ("session_id", "sum_id", "cohort", "bits", "contributors", "fingerprint")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SUM_ID_FIELD_NUMBER: _ClassVar[int]
    COHORT_FIELD_NUMBER: _ClassVar[int]
    BITS_FIELD_NUMBER: _ClassVar[int]
    CONTRIBUTORS_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    sum_id: str
    cohort: int
    bits: int
    contributors: _containers.RepeatedScalarFieldContainer[int]
    fingerprint: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, session_id: _Optional[str] = ..., sum_id: _Optional[str] = ..., cohort: _Optional[int] = ..., bits: _Optional[int] = ..., contributors: _Optional[_Iterable[int]] = ..., fingerprint: _Optional[_Iterable[int]] = ...) -> None: ...

class RoundSums(_message.Message):
    __slots__ = ("job_id", "round", "sums")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    SUMS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    round: int
    sums: _containers.RepeatedCompositeFieldContainer[CohortSumFingerprint]
    def __init__(self, job_id: _Optional[str] = ..., round: _Optional[int] = ..., sums: _Optional[_Iterable[_Union[CohortSumFingerprint, _Mapping]]] = ...) -> None: ...
