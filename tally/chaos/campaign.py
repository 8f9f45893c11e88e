"""The fault campaign: rounds of a real job on real processes, one random fault each, and the
invariants checked after every round.

Faults: device dropouts in one phase (below the protocol's threshold, and far past it for one
attempt), an aggregator or the coordinator SIGKILLed at a random moment of the round and
restarted, misbehaving devices (late, duplicated, replayed or corrupt messages, streams left open
and unread); with coordinator replicas over PostgreSQL, the leading replica SIGKILLed too, or
SIGSTOPped past its lease (its connections left open) and resumed once another leads: it must
stop on its own, having committed, seated and opened nothing meanwhile (the invariants below).
Invariants: every committed cohort sum is exactly the sum of its contributors' inputs
(fingerprints, ``tally.loadtest.sum_audit``); rounds commit in order, each once, none lost (the
coordinator's own database, read only); every round ends, committed or failed, by its
deadline; no process died that was not killed; no process's memory grows without bound. The
fleet is synthetic (``tally.loadtest.synthetic``), so every expected sum is known exactly.
"""

from __future__ import annotations

import asyncio
import random
import sqlite3
import statistics
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from tally.client.retry import RetryPolicy
from tally.coordinator.spec.jobspec import parse
from tally.coordinator.state.database import Database
from tally.loadtest import Fleet
from tally.loadtest.behaviour import BehaviourProfile
from tally.loadtest.dropout import DEFAULT_PHASES
from tally.loadtest.fleet import device_ids
from tally.loadtest.sum_audit import EXACT, SumAudit, outcome_counts
from tally.loadtest.synthetic import SyntheticUpdates
from tally.ops.cluster import ProcessCluster, wait_for
from tally.wire.v1 import admin_pb2, common_pb2

FAULTS = ("none", "dropouts", "dropouts_past_threshold", "kill_aggregator", "kill_coordinator", "misbehaviour")
# Only with device_processes > 1: a device front SIGKILLed mid-round (the coordinator restarts it).
FRONT_FAULTS = ("kill_device_front",)
# Only with replicas > 1: whichever replica leads SIGKILLed mid-round ("kill_coordinator" kills the
# replica the devices reach, leading or not), or paused past its lease and resumed.
REPLICA_FAULTS = ("kill_leader", "pause_leader")
# The replicas' lease (tally coordinator --leader-lease): short, so a paused leader's round still
# ends by its deadline.
LEADER_LEASE_S = 4.0
# What misbehaving devices do (``tally.loadtest.behaviour.Misbehaviour``): one kind per round, in turn.
MISBEHAVIOURS = ("late", "duplicate", "replay", "corrupt", "stall")
DEADLINES = {"checkin": 6, "download": 6, "advertise_keys": 4, "share_keys": 4, "masked_input": 6, "unmask": 4}
# Restarting a process (interpreter, imports, TLS, SQLite) takes seconds on a small machine.
RESTART_ALLOWANCE_S = 30.0
# The job runs ahead of the campaign (it commits rounds while the campaign audits one or brings a
# process back): with this many rounds per campaign round it does not end while the campaign runs,
# so no fault waits on a job that ended as it was aimed.
JOB_ROUNDS_PER_CAMPAIGN_ROUND = 20
# A job that has not ended: a just-submitted one is PENDING until its first round starts.
LIVE = (common_pb2.JOB_STATE_PENDING, common_pb2.JOB_STATE_RUNNING)
MEMORY_GROWTH_LIMIT = 1.5
MEMORY_SLACK_BYTES = 64 << 20

JOB_SPEC = """\
name: chaos-{n}
algorithm: fedavg
rounds: {rounds}
cohort_size: {cohort}
over_selection: 1.2
min_cohort: 7
retries: {retries}
model: {{kind: mlp, inputs: 64, classes: 10, hidden: {hidden}, seed: 0}}
secure: {{dropout_rate: 0.25, corrupt_rate: 0.05}}
deadlines: {deadlines}
"""


