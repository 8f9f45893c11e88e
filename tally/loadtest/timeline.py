"""What a simulated fleet saw, for its load-test report: latencies of every coordinator call and
protocol phase as the devices measured them, check-ins over time, when each round's phases ran,
where sessions ended early, the epsilon each device's own privacy ledger has spent over time, and
the tasks devices refused, by reason, over time.

Prometheus histograms answer "how many were slower than a bucket"; a load tester asks for p99
of a phase and a picture of the round. A ``FleetTimeline`` keeps a bounded uniform sample per
series (reservoir sampling, so 10,000 devices over hours stay a few megabytes), check-ins counted
per second, and per round the first ask and last answer of each phase. The devices' epsilons
are kept as moves per 10 ms (from one epsilon to another, and how many devices made it), not per
device: devices with the same history share one figure, so a fleet of 10,000 keeps a few entries
per round, and quantiles over the devices at any instant are exact. Timelines of several
processes or shards merge (``merge``), since their clocks are the machines' wall clocks.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tally.client.metrics import EPSILON_QUANTILES, ClientMetrics, epsilon_quantile

# Samples kept per series: percentiles up to p99 stay within a fraction of a percent.
RESERVOIR = 20_000
# The report's names of the quantiles the fleet exports (p50, p99, max).
EPSILON_SERIES = {("max" if q == 100 else f"p{q:g}"): q for q in EPSILON_QUANTILES.values()}
# The clock of the epsilon and refusal series: fine enough to part two rounds of a fast job,
# while the moves of many devices in one instant still share an entry.
MOVE_RESOLUTION_DIGITS = 2  # 10 ms
# (wall-clock time, epsilon before or None for a device that appeared, epsilon after)
EpsilonMove = tuple[float, float | None, float]


@dataclass
class _Reservoir:
    seen: int = 0
    kept: list[float] = field(default_factory=list)

    def add(self, value: float, rng: random.Random) -> None:
        self.seen += 1
        if len(self.kept) < RESERVOIR:
            self.kept.append(value)
        elif (slot := rng.randrange(self.seen)) < RESERVOIR:
            self.kept[slot] = value


class FleetTimeline:
    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)
        self.rpc: dict[str, _Reservoir] = {}
        self.phase: dict[str, _Reservoir] = {}
        self.checkins: Counter[int] = Counter()  # wall-clock second -> check-ins
        # "job/round" -> phase -> [first asked, last answered] (wall clock)
        self.rounds: dict[str, dict[str, list[float]]] = {}
        self.ended_early: Counter[str] = Counter()  # "phase/outcome" -> sessions
        self.epsilon_moves: Counter[EpsilonMove] = Counter()  # -> devices
        self.refusals: Counter[tuple[float, str]] = Counter()  # (wall-clock time, reason) -> tasks

    def record_rpc(self, method: str, seconds: float) -> None:
        self.rpc.setdefault(method, _Reservoir()).add(seconds, self._rng)
        if method == "CheckIn":
            self.checkins[int(time.time())] += 1

    def record_phase(self, job_id: str, round_: int, phase: str, seconds: float) -> None:
        """The device answered ``phase`` ``seconds`` after the aggregator asked."""
        self.phase.setdefault(phase, _Reservoir()).add(seconds, self._rng)
        now = time.time()
        span = self.rounds.setdefault(f"{job_id}/{round_}", {}).setdefault(phase, [now - seconds, now])
        span[0], span[1] = min(span[0], now - seconds), max(span[1], now)

    def record_end(self, phase: str, outcome: str) -> None:
        self.ended_early[f"{phase}/{outcome}"] += 1

    def record_epsilon(self, before: float | None, after: float) -> None:
        """A device's own ledger went from ``before`` (None: the device appeared) to ``after``."""
        self.epsilon_moves[(_now(), before, after)] += 1

    def record_refusal(self, reason: str) -> None:
        self.refusals[(_now(), reason)] += 1

    def merge(self, other: FleetTimeline) -> FleetTimeline:
        """Both timelines in one (reservoirs resampled in proportion to what each saw)."""
        merged = FleetTimeline()
        for name in ("rpc", "phase"):
            mine, theirs = getattr(self, name), getattr(other, name)
            for key in set(mine) | set(theirs):
                parts = [r for r in (mine.get(key), theirs.get(key)) if r is not None]
                getattr(merged, name)[key] = _combine(parts, merged._rng)
        merged.checkins = self.checkins + other.checkins
        merged.ended_early = self.ended_early + other.ended_early
        merged.epsilon_moves = self.epsilon_moves + other.epsilon_moves
        merged.refusals = self.refusals + other.refusals
        for source in (self.rounds, other.rounds):
            for key, phases in source.items():
                for phase, (start, end) in phases.items():
                    span = merged.rounds.setdefault(key, {}).setdefault(phase, [start, end])
                    span[0], span[1] = min(span[0], start), max(span[1], end)
        return merged

    def to_json(self) -> dict[str, Any]:
        return {
            "rpc": {k: {"seen": r.seen, "kept": r.kept} for k, r in self.rpc.items()},
            "phase": {k: {"seen": r.seen, "kept": r.kept} for k, r in self.phase.items()},
            "checkins": {str(k): v for k, v in self.checkins.items()},
            "rounds": self.rounds,
            "ended_early": dict(self.ended_early),
            "epsilon_moves": [[*move, n] for move, n in self.epsilon_moves.items()],
            "refusals": [[*key, n] for key, n in self.refusals.items()],
        }

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> FleetTimeline:
        timeline = cls()
        for name in ("rpc", "phase"):
            setattr(timeline, name, {k: _Reservoir(v["seen"], list(v["kept"])) for k, v in raw[name].items()})
        timeline.checkins = Counter({int(k): v for k, v in raw["checkins"].items()})
        timeline.rounds = {k: {p: list(span) for p, span in v.items()} for k, v in raw["rounds"].items()}
        timeline.ended_early = Counter(raw["ended_early"])
        timeline.epsilon_moves = Counter({(s, before, after): n for s, before, after, n in raw["epsilon_moves"]})
        timeline.refusals = Counter({(second, reason): n for second, reason, n in raw["refusals"]})
        return timeline

    def summary(self) -> dict[str, Any]:
        """Percentiles per coordinator call and per phase (seconds), check-in rate, round spans
        relative to the first check-in, early ends by phase, the devices' epsilon quantiles and
        refusals over time: the report's JSON."""
        start = min(self.checkins, default=0)
        return {
            "device_epsilon": _epsilon_over_time(self.epsilon_moves, start),
            "refusals": _refusals_over_time(self.refusals, start),
            "rpc_seconds": {k: _percentiles(r) for k, r in sorted(self.rpc.items())},
            "phase_seconds": {k: _percentiles(r) for k, r in sorted(self.phase.items())},
            "checkins_per_second": _rate(self.checkins),
            "rounds": {k: {p: [round(s - start, 3), round(e - start, 3)] for p, (s, e) in v.items()}
                       for k, v in self.rounds.items()},
            "ended_early": dict(sorted(self.ended_early.items())),
        }


