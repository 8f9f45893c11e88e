"""The secure sum: SecAgg with the SecAgg+ neighbour graph, as sans-IO state machines."""

from tally.secagg.client import SecAggClient
from tally.secagg.config import SessionConfig
from tally.secagg.crypto import SigningKey
from tally.secagg.driver import CohortRun, Dropout, enrol, run_cohort, secure_sum
from tally.secagg.errors import (
    DuplicateMessage,
    MalformedMessage,
    OutOfPhase,
    ProtocolError,
    SessionAbortedError,
    StaleMessage,
    UnknownSender,
)
from tally.secagg.messages import SessionRef, SumResult, SumSpec
from tally.secagg.params import GraphParams, ThreatModel, UnsafeParameters, choose_params, smallest_secure_cohort
from tally.secagg.policy import DevicePolicy, UnsafeSession
from tally.secagg.server import SecAggServer

__all__ = [
    "CohortRun",
    "DevicePolicy",
    "Dropout",
    "DuplicateMessage",
    "GraphParams",
    "MalformedMessage",
    "OutOfPhase",
    "ProtocolError",
    "SecAggClient",
    "SecAggServer",
    "SessionAbortedError",
    "SessionConfig",
    "SessionRef",
    "SigningKey",
    "StaleMessage",
    "SumResult",
    "SumSpec",
    "ThreatModel",
    "UnknownSender",
    "UnsafeParameters",
    "UnsafeSession",
    "choose_params",
    "smallest_secure_cohort",
    "enrol",
    "run_cohort",
    "secure_sum",
]
