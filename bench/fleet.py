"""Servers under load, as deployed: the coordinator, each aggregator and each fleet shard in its
own process (TLS on 127.0.0.1), a synthetic fleet whose every committed sum is checked, every
process's CPU seconds and peak resident memory measured from outside (psutil), and the latency
percentiles of every coordinator call and protocol phase as the devices saw them.

    .venv/bin/python bench/fleet.py --devices 300 --cohort 60 --rounds 2   # a first load test, under a minute
    .venv/bin/python bench/fleet.py --devices 2000 --shards 2 --cohort 200 --hidden 133 --rounds 5 --json out.json
    .venv/bin/python bench/fleet.py --devices 10000 --idle 60 --json idle.json   # memory of idle devices

It shows its progress and ends with a summary, and exits 1 when a round did not commit or a
committed sum was not exact; every measurement is in the JSON (--json). Round wall times come
from the coordinator's own record (its SQLite state, read-only).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import signal
import sqlite3
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import psutil
from prometheus_client.parser import text_string_to_metric_families
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from tally.cli.console import console
from tally.loadtest.sum_audit import SumAudit, check_committed, outcome_counts
from tally.loadtest.timeline import FleetTimeline
from tally.ops.cluster import ProcessCluster
from tally.shutdown import Signalled, cancelled_by_signals
from tally.wire.v1 import common_pb2

# What the progress line is told: what is going on, and how far along (rounds committed, or
# seconds of an idle run) when that is known.
Show = Callable[..., None]

SPEC = """\
name: bench-fleet
algorithm: fedavg
rounds: {rounds}
cohort_size: {cohort}
over_selection: 1.1
min_cohort: {min_cohort}
retries: 3
model: {{kind: mlp, inputs: 64, classes: 10, hidden: {hidden}, seed: 0}}
secure: {{dropout_rate: {dropout}, corrupt_rate: 0.05{plain}{semi}}}
deadlines: {{checkin: 60, download: 60, advertise_keys: 60, share_keys: 120, masked_input: 120, unmask: 60}}
"""


def _samples(exposition: str, name: str, label: str = "phase") -> dict[str, float]:
    """Values of series ``name`` by one label (prometheus_client's own parser)."""
    return {sample.labels.get(label, ""): sample.value
            for family in text_string_to_metric_families(exposition)
            for sample in family.samples if sample.name == name}


def _itemised(exposition: str, total: float, rounds: int) -> dict[str, float]:
    """An aggregator's CPU per round split as the issue asks: the secure-sum engine, the wire
    conversion (protobuf parsing and serialising, and the engine's values to and from messages),
    and the rest (gRPC, TLS, the event loop and the session's glue), from its own counters."""
    engine = sum(_samples(exposition, "tally_aggregator_engine_cpu_seconds_total").values()) / max(rounds, 1)
    wire = {direction: s / max(rounds, 1) for direction, s in
            _samples(exposition, "tally_aggregator_wire_cpu_seconds_total", "direction").items()}
    return {"total": total, "engine": engine, "wire_decode": wire.get("decode", 0.0),
            "wire_encode": wire.get("encode", 0.0), "rest": total - engine - sum(wire.values())}


def _steady(at_commit: dict[int, dict[str, float]]) -> dict[str, float]:
    """CPU per round from the first commit to the last one seen (empty with fewer than two)."""
    if len(at_commit) < 2:
        return {}
    first, last = min(at_commit), max(at_commit)
    return {k: (at_commit[last][k] - at_commit[first].get(k, 0.0)) / (last - first) for k in at_commit[last]}


class Sampler:
    """Peak RSS and last CPU seconds of a set of processes, sampled every ``every`` seconds."""

    def __init__(self) -> None:
        self.peak: dict[str, int] = {}
        self.cpu: dict[str, float] = {}

    def sample(self, pids: dict[str, int]) -> None:
        for name, pid in pids.items():
            try:
                p = psutil.Process(pid)
                times, rss = p.cpu_times(), p.memory_info().rss
            except psutil.NoSuchProcess:
                continue
            self.peak[name] = max(self.peak.get(name, 0), rss)
            self.cpu[name] = times.user + times.system


@contextlib.contextmanager
def _progress(total: float) -> Iterator[Show]:
    """A live line on stderr (stdout is for the summary, or the JSON with ``--json -``)."""
    progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), console=console(stderr=True))
    with progress:
        task = progress.add_task("starting", total=total)

        def show(description: str, completed: float | None = None) -> None:
            progress.update(task, description=description, completed=completed)

        yield show


