"""A deployment on 127.0.0.1 made of real processes: a coordinator (or several replicas of it
over PostgreSQL) and aggregators over TLS, on ports chosen free when it is made and kept, so that
a killed process comes back where the others expect it, with its state.

The one way Tally starts its services as processes: the demo, the fault campaign, the benchmarks
and the tests that need real processes all build a ``ProcessCluster``."""

from __future__ import annotations

import asyncio
import contextlib
import random
import re
import socket
import sqlite3
import sys
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil

from tally.coordinator.state.database import Database, PostgresDatabase
from tally.coordinator.state.leadership import leader_address
from tally.ops.processes import Process
from tally.security import TLSConfig, bearer_metadata
from tally.security.certs import write_deployment
from tally.security.enrolment import ENROLMENT_KEY_FILE, read_enrolment_key
from tally.security.tls import open_aio_channel
from tally.wire.v1 import admin_pb2, admin_pb2_grpc

AGGREGATOR_READY = r"\(port (\d+)[,)]"  # "(port N)", or "(port N, control API on port M)"
COORDINATOR_READY = r"coordinator on port (\d+)"
# Both roles name their metrics port on the same first line (started with --metrics-port 0).
METRICS_PORT = re.compile(r"metrics on (?:http://\S*:|port )(\d+)")


# Below the kernel's ephemeral range: a port picked here is bound by a process only later, and a
# port the kernel had just handed out (and taken back) could meanwhile go to any server binding
# port 0, as every in-process server of a test suite does; here only another pick can take it.
_PICK_FROM = 10_000
_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def free_port() -> int:
    """A port free on 127.0.0.1 now, for a process to bind later (and again after a restart)."""
    try:
        ephemeral_low = int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):  # not Linux: the kernel's own choice
        ephemeral_low = _PICK_FROM
    rng = random.SystemRandom()
    for _ in range(100):
        port = rng.randrange(_PICK_FROM, ephemeral_low) if ephemeral_low > _PICK_FROM + 100 else 0
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:  # taken: pick another
                continue
            return s.getsockname()[1]
    raise OSError("no free port on 127.0.0.1")


@dataclass(frozen=True)
class Usage:
    """One process's resources as the operating system counts them."""

    cpu_seconds: float
    rss_bytes: int


