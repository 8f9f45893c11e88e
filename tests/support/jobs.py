"""Jobs run end to end on the whole system (``in_process().whole_system``): the job text for any
built-in algorithm, a run that hands back the server state the coordinator committed, and a run of
a synthetic fleet whose every committed sum is audited. Several end-to-end modules check their own
algorithm or fleet with these, against an in-process reference.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np

from support.stack import in_process, run, spec
from tally import algorithms, modelio
from tally.evaluation import EvaluatedClient
from tally.loadtest import DropoutPlan
from tally.loadtest.behaviour import BehaviourProfile
from tally.loadtest.fleet import device_ids
from tally.loadtest.sum_audit import SumAudit, check_committed
from tally.loadtest.synthetic import SyntheticUpdates
from tally.wire.v1 import admin_pb2_grpc, common_pb2


class ShiftDevice:
    """Training moves every parameter by ``shift`` (a number or an array of the model's shape),
    whatever the model was: the noiseless FedAvg result, and each device's update, are known."""

    def __init__(self, shift: float | np.ndarray) -> None:
        self.shift = shift

    @property
    def num_examples(self) -> int:
        return 1

    def train(self, params, epochs, lr, batch_size):
        return {k: np.asarray(v) + self.shift for k, v in params.items()}, 0.0

    def evaluate(self, params):
        return 0.0, 0.0


def job_text(name: str, algorithm: str, rounds: int, cohort: int, kind: str, options: Mapping[str, Any]) -> str:
    return (
        f"name: {name}\nalgorithm: {algorithm}\nrounds: {rounds}\ncohort_size: {cohort}\n"
        f"over_selection: 1.0\nmin_cohort: 5\nretries: 3\nmodel: {{kind: {kind}}}\n"
        f"options: {json.dumps(options)}\n"  # JSON is YAML
        "secure: {dropout_rate: 0.1, corrupt_rate: 0.05}\n"
        "deadlines: {checkin: 10, download: 10, advertise_keys: 4, share_keys: 4, masked_input: 8, unmask: 4}\n"
    )


def reference_halves(algorithm: str, options: Mapping[str, Any], initial: dict | None = None, extra: str = ""):
    """The server and client halves as the coordinator and each device build them for such a job
    (its default evaluation around them, from the spec ``extra`` completes), for an in-process
    reference; ``initial``: the job's model when it is not the default MLP (its heads give FedDAR's
    domains)."""
    from tally.coordinator.spec import catalogue
    from tally.coordinator.spec.evaluation_spec import evaluated_job_server
    from tally.coordinator.spec.jobspec import parse

    kind = "mlp" if initial is None else "reference-model"
    if initial is not None:
        catalogue.register_model(kind, lambda _spec: initial)
    try:
        spec = parse(job_text("reference", algorithm, 1, 10, kind, options) + extra)
        server = evaluated_job_server(catalogue.make_server(spec.algorithm, spec.options), spec)
    finally:
        if initial is not None:
            catalogue.unregister_model(kind)
    return server, EvaluatedClient(algorithms.make(spec.algorithm, spec.options)[1])


def run_job(tmp_path, algorithm: str, options: Mapping[str, Any], kind: str, initial: dict, devices: list,
            rounds: int, extra: str = "", probe: Callable[[Any, str], Awaitable[Any]] | None = None):
    """Run the job (its spec plus ``extra`` YAML lines) on the real stack; return the final server
    state and what ``probe(stack, job_id)`` found once the job was done."""
    from tally.coordinator.spec import catalogue
    from tally.coordinator.spec.jobspec import parse
    from tally.coordinator.state.state_codec import state_from_bytes

    text = job_text(kind, algorithm, rounds, len(devices), kind, options) + extra
    catalogue.register_model(kind, lambda _spec: initial)

    async def main():
        async with in_process().whole_system(tmp_path) as s:
            job_id, fleet_stats = await s.run_job(text, devices)
            store = s.coordinator.store
            version = store.model_version(job_id)
            model = modelio.deserialize(store.read_blob(version.model_digest))
            template = algorithms.make(algorithm, parse(text).options)[0].init(model)  # with the opt-in
            state = state_from_bytes(store.read_blob(version.state_digest), template)
            probed = await probe(s, job_id) if probe is not None else None
            return await s.job(job_id), state, fleet_stats, probed

    try:
        job, state, fleet_stats, probed = run(main())
    finally:
        catalogue.unregister_model(kind)
    # ``rounds`` training rounds, and any the job's evaluation section adds after them.
    assert job.state == common_pb2.JOB_STATE_SUCCEEDED and job.committed_round == job.rounds >= rounds, job.message
    assert fleet_stats.rounds[job.job_id] == list(range(1, job.rounds + 1))
    return state, probed


def max_error(a: Mapping[str, np.ndarray], b: Mapping[str, np.ndarray]) -> float:
    assert set(a) == set(b)
    return max(float(np.max(np.abs(np.asarray(a[k], float) - np.asarray(b[k], float)))) for k in a)


@dataclass
class SyntheticRun:
    job: Any
    stats: Any
    checks: list
    inputs: list
    # Device messages the aggregators refused, by reason (all aggregators together).
    refused: dict[str, float]
    # What the devices' behaviour profile made them do, by kind.
    misbehaved: dict[str, float]
    # Dealers the aggregators excluded (their metric), and the job's events.
    excluded: float
    events: list[str]
    # Devices the coordinator keeps out of the job's later selections (proven bad dealers).
    convicted: frozenset[str] = frozenset()


def run_synthetic_job(tmp_path, n: int, rounds: int, cohort: int, dropout: float = 0.2,
                       profile: BehaviourProfile | None = None) -> SyntheticRun:
    ids = device_ids("syn", n)
    devices = [SyntheticUpdates(i, seed=7) for i in ids]

    async def main():
        async with in_process().whole_system(tmp_path) as s:
            job_id = await s.submit(spec("synthetic", rounds, cohort=cohort, over_selection=1.2))
            fleet = s.fleet(devices, id_prefix="syn", dropout=DropoutPlan(dropout, seed=4) if dropout else None,
                            seed=3, audit=True, profile=profile)
            try:
                stats = await fleet.run(until=fleet.until_job_done(job_id, every_seconds=0.2))
            finally:
                fleet.close()
            _, md = s.admin()
            async with grpc.aio.insecure_channel(s.target) as channel:
                checks = await check_committed(admin_pb2_grpc.AdminStub(channel), md, SumAudit.of(fleet.inputs))
            refused: dict[str, float] = {}
            for aggregator in s.aggregators:
                for family in aggregator.metrics.rejected.collect():
                    for sample in family.samples:
                        if sample.name.endswith("_total"):
                            reason = sample.labels["reason"]
                            refused[reason] = refused.get(reason, 0.0) + sample.value
            misbehaved = {sample.labels["kind"]: sample.value for family in fleet.metrics.misbehaviours.collect()
                          for sample in family.samples if sample.name.endswith("_total")}
            excluded = sum(a.metrics.registry.get_sample_value("tally_aggregator_excluded_devices_total") or 0.0
                           for a in s.aggregators)
            events = [e.message for e in s.coordinator.store.events(job_id)]
            return SyntheticRun(await s.job(job_id), stats, checks, fleet.inputs, refused, misbehaved, excluded, events,
                                s.coordinator.store.convicted(job_id))

    return run(main())
