"""What a registered population costs the coordinator, against the population's size.

For each population N (``--populations``, default 10,000 100,000 1,000,000):

1. **At rest.** N devices are enrolled in a coordinator's store, each row as a registration leaves
   it (``EnrolledDevices.enrol``: id, population, a distinct identity key, timestamps). The
   coordinator process is then started on that store over TLS: the seconds from spawn to serving
   (restart to ready), and its resident memory against the same coordinator started on an empty
   store, per registered device.
2. **Registrations.** ``--register`` more devices register as real devices do: each on its own TLS
   channel, with its own identity key, enrolment credential and signed statement, from load
   generators (``--generators``, one process each) pinned to cores of their own while the
   coordinator is pinned to another. Coordinator CPU
   seconds per registration (psutil) and registrations per second.
3. **Idle check-ins.** No job runs, so every check-in is answered with a come-back time. The
   registered devices check in with their own tokens over their own channels (kept open, as a
   device between check-ins keeps its channel), each stating an input ledger of its own as an SDK
   device with a state directory does at every check-in (``--stateless``: devices without state,
   whose check-ins state none), open-loop at each rate of ``--rates`` for
   ``--step-seconds``: latency p50/p99, failures, coordinator CPU per check-in; the capacity is the
   highest rate whose p99 stayed under ``--p99-ms`` with no failures. The steps stop after the first
   one that did not (past it, a step only waits out its calls' deadlines). Memory is read again after.
4. **Processes.** Steps 2 and 3 again for each count of ``--processes`` (``tally coordinator
   --device-processes``): the coordinator and its fronts pinned to that many cores, their CPU
   summed, and the share of the idle check-ins the coordinator process answered itself (the
   kernel spreads connections evenly, so about 1/N when the fronts answer their own). On a
   machine with no core left for the generator it shares the last one, and the JSON says so:
   the ratio then understates what the processes give.

Before the populations, the **floor**: the same generator against a gRPC server that answers every
check-in with a constant come-back time and checks nothing, over the same TLS, pinned the same way.
It is the most one Python gRPC process can serve on this machine, whatever the coordinator does,
and each coordinator step is reported against it.

With ``--database URL`` (a PostgreSQL server and a role that may create databases) the store is
PostgreSQL instead of SQLite, as for coordinator replicas: each population gets a database of its
own (created, then dropped), and the coordinator runs as the leading replica over it.

JSON to ``--json``; with ``--plot``, one panel per figure against N (log scale).

    .venv/bin/python bench/population.py --json bench/results/population.json --plot bench/results/population.png
    .venv/bin/python bench/population.py --populations 2000 --register 200 --rates 200 --step-seconds 2 \\
        --processes 1 2 --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import queue
import shutil
import sys
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import grpc
import psutil
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console
from rich.progress import Progress

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cores import pin
from secagg_engine import machine_info

from tally.client.enrolment import register_request, simulated_identity
from tally.coordinator.state.store import Store
from tally.ops.cluster import ProcessCluster
from tally.security import TLSConfig, bearer_metadata, bind
from tally.security.certs import write_deployment
from tally.security.enrolment import enrolment_credential
from tally.security.tls import open_aio_channel, server_options
from tally.wire.v1 import coordinator_pb2, coordinator_pb2_grpc

# The generator's devices all come from this host: no per-source cap (a deployment's come from many).
UNLIMITED = ["--register-limit", "1000000/1000000", "--checkin-limit", "1000000/1000000",
             "--max-connections-per-source", "0"]
AT_REST, LIVE = "rest", "live"  # the two populations: enrolled in the store, and the generator's devices
REGISTER_CONCURRENCY = 64  # registrations in flight at once: a burst of devices, not one queue


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def enrol_at_rest(state: Path, count: int, progress: Progress | None = None, database: str | None = None) -> float:
    """Enrol ``count`` devices in the store under ``state`` (or in ``database``); seconds it took.
    Their identity keys are distinct random bytes: these devices never call, they only have to be
    there."""
    store = Store(state, database)
    began, now = time.perf_counter(), time.time()
    task = progress.add_task(f"enrolling {count:,} devices", total=count) if progress else None
    try:
        for i in range(count):
            store.devices.enrol(f"{AT_REST}-{i}", AT_REST, os.urandom(32), now, now)
            if task is not None and i % 10_000 == 9_999:
                progress.update(task, completed=i + 1)
    finally:
        store.close()
        if task is not None:
            progress.remove_task(task)
    return time.perf_counter() - began


class CpuSampler:
    """The CPU seconds of a process and its descendants (a coordinator's device fronts, a
    PostgreSQL server's backends) every ``every`` seconds, so that phases a generator timed in
    wall-clock time can be charged their CPU afterwards. A child that exited counts once its
    parent has reaped it (as the parent's children's time), as a server's finished backends do."""

    def __init__(self, pid: int, every: float = 0.1) -> None:
        self._process, self._every = psutil.Process(pid), every
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _cpu(self) -> float:
        total = 0.0
        for process in (self._process, *self._process.children(recursive=True)):
            try:
                times = process.cpu_times()
            except psutil.NoSuchProcess:
                continue
            total += times.user + times.system + times.children_user + times.children_system
        return total

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.time(), self._cpu()))
            self._stop.wait(self._every)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def at(self, moment: float) -> float:
        """CPU seconds at ``moment``, interpolated between the samples around it."""
        before = [s for s in self.samples if s[0] <= moment] or self.samples[:1]
        after = [s for s in self.samples if s[0] >= moment] or self.samples[-1:]
        (t0, c0), (t1, c1) = before[-1], after[0]
        return c0 if t1 == t0 else c0 + (c1 - c0) * (moment - t0) / (t1 - t0)

    def between(self, start: float, end: float) -> float:
        return self.at(end) - self.at(start)


