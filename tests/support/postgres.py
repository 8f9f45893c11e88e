"""A real PostgreSQL server (Debian package ``postgresql``) for the tests of coordinator replicas:
a fresh cluster (``initdb``) listening on 127.0.0.1 only (or, for containers, on their test
network's gateway and open to that network alone), with password (SCRAM) authentication, as a
deployment's database server would be; stopped and removed at the end."""

from __future__ import annotations

import contextlib
import os
import pwd
import secrets
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

from support import tools
from support.deploy import free_port


def _bindir() -> Path | None:
    """Where initdb and pg_ctl are: on PATH, or in Debian's versioned directory, which it is not on."""
    found = shutil.which("initdb")
    if found:
        return Path(found).parent
    for candidate in sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True):
        if (candidate / "initdb").exists():
            return candidate
    return None


BINDIR = _bindir()
# PostgreSQL refuses to run as root: as root, the server runs as the package's own user.
AS_ROOT = os.geteuid() == 0
_RUN_AS: list[str] = ["runuser", "-u", "postgres", "--"] if AS_ROOT else []


def _missing() -> str | None:
    if BINDIR is None:
        return "PostgreSQL server not installed (Debian package postgresql; `make test` installs it)"
    if AS_ROOT:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            return "running as root, and there is no postgres user to run the server as"
    return None


needs_postgres = tools.needs(_missing())


class PostgresServer:
    """A server in ``directory`` on an ephemeral port; ``database()`` gives each test its own.
    ``listen``: the address it binds; ``clients``: a network (CIDR) besides 127.0.0.1 allowed to
    connect. Created, it has a port and password (so its URL can go into a Secret); ``start()``
    binds, once the address exists."""

    USER = "tally"

    def __init__(self, directory: Path, listen: str = "127.0.0.1", clients: str | None = None) -> None:
        self.directory, self.host = directory, listen
        self.password = secrets.token_hex(16)
        self.port = free_port()
        data, pwfile = directory / "data", directory / "pwfile"
        pwfile.write_text(self.password + "\n")
        if AS_ROOT:  # the server's user owns its directory (a root-owned tmp_path it cannot enter)
            shutil.chown(directory, "postgres")
            shutil.chown(pwfile, "postgres")
        self._run("initdb", "-D", str(data), "-U", self.USER, f"--pwfile={pwfile}", "--auth=scram-sha-256",
                  "--encoding=UTF8", "--no-sync")
        if clients is not None:
            with (data / "pg_hba.conf").open("a") as hba:
                hba.write(f"host all all {clients} scram-sha-256\n")
        self._data, self._started = data, False

    def start(self) -> None:
        self._run("pg_ctl", "-D", str(self._data), "-l", str(self.directory / "server.log"), "-w", "-t", "60",
                  "-o", f"-c listen_addresses={self.host} -p {self.port} -c unix_socket_directories='' "
                  "-c max_connections=300", "start")
        self._started = True

    def _run(self, tool: str, *args: str) -> None:
        assert BINDIR is not None
        done = subprocess.run([*_RUN_AS, str(BINDIR / tool), *args], capture_output=True, text=True,
                              timeout=120, cwd=self.directory)
        if done.returncode != 0:
            log = self.directory / "server.log"
            raise RuntimeError(f"{tool} failed: {done.stderr}\n{log.read_text() if log.exists() else ''}")

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://{self.USER}:{self.password}@{self.host}:{self.port}/{database}"

    def database(self, name: str | None = None) -> str:
        """A new, empty database (``name``, or a fresh one): its URL."""
        import psycopg

        name = name or f"t_{secrets.token_hex(6)}"
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        return self.url(name)

    def stop(self) -> None:
        if self._started:
            self._run("pg_ctl", "-D", str(self._data), "-m", "immediate", "-w", "stop")
            self._started = False


@contextlib.contextmanager
def postgres_server(tmp_dir: Path, listen: str = "127.0.0.1", clients: str | None = None,
                    start: bool = True) -> Iterator[PostgresServer]:
    """A server (``PostgresServer``), started unless ``start`` is False, stopped at the end."""
    # As root, a directory of its own outside pytest's root-only temporary tree (the server's
    # user cannot enter that); removed with the server.
    directory = Path(tempfile.mkdtemp(prefix="tally-postgres-")) if AS_ROOT else tmp_dir
    server = PostgresServer(directory, listen, clients)
    try:
        if start:
            server.start()
        yield server
    finally:
        server.stop()
        if AS_ROOT:
            shutil.rmtree(directory, ignore_errors=True)
