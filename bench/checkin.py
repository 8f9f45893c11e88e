"""Check-in capacity of one coordinator core, and pace steering holding a population
to a target rate.

``capacity``: a coordinator process over TLS pinned to one core; load generators in their own
processes (on the other cores) register a pool of devices, then fire ``CheckIn`` calls open-loop
at a fixed rate for a few seconds per step (a call is started on schedule whether or not earlier
ones have answered, as independent devices do), recording each call's latency. The rate steps up
until p99 passes the limit or the coordinator falls behind; the capacity is the highest rate
whose p99 stayed under it. Every device comes from 127.0.0.1, so the per-source rate limits are
lifted (a deployment's devices come from many sources).

``pacing``: a synthetic fleet of idle devices (no job) against a coordinator with
``--checkin-rate``; the check-in rate is read from the coordinator's own
``tally_coordinator_checkins_total`` every few seconds.

    .venv/bin/python bench/checkin.py capacity --repeats 3 --json bench/results/checkin_capacity.json
    .venv/bin/python bench/checkin.py pacing --devices 10000 --rate 100 --seconds 240 --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil
from cores import pin  # this folder is on sys.path when run as a script

from tally.client.enrolment import register_request, simulated_identity
from tally.ops.cluster import ProcessCluster
from tally.security import TLSConfig, bearer_metadata
from tally.security.enrolment import enrolment_credential
from tally.security.tls import open_aio_channel
from tally.wire.v1 import coordinator_pb2, coordinator_pb2_grpc

UNLIMITED = ["--register-limit", "1000000/1000000", "--checkin-limit", "1000000/1000000"]


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _generate(target: str, tls_dir: str, key: bytes, first: int, count: int, steps: list[float],
                    seconds: float, start_at: float) -> list[dict]:
    """One generator process: register ``count`` devices, then for each step rate fire check-ins
    open-loop for ``seconds``; per step the latencies (ms) and the calls that failed."""
    tls = TLSConfig.from_dir(Path(tls_dir), None)
    channel = open_aio_channel(target, tls)
    stub = coordinator_pb2_grpc.CoordinatorStub(channel)
    metadata = []
    for i in range(first, first + count):
        device_id = f"load-{i}"
        request = register_request(simulated_identity(key, device_id), device_id, "load",
                                   enrolment_credential(key, "load", device_id), time.time())
        reply = await stub.Register(request, timeout=30)
        metadata.append(bearer_metadata(reply.token))
    await asyncio.sleep(max(0.0, start_at - time.time()))  # every generator starts the steps together
    results = []
    for rate in steps:
        latencies: list[float] = []
        failures = 0

        async def one(md, latencies: list[float]) -> None:
            nonlocal failures
            began = time.perf_counter()
            try:
                await stub.CheckIn(coordinator_pb2.CheckInRequest(), metadata=md, timeout=10)
            except Exception:  # noqa: BLE001 - a failed call is counted, whatever its status
                failures += 1
                return
            latencies.append((time.perf_counter() - began) * 1000)

        calls, began = [], time.perf_counter()
        n = int(rate * seconds)
        for k in range(n):
            delay = began + k / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            calls.append(asyncio.ensure_future(one(metadata[k % len(metadata)], latencies)))
        await asyncio.gather(*calls)
        results.append({"latencies_ms": latencies, "failures": failures, "sent": n,
                        "seconds": time.perf_counter() - began})
    await channel.close()
    return results


def _generator_main(args: tuple) -> list[dict]:
    cores = args[-1]
    if cores:
        psutil.Process().cpu_affinity(cores)
    return asyncio.run(_generate(*args[:-1]))


async def _capacity_run(args: argparse.Namespace, workdir: Path) -> dict:
    cluster = ProcessCluster(workdir, aggregators=1, coordinator_flags=UNLIMITED)
    await cluster.start()
    try:
        cpus = list(range(psutil.cpu_count() or 1))
        coordinator = psutil.Process(cluster.processes["coordinator"].pid)
        if len(cpus) > 1:
            pin(coordinator.pid, [cpus[0]])
        generator_cores = cpus[1:] or cpus
        steps = [float(r) for r in args.rates]
        per_gen = args.pool // args.generators
        start_at = time.time() + 5 + per_gen / 200  # registration first
        jobs = [(cluster.target, str(cluster.certs / "device"), cluster.enrolment_key, g * per_gen, per_gen,
                 [r / args.generators for r in steps], args.step_seconds, start_at, generator_cores)
                for g in range(args.generators)]
        cpu_before = coordinator.cpu_times()
        ctx = multiprocessing.get_context("spawn")
        with ctx.Pool(args.generators) as pool:
            outcome = await asyncio.to_thread(pool.map, _generator_main, jobs)
        cpu_after = coordinator.cpu_times()
    finally:
        await cluster.stop()
    rows = []
    for s, rate in enumerate(steps):
        latencies = [x for gen in outcome for x in gen[s]["latencies_ms"]]
        sent = sum(gen[s]["sent"] for gen in outcome)
        seconds = max(gen[s]["seconds"] for gen in outcome)
        rows.append({
            "target_per_s": rate, "sent": sent, "answered": len(latencies),
            "failures": sum(gen[s]["failures"] for gen in outcome), "achieved_per_s": len(latencies) / seconds,
            "p50_ms": _percentile(latencies, 0.50) if latencies else None,
            "p95_ms": _percentile(latencies, 0.95) if latencies else None,
            "p99_ms": _percentile(latencies, 0.99) if latencies else None,
        })
    ok = [r for r in rows if r["p99_ms"] is not None and r["p99_ms"] < args.p99_ms and r["failures"] == 0
          and r["achieved_per_s"] >= 0.95 * r["target_per_s"]]
    return {"steps": rows, "capacity_per_s": max((r["target_per_s"] for r in ok), default=0.0),
            "coordinator_cpu_seconds": (cpu_after.user + cpu_after.system) - (cpu_before.user + cpu_before.system)}


def capacity(args: argparse.Namespace) -> dict:
    runs = []
    for _ in range(args.repeats):
        with tempfile.TemporaryDirectory(prefix="tally-bench-checkin-") as tmp:
            runs.append(asyncio.run(_capacity_run(args, Path(tmp))))
    capacities = [r["capacity_per_s"] for r in runs]
    return {"bench": "checkin_capacity", "p99_limit_ms": args.p99_ms, "generators": args.generators,
            "pool": args.pool, "cpus": psutil.cpu_count(), "coordinator_cores": 1,
            "capacity_per_s": capacities, "capacity_per_s_median": statistics.median(capacities), "runs": runs}


def _checkins(exposition: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in exposition.splitlines()
               if line.startswith("tally_coordinator_checkins_total{"))


async def _pacing_run(args: argparse.Namespace, workdir: Path) -> dict:
    flags = UNLIMITED + (["--checkin-rate", str(args.rate)] if args.rate else [])
    cluster = ProcessCluster(workdir, aggregators=1, coordinator_flags=flags)
    await cluster.start()
    fleet = None
    try:
        fleet = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "tally.cli", "fleet", "--coordinator", cluster.target,
            "--tls-dir", str(cluster.certs / "device"), "--devices", str(args.devices), "--synthetic",
            "--no-progress", "--stay", "--population", "idle", "--processes", "1",
            "--enrolment-key", str(cluster.certs / "coordinator" / "enrolment.key"),
            stdout=asyncio.subprocess.DEVNULL, stderr=(workdir / "fleet.log").open("wb"))
        samples, start = [], time.monotonic()
        while time.monotonic() - start < args.seconds:
            await asyncio.sleep(args.every)
            samples.append((time.monotonic() - start, _checkins(cluster.scrape("coordinator"))))
    finally:
        if fleet is not None and fleet.returncode is None:
            fleet.terminate()
            await fleet.wait()
        await cluster.stop()
    rates = [{"t": round(b[0], 1), "per_s": (b[1] - a[1]) / (b[0] - a[0])} for a, b in zip(samples, samples[1:])]
    settled = [r["per_s"] for r in rates if r["t"] >= args.seconds / 2]
    return {"bench": "checkin_pacing", "devices": args.devices, "target_per_s": args.rate,
            "rates": rates, "settled_median_per_s": statistics.median(settled) if settled else None}


def pacing(args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory(prefix="tally-bench-pacing-") as tmp:
        return asyncio.run(_pacing_run(args, Path(tmp)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("capacity", help="highest check-in rate one coordinator core serves with p99 under a limit")
    c.add_argument("--rates", type=float, nargs="+",
                   default=[500, 1000, 1500, 2000, 2500, 3000, 3500, 4000, 4500, 5000])
    c.add_argument("--step-seconds", type=float, default=5.0)
    c.add_argument("--generators", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    c.add_argument("--pool", type=int, default=1000, help="registered devices the check-ins rotate over")
    c.add_argument("--p99-ms", type=float, default=200.0)
    c.add_argument("--repeats", type=int, default=3)
    p = sub.add_parser("pacing", help="an idle population held to --rate check-ins per second")
    p.add_argument("--devices", type=int, default=10000)
    p.add_argument("--rate", type=float, default=100.0, help="target rate; 0: no pacing, for comparison")
    p.add_argument("--seconds", type=float, default=240.0)
    p.add_argument("--every", type=float, default=10.0, help="seconds between scrapes")
    for s in (c, p):
        s.add_argument("--json", type=Path)
    args = parser.parse_args()
    result = capacity(args) if args.command == "capacity" else pacing(args)
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=2))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