@dataclass(frozen=True)
class CampaignConfig:
    rounds: int = 10
    devices: int = 60
    cohort: int = 20
    aggregators: int = 2
    hidden: int = 16
    retries: int = 6
    seed: int = 0
    faults: tuple[str, ...] = FAULTS
    device_processes: int = 1  # the coordinator's (tally coordinator --device-processes)
    replicas: int = 1  # coordinator replicas over PostgreSQL (Campaign's database_url)

    def __post_init__(self) -> None:
        if self.device_processes == 1 and set(self.faults) & set(FRONT_FAULTS):
            raise ValueError("kill_device_front needs device_processes > 1: there is no front to kill")
        if self.replicas == 1 and set(self.faults) & set(REPLICA_FAULTS):
            raise ValueError(f"{', '.join(sorted(set(self.faults) & set(REPLICA_FAULTS)))} needs replicas > 1: "
                             "one coordinator is killed by kill_coordinator")

    @property
    def round_deadline_s(self) -> float:
        """Every attempt may run to its deadlines, and a killed process must come back."""
        return (self.retries + 1) * (sum(DEADLINES.values()) + 5.0) + RESTART_ALLOWANCE_S


class VaryingDropouts:
    """A dropout plan the campaign changes between rounds (``DropoutPlan``'s interface)."""

    def __init__(self, seed: int) -> None:
        self.probability, self.phases = 0.0, DEFAULT_PHASES
        self._seed = seed
        self._sessions_left: int | None = None

    def set(self, probability: float, phases: tuple[str, ...] = DEFAULT_PHASES,
            sessions: int | None = None) -> None:
        """``sessions``: the plan holds for that many sessions (one attempt's seats), then no
        device leaves. A fault meant for one attempt cannot be switched off by watching for its
        failure: the coordinator seats the retry at once from the devices it held meanwhile, and
        their sessions start before a watcher sees the abort."""
        self.probability, self.phases, self._sessions_left = probability, phases, sessions

    def draws(self, device_id: str) -> Iterator[str | None]:
        rng = random.Random(f"{self._seed}/{device_id}")
        while True:
            leave = rng.random() < self.probability
            if self._sessions_left is not None:
                leave = leave and self._sessions_left > 0
                self._sessions_left -= 1
            yield rng.choice(self.phases) if leave else None


@dataclass
class RoundRecord:
    index: int
    job_id: str
    round: int
    fault: str
    detail: str
    outcome: str  # committed, job_failed, hung
    seconds: float
    sums_exact: int = 0
    sums_wrong: int = 0
    reason: str = ""  # why the job failed, as the coordinator says (job_failed only)
    # job_failed only, from the coordinator's database: how each attempt of the round ended, and
    # how many devices its retries could no longer seat (seated in an attempt that may have
    # received their input, never released): a retry seats only devices that sent no input.
    attempts: list[str] = field(default_factory=list)
    excluded: int = 0


@dataclass
class CampaignResult:
    config: dict
    rounds: list[RoundRecord] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    memory: dict[str, list[int]] = field(default_factory=dict)
    cpu_seconds: dict[str, float] = field(default_factory=dict)
    # Device messages the aggregators refused, by reason, since each last started (at the end).
    refused: dict[str, float] = field(default_factory=dict)

    def table(self) -> list[tuple[str, int, int, int, int]]:
        """(fault, rounds, committed, failed cleanly, hung) per fault."""
        rows = []
        for fault in sorted({r.fault for r in self.rounds}):
            of = [r for r in self.rounds if r.fault == fault]
            counts = Counter(r.outcome for r in of)
            rows.append((fault, len(of), counts["committed"], counts["job_failed"], counts["hung"]))
        return rows

    def to_dict(self) -> dict:
        return {"config": self.config, "faults": [dict(zip(("fault", "rounds", "committed", "job_failed", "hung"),
                                                           row, strict=True)) for row in self.table()],
                "sums": {"exact": sum(r.sums_exact for r in self.rounds),
                         "wrong": sum(r.sums_wrong for r in self.rounds)},
                "round_seconds": percentiles([r.seconds for r in self.rounds]),
                "violations": self.violations, "rounds": [asdict(r) for r in self.rounds],
                "memory_bytes": self.memory, "cpu_seconds": self.cpu_seconds, "refused": self.refused}