class Lockstep:
    """Generators split over several cores begin each phase at once, so that their rates add up,
    and stop together after the first rate step that any of them saw overloaded (p99 over the
    limit, a failure, or falling behind): past it, each step only waits out its calls' deadlines."""

    def __init__(self, barrier, overloaded, p99_ms: float) -> None:
        self._barrier, self._overloaded, self.p99_ms = barrier, overloaded, p99_ms

    def together(self) -> None:
        self._barrier.wait()

    def stop_after(self, step: dict) -> bool:
        latencies = step["latencies_ms"]
        if step["failures"] or step["sent"] and (
                not latencies or _percentile(latencies, 0.99) >= self.p99_ms or len(latencies) < 0.95 * step["sent"]):
            self._overloaded.value = 1
        self._barrier.wait()
        return bool(self._overloaded.value)


async def _live_devices(target: str, tls_dir: str, key: bytes, prefix: str, count: int, calls: list[int],
                        seconds: float, stateful: bool, lockstep: Lockstep) -> dict:
    """One load generator: ``count`` devices register, each on its own channel, then check in
    open-loop, each step sending its number of ``calls`` spread evenly over ``seconds``, in lockstep
    with the other generators; ``stateful`` devices state an input ledger of their own at each.
    Wall-clock bounds of each phase, for the CPU sampler."""
    tls = TLSConfig.from_dir(Path(tls_dir), None)
    channels, devices = [], []
    failures = 0
    gate = asyncio.Semaphore(REGISTER_CONCURRENCY)

    async def register(i: int) -> None:
        nonlocal failures
        device_id = f"{prefix}-{i}"
        async with gate:
            channel = open_aio_channel(target, tls)
            channels.append(channel)
            stub = coordinator_pb2_grpc.CoordinatorStub(channel)
            request = register_request(simulated_identity(key, device_id), device_id, LIVE,
                                       enrolment_credential(key, LIVE, device_id), time.time())
            try:
                reply = await stub.Register(request, timeout=60)
            except Exception:  # noqa: BLE001 - a failed registration is counted, whatever its status
                failures += 1
                return
            ledger = coordinator_pb2.InputLedger(ledger_id=os.urandom(16).hex()) if stateful else None
            devices.append((stub, bearer_metadata(reply.token), coordinator_pb2.CheckInRequest(input_ledger=ledger)))

    await asyncio.to_thread(lockstep.together)
    began = time.time()
    await asyncio.gather(*(register(i) for i in range(count)))
    registered = {"start": began, "end": time.time(), "count": len(devices), "failures": failures}
    steps = []
    for n in calls:
        latencies: list[float] = []
        failed = 0

        async def check_in(stub, metadata, request, latencies: list[float]) -> None:
            nonlocal failed
            start = time.perf_counter()
            try:
                reply = await stub.CheckIn(request, metadata=metadata, timeout=10)
            except Exception:  # noqa: BLE001 - counted, whatever its status
                failed += 1
                return
            if not reply.HasField("retry_after"):
                failed += 1  # no job runs: anything but a come-back time is wrong
                return
            latencies.append((time.perf_counter() - start) * 1000)

        await asyncio.to_thread(lockstep.together)
        sent, step_began, wall_began = [], time.perf_counter(), time.time()
        for k in range(n):
            delay = step_began + k * seconds / n - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            sent.append(asyncio.ensure_future(check_in(*devices[k % len(devices)], latencies)))
        await asyncio.gather(*sent)
        steps.append({"sent": n, "latencies_ms": latencies, "failures": failed,
                      "start": wall_began, "end": time.time()})
        if await asyncio.to_thread(lockstep.stop_after, steps[-1]):
            break
    await asyncio.gather(*(c.close() for c in channels))
    return {"registered": registered, "steps": steps}