class ProcessCluster:
    """``start`` brings every process up (each waited for until it says where it listens);
    ``kill``/``restart`` act on one by name (``coordinator``, ``aggregator-1``, ...); ``admin`` is
    an Admin stub with its metadata. ``async with`` starts it and stops it however the body ends.

    ``checkin_hold_s`` None leaves the coordinator's own default; ``new_certificates`` False keeps
    the identities already in ``workdir/certs`` (a resumed run's devices still trust them).

    With ``replicas`` > 1 the coordinator is that many replicas over the PostgreSQL database at
    ``database_url`` (``coordinator``, ``coordinator-2``, ...), each with its own state directory
    and fixed internal port; devices and the Admin API reach ``coordinator``, whichever leads.
    With ``replicas`` 0 there is no coordinator: aggregators alone, for what is measured or
    tested of them from outside. ``ports`` names where each process serves devices. ``python``: the
    interpreter every process runs with (an environment with algorithm packages installed)."""

    def __init__(self, workdir: Path, aggregators: int = 2, checkin_hold_s: float | None = 2.0,
                 coordinator_flags: Sequence[str] = (), replicas: int = 1,
                 database_url: str | None = None, new_certificates: bool = True,
                 python: str = sys.executable) -> None:
        if replicas > 1 and not database_url:
            raise ValueError("coordinator replicas need a PostgreSQL database (database_url)")
        self.workdir = workdir
        self.certs, self.state = workdir / "certs", workdir / "state"
        if new_certificates:  # a deployment has at least one aggregator's identity, used or not
            write_deployment(self.certs, aggregators=max(aggregators, 1), force=True)
        self.tls = TLSConfig.from_dir(self.certs / "device", None)
        self.enrolment_key = read_enrolment_key(self.certs / "coordinator" / ENROLMENT_KEY_FILE)
        logs = workdir / "logs"
        agg_ports = [free_port() for _ in range(aggregators)]
        self.ports = {f"aggregator-{i}": port for i, port in enumerate(agg_ports, start=1)}
        control_ports = [free_port() for _ in range(aggregators)]
        self.processes: dict[str, Process] = {
            f"aggregator-{i}": Process(
                f"aggregator-{i}",
                ["aggregator", "--listen", f"127.0.0.1:{port}", "--control-listen", f"127.0.0.1:{control}",
                 "--id", f"agg-{i}", "--metrics-port", "0",
                 "--tls-dir", str(self.certs / f"aggregator-{i}"), "--require-client-cert"],
                logs / f"aggregator-{i}.log", python)
            for i, (port, control) in enumerate(zip(agg_ports, control_ports), start=1)
        }
        self.database_url = database_url if replicas > 1 else None
        replication: list[str] = []
        if self.database_url:  # a file, as a Secret would give it: no password on a command line
            url_file = workdir / "database-url"
            url_file.touch(mode=0o600)
            url_file.write_text(self.database_url)
            replication = ["--database-file", str(url_file)]
        self.internal_ports: dict[str, int] = {}
        self.port = 0  # the coordinator's, once there is one
        for r in range(1, replicas + 1):
            name = "coordinator" if r == 1 else f"coordinator-{r}"
            port, state = free_port(), self.state if r == 1 else workdir / f"state-{r}"
            self.ports[name] = port
            if r == 1:
                self.port = port
            flags = [*(["--checkin-hold", str(checkin_hold_s)] if checkin_hold_s is not None else []),
                     *coordinator_flags]
            if self.database_url:
                self.internal_ports[name] = free_port()
                flags += [*replication, "--internal-listen", f"127.0.0.1:{self.internal_ports[name]}"]
            self.processes[name] = Process(
                name,
                ["coordinator", "--listen", f"127.0.0.1:{port}", "--state-dir", str(state),
                 "--tls-dir", str(self.certs / "coordinator"), "--metrics-port", "0", *flags,
                 *[a for i, control in enumerate(control_ports, start=1)
                   for a in ("--aggregator", f"agg-{i}=localhost:{control}")]],
                logs / f"{name}.log", python)
        self.target = f"localhost:{self.port}" if replicas else ""
        self.metrics_ports: dict[str, int] = {}
        self._channel = None

    async def start(self) -> None:
        for name in self.processes:
            await self.restart(name)

    async def __aenter__(self) -> ProcessCluster:
        try:
            await self.start()
        except BaseException:  # the processes that did start must not outlive a failed start
            await self.stop()
            raise
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    async def restart(self, name: str) -> None:
        process = self.processes[name]
        ready = await process.start(COORDINATOR_READY if name.startswith("coordinator") else AGGREGATOR_READY)
        if (metrics := METRICS_PORT.search(ready.string)) is not None:
            self.metrics_ports[name] = int(metrics.group(1))

    def scrape(self, name: str) -> str:
        """The Prometheus exposition of process ``name``, as a scraper would read it."""
        url = f"http://127.0.0.1:{self.metrics_ports[name]}/metrics"
        with urllib.request.urlopen(url, timeout=10) as reply:
            return reply.read().decode()

    async def kill(self, name: str) -> None:
        await self.processes[name].kill()

    def leader(self) -> str | None:
        """The replica that leads now (by the internal port it announced); None when none does."""
        assert self.database_url is not None, "one coordinator: nothing to lead"
        database = PostgresDatabase(self.database_url)
        try:
            address = leader_address(database)
        finally:
            database.close()
        port = int(address.rpartition(":")[2]) if address else None
        return next((name for name, p in self.internal_ports.items() if p == port), None)

    @contextlib.contextmanager
    def database(self) -> Iterator[sqlite3.Connection | Database]:
        """The coordinator's own database for reading (the campaign checks it, never writes):
        its SQLite file opened read-only, or the replicas' PostgreSQL database."""
        db: sqlite3.Connection | Database
        if self.database_url:
            db = PostgresDatabase(self.database_url)
        else:
            db = sqlite3.connect(f"file:{self.state / 'coordinator.db'}?mode=ro", uri=True)
        try:
            yield db
        finally:
            db.close()

    def device_fronts(self) -> list[psutil.Process]:
        """The coordinator's running device fronts (``--device-processes``), oldest first: its
        children started by multiprocessing's spawn (not its resource tracker)."""
        fronts = []
        for child in psutil.Process(self.processes["coordinator"].pid).children():
            try:
                if child.status() != psutil.STATUS_ZOMBIE and any("spawn_main" in p for p in child.cmdline()):
                    fronts.append(child)
            except psutil.Error:  # gone since it was listed
                continue
        return sorted(fronts, key=lambda child: child.create_time())

    async def stop(self) -> None:
        if self._channel is not None:
            await self._channel.close()
        # All at once: each may take its whole grace to stop, and one after another they made a
        # SIGTERM'd harness outlast the 60 s a CI step or an operator gives it.
        await asyncio.gather(*(process.stop() for process in reversed(list(self.processes.values()))))

    def admin(self) -> tuple[admin_pb2_grpc.AdminStub, tuple]:
        if self._channel is None:
            self._channel = open_aio_channel(self.target, self.tls)
        token = (self.state / "admin.token").read_text().strip()
        return admin_pb2_grpc.AdminStub(self._channel), bearer_metadata(token)

    async def submit(self, spec: str) -> str:
        stub, md = self.admin()
        return (await stub.SubmitJob(admin_pb2.SubmitJobRequest(spec_yaml=spec), metadata=md, timeout=30)).job_id

    async def job(self, job_id: str, timeout: float = 10.0) -> admin_pb2.Job:
        stub, md = self.admin()
        return await stub.GetJob(admin_pb2.GetJobRequest(job_id=job_id), metadata=md, timeout=timeout)

    def usage(self) -> dict[str, Usage]:
        """CPU seconds and resident memory of each running process."""
        out = {}
        for name, process in self.processes.items():
            if process.running and process.pid is not None:
                try:
                    p = psutil.Process(process.pid)
                    times = p.cpu_times()
                    out[name] = Usage(times.user + times.system, p.memory_info().rss)
                except psutil.NoSuchProcess:
                    continue
        return out

    def died(self, killed: set[str]) -> list[str]:
        """Processes that ended although nobody killed or stopped them."""
        return [name for name, p in self.processes.items() if name not in killed and not p.running]


async def wait_for(predicate, timeout: float, every: float = 0.2) -> bool:
    """Poll an async predicate until it holds or ``timeout`` passes (a harness watching real
    processes from outside has nothing to wait on but their answers)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while loop.time() < end:
        if await predicate():
            return True
        await asyncio.sleep(every)
    return False