class Campaign:
    """``database_url``: the PostgreSQL database of ``config.replicas`` > 1 coordinator replicas
    (kept out of the config, which the record prints: it holds a password)."""

    def __init__(self, config: CampaignConfig, workdir: Path,
                 on_round: Callable[[RoundRecord], None] = lambda record: None,
                 database_url: str | None = None) -> None:
        self.config, self.workdir, self.on_round = config, workdir, on_round
        self.database_url = database_url
        self.rng = random.Random(config.seed)
        self.result = CampaignResult(asdict(config))
        self.killed: set[str] = set()
        self.jobs = 0
        self._block: list[str] = []
        self._misbehaved = 0
        self.seats = 0  # an attempt's seats in the current job

    async def run(self) -> CampaignResult:
        cfg = self.config
        lease = ["--leader-lease", str(LEADER_LEASE_S)] if cfg.replicas > 1 else []
        cluster = ProcessCluster(self.workdir, aggregators=cfg.aggregators,
                               coordinator_flags=["--device-processes", str(cfg.device_processes), *lease],
                               replicas=cfg.replicas, database_url=self.database_url)
        try:
            await cluster.start()
        except BaseException:
            await cluster.stop()  # those that did start
            raise
        dropouts = VaryingDropouts(cfg.seed)
        fleet = Fleet(cluster.target, cluster.tls,
                      [SyntheticUpdates(i, cfg.seed) for i in device_ids("chaos", cfg.devices)],
                      dropout=dropouts, seed=cfg.seed, retry=RetryPolicy(initial_seconds=0.2, max_seconds=2.0),
                      enrolment_key=cluster.enrolment_key, id_prefix="chaos", audit=True)
        stop = asyncio.Event()
        fleet_task = asyncio.create_task(fleet.run(stop))
        try:
            job_id = await self._new_job(cluster)
            for index in range(1, cfg.rounds + 1):
                job_id, round_ = await self._next_round(cluster, job_id)
                record = await self._round(cluster, fleet, dropouts, index, job_id, round_)
                self.result.rounds.append(record)
                self.on_round(record)
                if record.outcome != "committed":  # a failed job ends; the campaign goes on with a new one
                    job_id = await self._new_job(cluster)
                self._sample(cluster)
            self._check_state(cluster)
            self._check_memory()
        finally:
            stop.set()
            await asyncio.gather(fleet_task, return_exceptions=True)
            fleet.close()
            self.result.cpu_seconds = {name: u.cpu_seconds for name, u in cluster.usage().items()}
            self.result.refused = _refusals(cluster)
            await cluster.stop()
        return self.result

    async def _new_job(self, cluster: ProcessCluster) -> str:
        self.jobs += 1
        cfg = self.config
        deadlines = "{" + ", ".join(f"{k}: {v}" for k, v in DEADLINES.items()) + "}"
        spec = JOB_SPEC.format(n=self.jobs, rounds=JOB_ROUNDS_PER_CAMPAIGN_ROUND * cfg.rounds, cohort=cfg.cohort,
                               retries=cfg.retries, hidden=cfg.hidden, deadlines=deadlines)
        self.seats = parse(spec).selection_target
        return await cluster.submit(spec)

    async def _next_round(self, cluster: ProcessCluster, job_id: str) -> tuple[str, int]:
        """The job and round the next fault goes into: the round the job is running now. The job
        does not wait for the campaign (it commits rounds while the campaign audits one), so a
        count kept here would fall behind it and aim faults at rounds already committed, and at
        last at a job that had ended; a job that ended gives way to a new one."""
        seen: list[admin_pb2.Job] = []

        async def answered() -> bool:
            try:
                seen[:] = [await cluster.job(job_id, timeout=2.0)]
            except grpc.aio.AioRpcError:  # a restarted coordinator (or replica) is still resuming
                return False
            return True

        if not await wait_for(answered, RESTART_ALLOWANCE_S):  # every process is up: nothing to go on with
            raise RuntimeError(f"{job_id}: the Admin API did not answer within {RESTART_ALLOWANCE_S:g} s "
                               "with every process running")
        if seen[0].state not in LIVE:
            return await self._new_job(cluster), 1
        return job_id, seen[0].committed_round + 1

    async def _round(self, cluster: ProcessCluster, fleet: Fleet, dropouts: VaryingDropouts, index: int,
                     job_id: str, round_: int) -> RoundRecord:
        fault = self._next_fault()
        start = time.monotonic()
        injected = asyncio.create_task(self._inject(fault, cluster, fleet, dropouts, job_id))
        state: dict[str, admin_pb2.Job] = {}

        async def finished() -> bool:
            try:
                job = await cluster.job(job_id, timeout=2.0)
            except grpc.aio.AioRpcError:
                return False  # the coordinator may be down on purpose
            state["job"] = job
            return job.committed_round >= round_ or job.state == common_pb2.JOB_STATE_FAILED

        done = await wait_for(finished, self.config.round_deadline_s)
        detail = await injected
        dropouts.set(0.0)
        fleet.behave(None)
        await self._bring_back(cluster)
        seconds = time.monotonic() - start
        job = state.get("job")
        if not done:
            outcome = "hung"
            self.result.violations.append(f"round {round_} of {job_id} ({fault}) did not end within "
                                          f"{self.config.round_deadline_s:.0f} s")
        elif job is not None and job.committed_round >= round_:
            outcome = "committed"
        else:
            outcome = "job_failed"
        record = RoundRecord(index, job_id, round_, fault, detail, outcome, seconds,
                             reason=job.message if outcome == "job_failed" and job is not None else "")
        if outcome == "job_failed":
            with cluster.database() as db:
                record.attempts, record.excluded = failed_round(db, job_id, round_)
        if outcome == "committed":
            await self._audit(cluster, fleet, record)
        for name in cluster.died(self.killed):
            self.result.violations.append(f"{name} died without being killed (round {index}, log "
                                          f"{cluster.processes[name].log})")
            await cluster.restart(name)
        return record

    def _next_fault(self) -> str:
        """Faults in shuffled blocks, each block every fault once: a short campaign covers all."""
        if not self._block:
            self._block = list(self.config.faults)
            self.rng.shuffle(self._block)
        return self._block.pop()

    async def _inject(self, fault: str, cluster: ProcessCluster, fleet: Fleet, dropouts: VaryingDropouts,
                      job_id: str) -> str:
        """Inject ``fault`` into the round starting. The coordinator starts the next round the moment
        one commits (its selection was filled while the round aggregated), so a dropout fault left
        on until the campaign has seen the commit would hit the next round too: dropouts last one
        attempt's sessions. A kill still waits for its phase, which may come in the next round."""
        rng = self.rng
        if fault == "dropouts":
            rate, phase = rng.uniform(0.05, 0.25), rng.choice(DEFAULT_PHASES)
            dropouts.set(rate, (phase,), sessions=self.seats)
            return f"{rate:.2f} in {phase}"
        if fault == "dropouts_past_threshold":
            phase = rng.choice(DEFAULT_PHASES)
            aborted = fleet.stats().sessions_aborted
            dropouts.set(0.8, (phase,), sessions=self.seats)
            # For one attempt: it must fail cleanly (its survivors see the abort), the retry succeed.
            failed = await wait_for(lambda: _holds(fleet.stats().sessions_aborted > aborted),
                                    sum(DEADLINES.values()), every=0.05)
            dropouts.set(0.0)
            return f"0.80 in {phase} until {'an attempt failed' if failed else 'the attempt deadline'}"
        if fault == "misbehaviour":
            kind, rate = MISBEHAVIOURS[self._misbehaved % len(MISBEHAVIOURS)], rng.uniform(0.15, 0.25)
            self._misbehaved += 1  # kinds in turn: every fifth misbehaviour round, each kind once
            fleet.behave(BehaviourProfile.model_validate({"misbehaviour": {kind: rate}}))
            return f"{rate:.2f} {kind}"
        if fault in ("kill_aggregator", "kill_coordinator", "kill_device_front", "kill_leader", "pause_leader"):
            name = ("coordinator" if fault != "kill_aggregator"
                    else f"aggregator-{rng.randint(1, self.config.aggregators)}")
            target = rng.choice((common_pb2.ROUND_PHASE_SELECTION, common_pb2.ROUND_PHASE_AGGREGATION))
            seen: list[admin_pb2.Job] = []

            async def in_target_phase() -> bool:
                try:
                    seen[:] = [await cluster.job(job_id, timeout=2.0)]
                except grpc.aio.AioRpcError:
                    return False
                return seen[0].phase == target or seen[0].state not in LIVE

            await wait_for(in_target_phase, sum(DEADLINES.values()), every=0.02)
            where = (f"round {seen[0].round} in "
                     f"{common_pb2.RoundPhase.Name(seen[0].phase).removeprefix('ROUND_PHASE_')}"
                     if seen else "before the job answered")
            if fault == "kill_device_front":
                # One killed in the round before may still be starting again.
                if not await wait_for(lambda: _true(cluster.device_fronts()), RESTART_ALLOWANCE_S):
                    self.result.violations.append(f"no device front running {where}: a killed one was "
                                                  f"not started again within {RESTART_ALLOWANCE_S:g} s")
                    return f"no device front to kill {where}"
                front = rng.choice(cluster.device_fronts())
                front.kill()  # the coordinator notices and starts it again: nothing to restart here
                return f"device front {front.pid} killed {where}"
            if fault in ("kill_leader", "pause_leader"):
                leader = await asyncio.to_thread(cluster.leader)
                if leader is None:
                    self.result.violations.append(f"no coordinator replica leads {where}")
                    return f"no leader to {fault.partition('_')[0]} {where}"
                if fault == "pause_leader":
                    return await self._pause_leader(cluster, leader, where)
                name = leader
            down = rng.uniform(0.0, 3.0)
            self.killed.add(name)
            await cluster.kill(name)
            await asyncio.sleep(down)  # how long the process stays down
            await cluster.restart(name)
            self.killed.discard(name)
            return f"{name} killed {where}, down {down:.1f} s"
        return ""

    async def _pause_leader(self, cluster: ProcessCluster, leader: str, where: str) -> str:
        """SIGSTOP the leader, its connections open, until another replica leads (its lease ran
        out), then SIGCONT: it must find it lost the lead and stop by itself, writing nothing (a
        stale commit would break the invariants checked after the round); then it is started again,
        as its supervisor would, and follows."""
        process = cluster.processes[leader]
        self.killed.add(leader)  # its exit after the resume is expected
        process.pause()
        started = time.monotonic()
        took_over = await wait_for(lambda: _true(cluster.leader() not in (None, leader)),
                                   LEADER_LEASE_S + RESTART_ALLOWANCE_S)
        paused = time.monotonic() - started
        successor = await asyncio.to_thread(cluster.leader)
        process.resume()
        stopped = await wait_for(lambda: _true(not process.running), RESTART_ALLOWANCE_S)
        if not took_over:
            self.result.violations.append(f"no replica took over from {leader}, paused {where}, within "
                                          f"{LEADER_LEASE_S + RESTART_ALLOWANCE_S:g} s")
        if not stopped:
            self.result.violations.append(f"{leader}, paused {where} and resumed, did not stop within "
                                          f"{RESTART_ALLOWANCE_S:g} s")
            await cluster.kill(leader)
        await cluster.restart(leader)
        self.killed.discard(leader)
        return f"{leader} paused {where} for {paused:.1f} s, {successor} took over, the resumed one stopped"

    async def _bring_back(self, cluster: ProcessCluster) -> None:
        for name in list(self.killed):
            await cluster.restart(name)
            self.killed.discard(name)

    async def _audit(self, cluster: ProcessCluster, fleet: Fleet, record: RoundRecord) -> None:
        stub, md = cluster.admin()
        sums = await stub.GetRoundSums(admin_pb2.GetRoundSumsRequest(job_id=record.job_id, round=record.round),
                                       metadata=md, timeout=10)
        assert fleet.inputs is not None
        checks = SumAudit.of(i for i in list(fleet.inputs) if i.job_id == record.job_id and i.round == record.round
                             ).check(record.job_id, record.round, sums.sums)
        counts = outcome_counts(checks)
        record.sums_exact = counts[EXACT]
        record.sums_wrong = len(checks) - counts[EXACT]
        if not checks or record.sums_wrong:
            self.result.violations.append(f"round {record.round} of {record.job_id}: cohort sums {counts}")

    def _sample(self, cluster: ProcessCluster) -> None:
        for name, usage in cluster.usage().items():
            self.result.memory.setdefault(name, []).append(usage.rss_bytes)

    def _check_state(self, cluster: ProcessCluster) -> None:
        """From the coordinator's own database: each committed round of each job committed once,
        rounds contiguous from 1, and the job's committed round the last of them; and attempts
        started by leader epochs that never go back (a replica that lost the lead starts none)."""
        with cluster.database() as db:
            jobs = db.execute("SELECT job_id, committed_round FROM jobs").fetchall()
            for job_id, committed_round in jobs:
                rows = db.execute("SELECT round, COUNT(*) FROM rounds WHERE job_id = ? AND state = 'committed' "
                                  "GROUP BY round ORDER BY round", (job_id,)).fetchall()
                if [r for r, _ in rows] != list(range(1, committed_round + 1)):
                    self.result.violations.append(f"{job_id}: committed rounds {[r for r, _ in rows]}, "
                                                  f"job says {committed_round}")
                twice = [r for r, count in rows if count > 1]
                if twice:
                    self.result.violations.append(f"{job_id}: rounds committed more than once: {twice}")
                attempts = db.execute("SELECT round, attempt, epoch FROM rounds WHERE job_id = ? "
                                      "ORDER BY round, attempt", (job_id,)).fetchall()
                stale = [(r, a, e) for (r, a, e), (*_, before) in zip(attempts[1:], attempts, strict=False)
                         if e < before]
                if stale:
                    self.result.violations.append(f"{job_id}: attempts (round, attempt, epoch) started by a "
                                                  f"replica after a newer leader had: {stale}")

    def _check_memory(self) -> None:
        for name, samples in self.result.memory.items():
            if len(samples) < 8:
                continue
            quarter = len(samples) // 4
            first, last = statistics.median(samples[:quarter]), statistics.median(samples[-quarter:])
            if last > MEMORY_GROWTH_LIMIT * first + MEMORY_SLACK_BYTES:
                self.result.violations.append(
                    f"{name}: resident memory grew from {first / 2**20:.0f} MiB to {last / 2**20:.0f} MiB")