def _generator_main(g: int, job: tuple, core: int, lockstep: tuple, results: multiprocessing.Queue) -> None:
    psutil.Process().cpu_affinity([core])
    results.put((g, asyncio.run(_live_devices(*job, lockstep=Lockstep(*lockstep)))))


def _outcomes(workers: list, results: multiprocessing.Queue, barrier, timeout_s: float = 900.0) -> list[dict]:
    """Each generator's outcome, in generator order. One that dies before reporting breaks the
    barrier, so that the others stop at once instead of waiting out its timeout, and the benchmark
    fails naming it."""
    outcomes: dict[int, dict] = {}
    deadline = time.monotonic() + timeout_s
    while len(outcomes) < len(workers):
        try:
            g, outcome = results.get(timeout=0.2)
            outcomes[g] = outcome
            continue
        except queue.Empty:
            pass
        dead = [f"generator {g} exited with status {w.exitcode}" for g, w in enumerate(workers)
                if g not in outcomes and w.exitcode not in (None, 0)]
        if dead or time.monotonic() > deadline:
            barrier.abort()
            raise RuntimeError("; ".join(dead) or f"the generators did not report within {timeout_s:g} s")
    return [outcomes[g] for g in range(len(workers))]


def _generate(target: str, tls_dir: Path, key: bytes, prefix: str, count: int, rates: list[float],
              seconds: float, stateful: bool, cores: list[int], p99_ms: float) -> dict:
    """The load: one generator process per core of ``cores``, each with its share of the devices
    and of every rate, merged into one record as if one generator had sent it all."""
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(len(cores), timeout=600)
    lockstep = (barrier, context.Value("b", 0), p99_ms)
    results = context.Queue()

    def shares(total: int) -> list[int]:
        return [total // len(cores) + (g < total % len(cores)) for g in range(len(cores))]

    calls = list(zip(*(shares(int(rate * seconds)) for rate in rates)))  # per generator, per step
    workers = [context.Process(target=_generator_main, daemon=True, args=(g,
        (target, str(tls_dir), key, f"{prefix}-g{g}", devices, list(calls[g]), seconds, stateful), core, lockstep,
        results))
        for g, (devices, core) in enumerate(zip(shares(count), cores))]
    for worker in workers:
        worker.start()
    try:
        outcomes = _outcomes(workers, results, barrier)
    finally:
        for worker in workers:
            worker.join(10)
            if worker.is_alive():
                worker.kill()
    regs = [o["registered"] for o in outcomes]
    steps = [{"target_per_s": rate, "sent": sum(s["sent"] for s in same),
              "latencies_ms": [ms for s in same for ms in s["latencies_ms"]],
              "failures": sum(s["failures"] for s in same),
              "start": min(s["start"] for s in same), "end": max(s["end"] for s in same)}
             for rate, same in zip(rates, zip(*(o["steps"] for o in outcomes)))]
    return {"registered": {"start": min(r["start"] for r in regs), "end": max(r["end"] for r in regs),
                           "count": sum(r["count"] for r in regs), "failures": sum(r["failures"] for r in regs)},
            "steps": steps}


def _rss(pid: int) -> int:
    return psutil.Process(pid).memory_info().rss


async def _start(cluster: ProcessCluster) -> float:
    """Start the cluster (its aggregator too: a deployment has one); the coordinator's seconds
    from spawn to serving (with its fronts, if any)."""
    await cluster.restart("aggregator-1")
    began = time.perf_counter()
    await cluster.restart("coordinator")
    return time.perf_counter() - began


def _cores(processes: int, generators: int) -> tuple[list[int], list[int]]:
    """The cores the server's processes are pinned to, and the generators' (one each): their own
    where the machine has them left, else the last ones, shared."""
    cpus = sorted(os.sched_getaffinity(0))
    server = cpus[:min(processes, max(1, len(cpus) - 1))]
    free = [c for c in cpus if c not in server] or cpus[-1:]
    return server, [free[g % len(free)] for g in range(generators)]


def database_server_pid(url: str | None) -> int | None:
    """The PostgreSQL server (its postmaster) behind ``url`` when it runs on this machine: the
    process listening on the URL's port; None for SQLite or a server elsewhere."""
    if not url:
        return None
    parsed = urllib.parse.urlsplit(url)
    if parsed.hostname not in ("127.0.0.1", "localhost", "::1"):
        return None
    port = parsed.port or 5432
    return next((c.pid for c in psutil.net_connections("tcp")
                 if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid), None)


async def _drive(target: str, tls_dir: Path, key: bytes, prefix: str, pid: int, processes: int,
                 args: argparse.Namespace, database_pid: int | None = None) -> dict:
    """Pin the server ``pid`` (and its children) and the generator, run the generator, and charge
    each phase its server CPU (and, with ``database_pid``, the database server's, reported apart:
    it is not pinned, and a deployment's database runs on a machine of its own)."""
    server_cores, generator_cores = _cores(processes, args.generators)
    if not pin(pid, server_cores):  # checked, not asserted: python -O must not skip it
        raise RuntimeError(f"a server thread escaped its cores {server_cores}")
    sampler = CpuSampler(pid)
    database = CpuSampler(database_pid) if database_pid else None
    try:
        outcome = await asyncio.to_thread(_generate, target, tls_dir, key, prefix, args.register,
                                          [float(r) for r in args.rates], args.step_seconds, not args.stateless,
                                          generator_cores, args.p99_ms)
    finally:
        sampler.stop()
        if database:
            database.stop()

    def database_ms(start: float, end: float, count: int) -> float | None:
        return 1000 * database.between(start, end) / max(count, 1) if database else None

    reg = outcome["registered"]
    steps = []
    for step in outcome["steps"]:
        latencies, seconds = step["latencies_ms"], step["end"] - step["start"]
        cpu = sampler.between(step["start"], step["end"])
        steps.append({
            "target_per_s": step["target_per_s"], "sent": step["sent"], "answered": len(latencies),
            "failures": step["failures"], "achieved_per_s": len(latencies) / seconds,
            "p50_ms": _percentile(latencies, 0.50) if latencies else None,
            "p99_ms": _percentile(latencies, 0.99) if latencies else None,
            "server_cpu_s": cpu, "cpu_ms_per_checkin": 1000 * cpu / len(latencies) if latencies else None,
            "database_cpu_ms_per_checkin": database_ms(step["start"], step["end"], len(latencies)),
        })
    ok = [s for s in steps if s["p99_ms"] is not None and s["p99_ms"] < args.p99_ms and s["failures"] == 0
          and s["achieved_per_s"] >= 0.95 * s["target_per_s"]]
    return {
        "processes": processes, "server_cores": server_cores, "generator_cores": generator_cores,
        "generator_shares_a_core": bool(set(server_cores) & set(generator_cores)),
        "registrations": reg["count"], "registration_failures": reg["failures"],
        "registrations_per_s": reg["count"] / (reg["end"] - reg["start"]),
        "cpu_ms_per_registration": 1000 * sampler.between(reg["start"], reg["end"]) / max(reg["count"], 1),
        "database_cpu_ms_per_registration": database_ms(reg["start"], reg["end"], reg["count"]),
        "checkin_steps": steps, "checkin_capacity_per_s": max((s["target_per_s"] for s in ok), default=0.0),
        # From the busiest step that kept up (a lightly loaded step pays the idle loop).
        "cpu_ms_per_checkin": max(ok, key=lambda s: s["target_per_s"])["cpu_ms_per_checkin"] if ok else None,
    }


@contextlib.contextmanager
def _own_database(url: str | None) -> Iterator[str | None]:
    """A new database on ``url``'s server for one run, dropped after (None: SQLite)."""
    if url is None:
        yield None
        return
    import psycopg

    name = f"tally_bench_{os.getpid()}_{time.monotonic_ns()}"
    with psycopg.connect(url, autocommit=True) as admin:
        admin.execute(f"CREATE DATABASE {name}")
        try:
            yield urllib.parse.urlsplit(url)._replace(path=f"/{name}").geturl()
        finally:
            admin.execute(f"DROP DATABASE {name} WITH (FORCE)")


def _store_flags(database: str | None) -> list[str]:
    return ["--database", database, "--internal-listen", "127.0.0.1:0"] if database else []


async def _one_population(args: argparse.Namespace, population: int, workdir: Path, progress: Progress) -> dict:
    with _own_database(args.database) as empty_db:
        # The same coordinator on an empty store first: the base its memory per device is read against.
        empty = ProcessCluster(workdir / "empty", aggregators=1,
                               coordinator_flags=[*UNLIMITED, *_store_flags(empty_db)])
        try:
            await _start(empty)
            base_rss = _rss(empty.processes["coordinator"].pid)
        finally:
            await empty.stop()
    with _own_database(args.database) as database:
        return await _measure(args, population, workdir, progress, base_rss, database)


async def _measure(args: argparse.Namespace, population: int, workdir: Path, progress: Progress, base_rss: int,
                   database: str | None) -> dict:
    state = workdir / "state"
    fill_seconds = enrol_at_rest(state, population, progress, database)
    row: dict = {"population": population, "enrol_seconds": fill_seconds, "base_rss_bytes": base_rss,
                 "by_processes": []}
    for processes in args.processes:
        cluster = ProcessCluster(workdir / f"p{processes}", aggregators=1,
                               coordinator_flags=[*UNLIMITED, "--device-processes", str(processes),
                                                  *_store_flags(database)])
        shutil.rmtree(cluster.state, ignore_errors=True)
        state.rename(cluster.state)  # the one store, handed from run to run
        try:
            ready_seconds = await _start(cluster)
            pid = cluster.processes["coordinator"].pid
            rest_rss = _rss(pid)
            live = await _drive(cluster.target, cluster.certs / "device", cluster.enrolment_key,
                                f"{LIVE}-p{processes}", pid, processes, args, database_server_pid(database))
            live_rss = _rss(pid)
            answered = sum(step["answered"] for step in live["checkin_steps"])
            by_coordinator = _idle_checkins_answered(cluster.scrape("coordinator"))
            live |= {"checkins_answered_by_coordinator": by_coordinator,
                     "share_answered_by_coordinator": by_coordinator / max(answered, 1)}
        finally:
            await cluster.stop()
            cluster.state.rename(state)
        live["ready_seconds"] = ready_seconds
        if processes == 1:  # memory is the store's and the coordinator's: fronts hold no device
            row |= {"ready_seconds": ready_seconds, "rest_rss_bytes": rest_rss, "live_rss_bytes": live_rss,
                    "bytes_per_registered_device_at_rest": (rest_rss - base_rss) / max(population, 1),
                    "bytes_per_connected_device": (live_rss - rest_rss) / max(live["registrations"], 1)}
        row["by_processes"].append(live)
    return row


def _idle_checkins_answered(exposition: str) -> int:
    """The check-ins a process answered with a come-back time, from its metrics."""
    return int(sum(sample.value for family in text_string_to_metric_families(exposition)
                   for sample in family.samples
                   if sample.name == "tally_coordinator_checkins_total" and sample.labels.get("outcome") == "retry"))


class _Floor(coordinator_pb2_grpc.CoordinatorServicer):
    """Answers without checking anything: what serving a check-in costs gRPC and TLS alone."""

    _REPLY = coordinator_pb2.CheckInResponse(retry_after=coordinator_pb2.RetryAfter(
        seconds=5.0, reason="no running job for population 'live'", population_idle=True))

    async def Register(self, request, context):
        return coordinator_pb2.RegisterResponse(token="floor")

    async def CheckIn(self, request, context):
        return self._REPLY


def _floor_main(tls_dir: str, ports: multiprocessing.Queue, stop: multiprocessing.Event) -> None:
    async def serve() -> None:
        server = grpc.aio.server(options=server_options(share_port=False))
        coordinator_pb2_grpc.add_CoordinatorServicer_to_server(_Floor(), server)
        ports.put(bind(server, "127.0.0.1:0", TLSConfig.from_dir(Path(tls_dir), "coordinator")))
        await server.start()
        await asyncio.to_thread(stop.wait)
        await server.stop(0)

    asyncio.run(serve())


async def _floor(args: argparse.Namespace, workdir: Path) -> dict:
    certs = workdir / "certs"
    write_deployment(certs, aggregators=1)
    context = multiprocessing.get_context("spawn")
    ports, stop = context.Queue(), context.Event()
    process = context.Process(target=_floor_main, args=(str(certs / "coordinator"), ports, stop))
    process.start()
    try:
        port = await asyncio.to_thread(ports.get, True, 60)
        return await _drive(f"localhost:{port}", certs / "device", b"\0" * 32, "floor", process.pid, 1, args)
    finally:
        stop.set()
        await asyncio.to_thread(process.join, 10)
        if process.is_alive():
            process.kill()


def run(args: argparse.Namespace) -> dict:
    rows = []
    with Progress(console=Console(stderr=True), transient=True) as progress:
        overall = progress.add_task("floor, then populations", total=len(args.populations) + 1)
        with tempfile.TemporaryDirectory(prefix="tally-bench-floor-") as tmp:
            floor = asyncio.run(_floor(args, Path(tmp)))
        progress.advance(overall)
        for population in args.populations:
            with tempfile.TemporaryDirectory(prefix="tally-bench-population-") as tmp:
                rows.append(asyncio.run(_one_population(args, population, Path(tmp), progress)))
            progress.advance(overall)
    return {
        "bench": "population", "machine": machine_info(), "register": args.register, "rates": args.rates,
        "step_seconds": args.step_seconds, "p99_limit_ms": args.p99_ms, "processes": args.processes,
        "generators": args.generators,
        "store": "postgresql" if args.database else "sqlite",
        "devices": "stateless" if args.stateless else "stateful (an input ledger stated at every check-in)",
        "targets": {"bytes_per_registered_device": 2048, "checkins_per_s_per_core": 4000,
                    "registrations_per_s_per_core": 4000, "ready_seconds": 60, "p99_ms": args.p99_ms,
                    "two_process_ratio": 1.7},
        "floor": floor,
        "populations": rows,
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, targets = result["populations"], result["targets"]
    n = [r["population"] for r in rows]

    def per_processes(key: str) -> list[tuple[str, list[float]]]:
        return [(f"{p} process{'es' if p > 1 else ''}",
                 [next(run[key] for run in r["by_processes"] if run["processes"] == p) or float("nan") for r in rows])
                for p in result["processes"]]

    floor = result["floor"]
    panels = [
        ("coordinator memory per registered device (bytes)",
         [("at rest", [r["bytes_per_registered_device_at_rest"] for r in rows])],
         targets["bytes_per_registered_device"], None),
        ("restart to ready (s)", per_processes("ready_seconds"), targets["ready_seconds"], None),
        ("CPU per registration (ms, all processes)", per_processes("cpu_ms_per_registration"),
         1000 / targets["registrations_per_s_per_core"], floor["cpu_ms_per_registration"]),
        ("CPU per idle check-in (ms, all processes)", per_processes("cpu_ms_per_checkin"),
         1000 / targets["checkins_per_s_per_core"], floor["cpu_ms_per_checkin"]),
        ("idle check-ins per second at p99 < limit", per_processes("checkin_capacity_per_s"),
         targets["checkins_per_s_per_core"], floor["checkin_capacity_per_s"]),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6))
    for ax, (title, lines, target, floor_value) in zip(axes, panels):
        for label, values in lines:
            ax.plot(n, values, marker="o", label=label)
        ax.axhline(target, color="tab:red", linestyle="--", label="target (one core)")
        if floor_value:
            ax.axhline(floor_value, color="tab:gray", linestyle=":", label="gRPC floor, one process")
        ax.set_xscale("log")
        ax.set_xlim(min(n) / 2, max(n) * 2)  # fixed: a panel of missing values has no data limits
        ax.set_xlabel("registered devices")
        ax.set_title(title, fontsize=9)
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--populations", type=int, nargs="+", default=[10_000, 100_000, 1_000_000],
                        help="devices enrolled at rest, one run each")
    parser.add_argument("--register", type=int, default=5000,
                        help="devices that register live, each on its own channel, and then check in")
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 2],
                        help="tally coordinator --device-processes, one run of each per population")
    parser.add_argument("--rates", type=float, nargs="+", default=[500, 1000, 1500, 2000, 3000, 4000],
                        help="idle check-ins per second, one step each")
    parser.add_argument("--generators", type=int, default=1,
                        help="load-generator processes, each pinned to a core of its own where one is left")
    parser.add_argument("--stateless", action="store_true",
                        help="devices without a state directory: their check-ins state no input ledger")
    parser.add_argument("--step-seconds", type=float, default=5.0)
    parser.add_argument("--p99-ms", type=float, default=200.0)
    parser.add_argument("--database", metavar="URL",
                        help="PostgreSQL server (a role that may create databases) to keep the store in, "
                        "one new database per population, dropped after (default: SQLite)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--plot", type=Path, help="PNG: each figure against the population")
    args = parser.parse_args()
    for name in ("populations", "rates", "processes"):
        if min(getattr(args, name)) <= 0:
            parser.error(f"--{name}: every value must be > 0")
    if args.generators < 1:
        parser.error("--generators: at least one load-generator process")
    if args.register < args.generators:
        parser.error(f"--register: at least one device per generator ({args.generators}, --generators)")
    result = run(args)
    summary = [{k: v for k, v in row.items() if k != "by_processes"}
               | {"by_processes": [{k: v for k, v in run.items() if k != "checkin_steps"}
                                   for run in row["by_processes"]]}
               for row in result["populations"]]
    print(json.dumps(summary, indent=2))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
    if args.plot:
        plot(result, args.plot)


if __name__ == "__main__":
    main()