async def _run(args: argparse.Namespace, workdir: Path, show: Show) -> dict:
    # Every simulated device comes from 127.0.0.1: lift the per-source limits a deployment keeps.
    flags = ["--register-limit", "1000000/1000000", "--checkin-limit", "1000000/1000000"]
    if args.checkin_rate:
        flags += ["--checkin-rate", str(args.checkin_rate)]
    cluster = ProcessCluster(workdir, aggregators=args.aggregators, checkin_hold_s=20.0, coordinator_flags=flags)
    sampler = Sampler()
    shards: list[asyncio.subprocess.Process] = []
    try:
        show(f"starting the coordinator and {args.aggregators} aggregator(s)")
        await cluster.start()
        # The services' start-up (imports, TLS, SQLite) is not load: count CPU from here.
        sampler.sample({name: p.pid for name, p in cluster.processes.items() if p.pid})
        started_cpu = dict(sampler.cpu)
        job_id = None
        if not args.idle:
            # Each aggregator's cohort must keep min_cohort of its devices: at most 10, and at most
            # half of a cohort, so that a small run's dropouts do not fail most attempts.
            min_cohort = min(10, max(2, args.cohort // (2 * args.aggregators)))
            job_id = await cluster.submit(SPEC.format(
                rounds=args.rounds, cohort=args.cohort, hidden=args.hidden, min_cohort=min_cohort,
                dropout=max(args.dropout, 0.05), plain=", plain: true" if args.plain else "",
                semi=", malicious_server: false, consistency_check: false" if args.semi_honest else ""))
        for i in range(args.shards):
            argv = [sys.executable, "-m", "tally.cli", "fleet", "--coordinator", cluster.target,
                    "--tls-dir", str(cluster.certs / "device"), "--devices", str(args.devices),
                    "--shard", f"{i}/{args.shards}", "--synthetic", "--no-progress", "--dropout", str(args.dropout),
                    "--enrolment-key", str(cluster.certs / "coordinator" / "enrolment.key"),
                    "--json", str(workdir / f"shard-{i}.json"), "--connect-timeout", "120",
                    "--processes", "1",  # a shard is the process this bench measures
                    "--ramp", str(args.ramp)]
            if args.plain:
                argv.append("--allow-plain")
            if args.semi_honest:
                argv.append("--semi-honest-server")
            argv += ["--stay"] if args.idle else ["--audit-out", str(workdir / f"audit-{i}.json"),
                                                 "--until-job-done", job_id, "--report", str(workdir / f"report-{i}")]
            shards.append(await asyncio.create_subprocess_exec(
                *argv, stdout=asyncio.subprocess.DEVNULL, stderr=(workdir / f"shard-{i}.log").open("wb")))
        start = time.monotonic()
        show(f"{args.devices} devices in {args.shards} fleet process(es) joining")
        pids = {name: p.pid for name, p in cluster.processes.items() if p.pid}
        pids.update({f"fleet-{i}": s.pid for i, s in enumerate(shards)})
        # CPU at each round's commit: the first round also carries the fleet's enrolment (every
        # device registers once, a signature check and an insert each), the later ones are the
        # steady state a long job runs in.
        at_commit: dict[int, dict[str, float]] = {}

        async def mark_commits() -> None:
            sampler.sample(pids)
            if job_id is not None:
                with contextlib.suppress(grpc.aio.AioRpcError):
                    job = await cluster.job(job_id, timeout=2.0)
                    committed = job.committed_round
                    if committed and committed not in at_commit:
                        at_commit[committed] = dict(sampler.cpu)
                    phase = common_pb2.RoundPhase.Name(job.phase).removeprefix("ROUND_PHASE_").lower()
                    show(f"round {max(job.round, 1)} of {args.rounds}: {phase} · rounds committed", committed)
            elif args.idle:
                show(f"{args.devices} idle devices · seconds", round(time.monotonic() - start))

        while True:
            await mark_commits()
            if args.idle and time.monotonic() - start > args.idle:
                for s in shards:
                    s.terminate()
                break
            if not args.idle and all(s.returncode is not None for s in shards):
                break
            await asyncio.sleep(0.5)
        await asyncio.gather(*(s.wait() for s in shards))
        await mark_commits()  # a last commit the shards outran by less than a poll
        elapsed = time.monotonic() - start
        for i, s in enumerate(shards):
            if not args.idle and s.returncode != 0:
                raise SystemExit(f"fleet shard {i} exited {s.returncode}:\n"
                                 + (workdir / f"shard-{i}.log").read_text()[-3000:])
        checks, expositions = [], {}
        if not args.idle:  # the shards' fingerprints merged, every committed sum checked at once
            show("checking every committed sum against the devices' inputs")
            audit = SumAudit()
            for i in range(args.shards):
                audit = audit.merge(SumAudit.from_json(json.loads((workdir / f"audit-{i}.json").read_text())))
            stub, md = cluster.admin()
            checks = await check_committed(stub, md, audit)
            expositions = {name: cluster.scrape(name) for name in cluster.metrics_ports}
    finally:
        for s in shards:
            if s.returncode is None:
                s.kill()
        await cluster.stop()
    result = {"devices": args.devices, "shards": args.shards, "aggregators": args.aggregators,
              "seconds": elapsed, "cpu_seconds": {k: v - started_cpu.get(k, 0.0) for k, v in sampler.cpu.items()},
              "peak_rss_bytes": sampler.peak}
    if args.idle:
        fleet_rss = sum(v for k, v in sampler.peak.items() if k.startswith("fleet-"))
        result["idle_seconds"] = args.idle
        result["fleet_rss_bytes_per_device"] = fleet_rss / args.devices
        return result
    shard_stats = [json.loads((workdir / f"shard-{i}.json").read_text()) for i in range(args.shards)]
    db = sqlite3.connect(f"file:{cluster.state / 'coordinator.db'}?mode=ro", uri=True)
    round_metrics = [json.loads(m) for (m,) in db.execute(
        "SELECT metrics FROM rounds WHERE job_id = ? AND state = 'committed' ORDER BY round", (job_id,))]
    # How many devices had registered when each round committed: the population it ran with.
    registered_at_commit = [n for (n,) in db.execute(
        "SELECT (SELECT COUNT(*) FROM devices WHERE enrolled_at <= r.finished_at) FROM rounds r "
        "WHERE r.job_id = ? AND r.state = 'committed' ORDER BY r.round", (job_id,))]
    db.close()
    durations = [m["duration_seconds"] for m in round_metrics]
    rounds = len(durations)
    result.update({
        "registered_at_commit": registered_at_commit, "ramp_seconds": args.ramp,
        "values": 75 * args.hidden + 10, "cohort": args.cohort, "plain": args.plain,
        "consistency_check": not (args.plain or args.semi_honest), "rounds_committed": rounds,
        "round_seconds": durations, "round_metrics": round_metrics,
        "round_seconds_median": statistics.median(durations) if durations else None,
        "rounds_per_hour": 3600 / statistics.median(durations) if durations else None,
        "cpu_seconds_per_round": {k: (v - started_cpu.get(k, 0.0)) / max(rounds, 1) for k, v in sampler.cpu.items()},
        "cpu_seconds_until_first_commit": {k: v - started_cpu.get(k, 0.0) for k, v in at_commit[min(at_commit)].items()}
        if at_commit else {},
        "cpu_seconds_per_round_after_the_first": _steady(at_commit),
        "audit": outcome_counts(checks),
        "aggregator_engine_cpu_seconds_per_round": {
            name: {phase: s / max(rounds, 1)
                   for phase, s in _samples(text, "tally_aggregator_engine_cpu_seconds_total").items()}
            for name, text in expositions.items() if name.startswith("aggregator")},
        "aggregator_cpu_itemised_per_round": {
            name: _itemised(text, (sampler.cpu[name] - started_cpu.get(name, 0.0)) / max(rounds, 1), rounds)
            for name, text in expositions.items() if name.startswith("aggregator")},
        "coordinator_phase_seconds_per_round": {
            phase: s / max(rounds, 1) for phase, s in
            _samples(expositions.get("coordinator", ""), "tally_coordinator_phase_duration_seconds_sum").items()},
        "fleet": {k: sum(s[k] for s in shard_stats) for k in ("checkins", "tasks_done", "dropouts", "bytes_up")},
        # Each shard's share: the coordinator seats devices in arrival order, so shards of one
        # fleet need not get equal work (and one machine of a spread fleet may be the bottleneck).
        "fleet_shards": [{k: s[k] for k in ("checkins", "tasks_done", "dropouts", "bytes_up")} for s in shard_stats],
    })
    # Latency of every coordinator call and phase as the devices saw them, all shards together.
    timeline = functools.reduce(FleetTimeline.merge, (
        FleetTimeline.from_json(json.loads((workdir / f"report-{i}" / "timeline.json").read_text()))
        for i in range(args.shards)))
    summary = timeline.summary()
    result["device_latency_seconds"] = {"rpc": summary["rpc_seconds"], "phase": summary["phase_seconds"]}
    result["checkins_per_second"] = summary["checkins_per_second"]
    return result


def _mb(n: float) -> str:
    return f"{n / 1e6:,.0f} MB"


def _by_process(values: dict[str, float], unit: Callable[[float], str]) -> str:
    return ", ".join(f"{name} {unit(v)}" for name, v in sorted(values.items()))


def good(result: dict[str, Any], rounds: int) -> bool:
    """Every round committed and every committed sum exact (an idle run has nothing to get wrong)."""
    if "idle_seconds" in result:
        return True
    audit = result["audit"]
    return result["rounds_committed"] == rounds and audit["mismatch"] == audit["foreign"] == 0 and audit["exact"] > 0


def summary(result: dict[str, Any], rounds: int) -> str:
    """What a person reads at the end of a run: the verdict, then the numbers that say why."""
    seconds = lambda v: f"{v:.2f} s"  # noqa: E731
    lines = [f"{result['devices']:,} devices in {result['shards']} fleet process(es), "
             f"{result['aggregators']} aggregator(s); the fleet ran {result['seconds']:.1f} s"]
    if "idle_seconds" in result:
        lines += [f"  idle for        {result['idle_seconds']:g} s",
                  f"  fleet memory    {result['fleet_rss_bytes_per_device'] / 1e3:,.1f} kB per idle device",
                  f"  peak memory     {_by_process(result['peak_rss_bytes'], _mb)}"]
        return "\n".join(lines)
    audit, fleet = result["audit"], result["fleet"]
    mode = "plain" if result["plain"] else "secure" if result["consistency_check"] else "secure, no consistency check"
    median = result["round_seconds_median"]
    lines += [
        f"  rounds          {result['rounds_committed']} of {rounds} committed ({mode}, cohort {result['cohort']}, "
        f"{result['values']:,} values)" + (f", median {median:.1f} s, {result['rounds_per_hour']:,.0f} per hour"
                                           if median else ""),
        f"  sums audited    {audit['exact']} exact, {audit['mismatch']} wrong, {audit['foreign']} foreign",
        f"  fleet           {fleet['checkins']:,} check-ins, {fleet['tasks_done']:,} tasks done, "
        f"{fleet['dropouts']:,} dropouts, {_mb(fleet['bytes_up'])} uploaded",
        f"  CPU per round   {_by_process(result['cpu_seconds_per_round'], seconds)}",
        f"  peak memory     {_by_process(result['peak_rss_bytes'], _mb)}",
    ]
    latency = result["device_latency_seconds"]
    for kind, title in (("rpc", "device calls"), ("phase", "device phases")):
        if latency[kind]:
            lines.append(f"  {title:<15} " + ", ".join(f"{name} {p['p50']:.2f}/{p['p99']:.2f} s"
                                                         for name, p in latency[kind].items()) + " (p50/p99)")
    lines.append("good: every round committed and every committed sum exact" if good(result, rounds) else
                 "NOT GOOD: a round did not commit, or a committed sum was not the sum of its devices' inputs "
                 "(--keep DIR keeps the logs and the coordinator's database)")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog="A first load test, under a minute: bench/fleet.py --devices 300 --cohort 60 --rounds 2 "
               "(docs/load-testing.md says what a good result looks like).")
    parser.add_argument("--devices", type=int, default=1000, help="simulated devices in all")
    parser.add_argument("--shards", type=int, default=1, help="fleet processes")
    parser.add_argument("--aggregators", type=int, default=2, help="aggregator processes")
    parser.add_argument("--cohort", type=int, default=100, help="the job's cohort_size (devices per round)")
    parser.add_argument("--hidden", type=int, default=133, help="mlp hidden units: 75 * hidden + 10 values")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the job")
    parser.add_argument("--dropout", type=float, default=0.1,
                        help="fraction of devices that leave each session (and the job's planned dropout rate)")
    parser.add_argument("--plain", action="store_true", help="plain sums (benchmark-only) instead of secure ones")
    parser.add_argument("--semi-honest", action="store_true",
                        help="secure sums without the consistency check (devices trust the aggregators): "
                        "what the check costs")
    parser.add_argument("--idle", type=float, default=0.0, metavar="SECONDS",
                        help="no job: run the fleet this long and report its memory per idle device")
    parser.add_argument("--checkin-rate", type=float, default=0.0,
                        help="the coordinator's pace steering target (check-ins per second; 0: off)")
    parser.add_argument("--ramp", type=float, default=0.0, metavar="SECONDS",
                        help="the fleet's devices come online over this many seconds (tally fleet --ramp)")
    parser.add_argument("--json", type=Path, metavar="FILE",
                        help="write every measurement as JSON to FILE ('-': print it instead of the summary)")
    parser.add_argument("--keep", type=Path, metavar="DIR",
                        help="run in DIR and keep what the run leaves (the coordinator's SQLite, every "
                             "process's log, the fleet's reports and timelines) to look into a round")
    args = parser.parse_args()
    try:
        with _progress(args.idle or args.rounds) as show, contextlib.ExitStack() as stack:
            workdir = args.keep or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="tally-bench-fleet-")))
            workdir.mkdir(parents=True, exist_ok=True)
            result = asyncio.run(cancelled_by_signals(_run(args, workdir, show), (signal.SIGTERM,)))
            show("done")
    except Signalled:
        raise SystemExit("bench/fleet.py: terminated; its processes are stopped") from None
    text = json.dumps(result, indent=2)
    if args.json == Path("-"):
        print(text)
        console(stderr=True).print(summary(result, args.rounds), highlight=False)
    else:
        print(summary(result, args.rounds))
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(text)
    if not good(result, args.rounds):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