def _now() -> float:
    return round(time.time(), MOVE_RESOLUTION_DIGITS)


def _since(at: float, start: int) -> float:
    """Seconds from ``start`` to ``at`` (none before it: devices appear before their first check-in)."""
    return round(max(at - start, 0.0), MOVE_RESOLUTION_DIGITS)


def _epsilon_over_time(moves: Counter[EpsilonMove], start: int) -> dict[str, list[float]]:
    """At each instant some device's ledger moved (seconds since ``start``): the devices counted
    so far and the quantiles of their epsilons, as the fleet exports them."""
    by_time: dict[float, list[tuple[float | None, float, int]]] = {}
    for (at, before, after), n in moves.items():
        by_time.setdefault(at, []).append((before, after, n))
    held: Counter[float] = Counter()  # epsilon -> devices at it
    out: dict[str, list[float]] = {"seconds": [], "devices": [], **{name: [] for name in EPSILON_SERIES}}
    for at in sorted(by_time):
        for before, after, n in by_time[at]:
            held[after] += n
            if before is not None:
                held[before] -= n
        held = +held  # drop the epsilons no device is at any more
        out["seconds"].append(_since(at, start))
        out["devices"].append(sum(held.values()))
        for name, q in EPSILON_SERIES.items():
            out[name].append(epsilon_quantile(held, q))
    return out


def _refusals_over_time(refusals: Counter[tuple[float, str]], start: int) -> dict[str, list[list[float]]]:
    """Per reason, [seconds since ``start``, tasks refused so far] at each instant it grew."""
    out: dict[str, list[list[float]]] = {}
    for (at, reason), n in sorted(refusals.items()):
        series = out.setdefault(reason, [])
        series.append([_since(at, start), (series[-1][1] if series else 0) + n])
    return out


class TimelineMetrics(ClientMetrics):
    """A fleet's metrics that also feed its report's ``timeline``: the devices measure once."""

    def __init__(self, timeline: FleetTimeline) -> None:
        super().__init__()
        self.timeline = timeline

    def observe_rpc(self, method: str, seconds: float) -> None:
        super().observe_rpc(method, seconds)
        self.timeline.record_rpc(method, seconds)

    def observe_phase(self, job_id: str, round_: int, phase: str, seconds: float) -> None:
        super().observe_phase(job_id, round_, phase, seconds)
        self.timeline.record_phase(job_id, round_, phase, seconds)

    def observe_end(self, phase: str, outcome: str) -> None:
        super().observe_end(phase, outcome)
        self.timeline.record_end(phase, outcome)

    def observe_epsilon(self, device_id: str, epsilon: float) -> None:
        before = self.epsilons.get(device_id)
        super().observe_epsilon(device_id, epsilon)
        if before != epsilon:
            self.timeline.record_epsilon(before, epsilon)

    def observe_refusal(self, reason: str) -> None:
        super().observe_refusal(reason)
        self.timeline.record_refusal(reason)


def _combine(parts: list[_Reservoir], rng: random.Random) -> _Reservoir:
    seen = sum(p.seen for p in parts)
    if sum(len(p.kept) for p in parts) <= RESERVOIR:
        return _Reservoir(seen, [v for p in parts for v in p.kept])
    kept = []
    for p in parts:  # each part's share of the merged reservoir is its share of what was seen
        kept += rng.sample(p.kept, min(len(p.kept), round(RESERVOIR * p.seen / seen)))
    return _Reservoir(seen, kept)


def _percentiles(r: _Reservoir) -> dict[str, float]:
    values = np.asarray(r.kept)
    return {"count": r.seen, **{f"p{q}": float(np.percentile(values, q)) for q in (50, 95, 99)}}


def _rate(counts: Counter[int]) -> dict[str, float]:
    if not counts:
        return {}
    seconds = max(counts) - min(counts) + 1
    per_second = np.zeros(seconds)
    for second, n in counts.items():
        per_second[second - min(counts)] = n
    return {"mean": float(per_second.mean()), "p50": float(np.median(per_second)), "max": float(per_second.max()),
            "seconds": seconds}
