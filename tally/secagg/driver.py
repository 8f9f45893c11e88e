"""In-process driver: a whole cohort through the real protocol, no network.

Later layers (the simulator, algorithm tests, benchmarks) use it to run algorithms
with real masking and real dropouts instead of quietly replacing the secure sum with
a plain one. Deadlines are simulated: when no message is left in flight, the phase's
deadline fires.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial

import numpy as np

from tally.codec import PayloadSchema, to_ring
from tally.secagg.client import SecAggClient
from tally.secagg.config import SessionConfig
from tally.secagg.crypto import SigningKey
from tally.secagg.errors import OutOfPhase, ProtocolError, StaleMessage
from tally.secagg.layouts import payload_bytes
from tally.secagg.messages import ClientMessage, Outgoing, SessionRef, SumResult
from tally.secagg.params import ThreatModel
from tally.secagg.phases import DROPPABLE, Phase, asked_for
from tally.secagg.policy import DevicePolicy
from tally.secagg.server import SecAggServer


@dataclass(frozen=True)
class Dropout:
    """A device that stops answering when asked for ``phase`` (of ``sum_id``, default the first sum)."""

    phase: str
    sum_id: str | None = None

    def __post_init__(self) -> None:
        if self.phase not in DROPPABLE:
            raise ValueError(f"unknown phase {self.phase!r}; one of {tuple(map(str, DROPPABLE))}")


@dataclass
class CohortRun:
    config: SessionConfig
    server: SecAggServer
    results: dict[str, SumResult]
    aborted: str | None
    server_seconds: dict[str, float] = field(default_factory=dict)
    client_seconds: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    upload_bytes: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    download_bytes: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    # Messages the server refused, e.g. Unmask answers that came after it had enough shares.
    rejected: list[tuple[ClientMessage, ProtocolError]] = field(default_factory=list)
    # Devices that refused to go on (e.g. too few surviving neighbours to unmask safely).
    refused: dict[int, ProtocolError] = field(default_factory=dict)


def enrol(n: int) -> dict[int, SigningKey]:
    """Fresh identity keys for devices 1..n: what enrolment gives devices of the services, for
    runs where one process plays every device."""
    return {i: SigningKey.generate() for i in range(1, n + 1)}


def run_cohort(
    config: SessionConfig,
    inputs: Mapping[int, Mapping[str, np.ndarray]],
    dropouts: Mapping[int, Dropout] | None = None,
    observe: Callable[[ClientMessage], None] | None = None,
    entropy: Callable[[int, int], bytes] | None = None,
    measure_bytes: bool = False,
    *,
    identities: Mapping[int, SigningKey],
    policy: DevicePolicy | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> CohortRun:
    """Run devices 1..n with ring-encoded ``inputs``.

    ``identities[i]`` is device i's enrolled key (the config's roster must list its public
    half); ``policy`` what every device accepts. ``observe`` sees every message the server
    receives; ``entropy(i, size)``, when given, replaces os.urandom as device i's key source
    (deterministic tests); ``measure_bytes`` fills the per-device byte counts (it walks every
    message, so it is off by default); ``clock`` times each device's and the server's steps
    (``time.process_time`` on a machine whose other load would inflate wall time).
    """
    dropouts = dict(dropouts or {})
    first_sum = config.sums[0].sum_id
    server = SecAggServer(config)
    run = CohortRun(config, server, server.results, None)
    clients = {
        i: SecAggClient(
            config, i, identities[i], policy=policy, entropy=partial(entropy, i) if entropy else os.urandom,
        )
        for i in range(1, config.n + 1)
    }
    for i, client in clients.items():
        for sum_id, vector in inputs[i].items():
            client.provide_input(sum_id, vector)
    dead: set[int] = set()
    to_server: deque[ClientMessage] = deque()

    def drops_at(i: int, phase: str, sum_id: str) -> bool:
        d = dropouts.get(i)
        if d is None or d.phase != phase:
            return False
        return phase in (Phase.ADVERTISE_KEYS, Phase.SHARE_KEYS) or sum_id == (d.sum_id or first_sum)

    def send(i: int, messages: list[ClientMessage]) -> None:
        if measure_bytes:
            run.upload_bytes[i] += sum(map(payload_bytes, messages))
        to_server.extend(messages)

    def deliver(outgoing: list[Outgoing]) -> None:
        for o in outgoing:
            i = o.recipient
            if i in dead:
                continue
            request = asked_for(o.message)
            if request is not None and drops_at(i, *request):
                dead.add(i)
                continue
            if measure_bytes:
                run.download_bytes[i] += payload_bytes(o.message)
            client = clients[i]
            phase = request[0] if request else client.phase
            start = clock()
            try:
                responses = client.receive(o.message)
            except ProtocolError as exc:
                run.refused[i] = exc
                dead.add(i)
                continue
            run.client_seconds[phase].append(clock() - start)
            send(i, responses)

    for i, client in clients.items():
        if drops_at(i, Phase.ADVERTISE_KEYS, first_sum):
            dead.add(i)
        else:
            start = clock()
            messages = client.start()
            run.client_seconds[Phase.ADVERTISE_KEYS].append(clock() - start)
            send(i, messages)

    def timed_server(call: Callable[[], list[Outgoing]]) -> list[Outgoing]:
        phase = server.phase
        start = clock()
        out = call()
        run.server_seconds[phase] = run.server_seconds.get(phase, 0.0) + clock() - start
        return out

    deliver(timed_server(server.start))

    while not server.finished:
        while to_server:
            message = to_server.popleft()
            if observe is not None:
                observe(message)
            try:
                deliver(timed_server(partial(server.receive, message)))
            except (OutOfPhase, StaleMessage) as exc:
                run.rejected.append((message, exc))
        if not server.finished:
            deliver(timed_server(server.on_deadline))
    run.aborted = server.aborted.reason if server.aborted else None
    return run


def secure_sum(
    schemas: Mapping[str, PayloadSchema],
    values: Mapping[int, Mapping[str, Mapping[str, np.ndarray]]],
    *,
    threat: ThreatModel | None = None,
    dropouts: Mapping[int, Dropout] | None = None,
    rng: np.random.Generator | None = None,
    ref: SessionRef | None = None,
    consistency_check: bool | None = None,
    observe: Callable[[ClientMessage], None] | None = None,
) -> tuple[dict[str, dict[str, np.ndarray]], CohortRun]:
    """Encode per-device payloads, run the protocol and decode each sum's total.

    ``values[i][sum_id][field]`` is device i's (1-based) value. Returns the decoded
    totals (over the devices that survived each sum) and the run, for its timings.
    """
    rng = rng or np.random.default_rng()
    threat = threat or ThreatModel()
    if consistency_check is None:
        consistency_check = threat.malicious_server
    n = len(values)
    if set(values) != set(range(1, n + 1)):
        raise ValueError("devices must be numbered 1..n")
    identities = enrol(n)
    config = SessionConfig.plan(
        ref or SessionRef("local", 0, "s0"),
        list(schemas.items()),
        n,
        threat,
        consistency_check=consistency_check,
        identities=[identities[i].public for i in range(1, n + 1)],
    )
    inputs: dict[int, dict[str, np.ndarray]] = {}
    for i, per_sum in values.items():
        inputs[i] = {}
        for spec in config.sums:
            encoded = schemas[spec.sum_id].encode(per_sum[spec.sum_id], rng)
            inputs[i][spec.sum_id] = to_ring(encoded.vector, spec.bits)
    # The simulated devices assume the job's threat model: the caller chose it for all of them.
    policy = DevicePolicy(threat=threat)
    run = run_cohort(config, inputs, dropouts, observe, identities=identities, policy=policy)
    decoded = {
        sum_id: schemas[sum_id].decode_sum(result.total, config.sum_spec(sum_id).bits)
        for sum_id, result in run.results.items()
    }
    return decoded, run