def failed_round(db: sqlite3.Connection | Database, job_id: str, round_: int) -> tuple[list[str], int]:
    """How each attempt of a round that failed its job ended, and how many devices were still
    turned away from its retries when it did (``ProcessCluster.database``)."""
    attempts = [m for (m,) in db.execute(
        "SELECT message FROM rounds WHERE job_id = ? AND round = ? ORDER BY attempt", (job_id, round_))]
    (excluded,) = db.execute(
        "SELECT COUNT(*) FROM seated WHERE job_id = ? AND round = ?", (job_id, round_)).fetchone()
    return attempts, excluded


def _refusals(cluster: ProcessCluster) -> dict[str, float]:
    refused: dict[str, float] = {}
    for name in cluster.processes:
        if name.startswith("aggregator-") and cluster.processes[name].running:
            for family in text_string_to_metric_families(cluster.scrape(name)):
                for sample in family.samples:
                    if sample.name == "tally_aggregator_rejected_total":
                        reason = sample.labels["reason"]
                        refused[reason] = refused.get(reason, 0.0) + sample.value
    return refused


async def _holds(value: bool) -> bool:
    return value


def percentiles(values: list[float]) -> dict[str, float]:
    return {f"p{q}": float(np.percentile(values, q)) for q in (50, 95, 99)} if values else {}


async def _true(value: object) -> bool:
    """``wait_for`` polls a coroutine function: ``value``'s truth, as one."""
    return bool(value)
