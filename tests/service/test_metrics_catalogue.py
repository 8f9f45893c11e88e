"""The metric catalogue (docs/metrics.md, issue 7) against what each role really serves: a real
coordinator and aggregator over TLS and a client registry, scraped over HTTP. A ``tally_*`` series
missing from the catalogue, or a catalogued one that no longer exists, fails here; so does a rule
or dashboard query naming an uncatalogued series, a default port that drifted from the docs or the
manifests, a ``_created`` series, or health endpoints that do not say what they promise."""

from __future__ import annotations

import argparse
import asyncio
import re
import socket
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from support.metrics_catalogue import CATALOGUE, SECTIONS, catalogue
from support.stack import in_process
from tally.cli import aggregator as aggregator_cli
from tally.cli import client as client_cli
from tally.cli import coordinator as coordinator_cli
from tally.client.metrics import ClientMetrics
from tally.metrics import METRICS_PORTS, MetricsServer
from tally.security import TLSConfig, certs, load_or_create_ticket_key
from tally.version import VERSION

ROOT = Path(__file__).resolve().parents[2]
MONITORING = ROOT / "k8s" / "monitoring"


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


@dataclass
class Served:
    metrics: str
    healthz: tuple[int, str]
    readyz: tuple[int, str]
    refused_after_stop: bool


async def _serve_each_role(tmp_path: Path) -> dict[str, Served]:
    pki = tmp_path / "pki"
    certs.write_deployment(pki)
    public = load_or_create_ticket_key(pki / "coordinator").public_key()
    client = MetricsServer(ClientMetrics().registry)
    async with in_process() as services:
        aggregator = await services.aggregator(TLSConfig.from_dir(pki / "aggregator-1", "aggregator"), public, "agg-1")
        coordinator = await services.coordinator(TLSConfig.from_dir(pki / "coordinator", "coordinator"),
                                                 tmp_path / "state", secrets_dir=pki / "coordinator",
                                                 device_processes=2)  # a device front serves coordinator series too
        ports = {"coordinator": coordinator.metrics_port, "aggregator": aggregator.metrics_port,
                 "client": client.start()}
        try:
            served = {}
            for role, port in ports.items():
                base = f"http://127.0.0.1:{port}"
                metrics = await asyncio.to_thread(_get, f"{base}/metrics")
                assert metrics[0] == 200
                text = metrics[1]
                if role == "coordinator":
                    front = f"http://127.0.0.1:{coordinator.fronts[0].metrics_port}/metrics"
                    text += (await asyncio.to_thread(_get, front))[1]
                served[role] = Served(text, *[await asyncio.to_thread(_get, f"{base}{p}")
                                              for p in ("/healthz", "/readyz")], refused_after_stop=False)
        finally:
            client.stop()
    for role, port in ports.items():
        try:
            await asyncio.to_thread(_get, f"http://127.0.0.1:{port}/healthz")
        except urllib.error.URLError:
            served[role].refused_after_stop = True
    return served


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Served]:
    return asyncio.run(_serve_each_role(tmp_path_factory.mktemp("roles")))


def _exported(text: str) -> dict[str, str]:
    """Exposed ``tally_*`` series name -> type (the parser drops a counter's ``_total``)."""
    return {family.name + ("_total" if family.type == "counter" else ""): family.type
            for family in text_string_to_metric_families(text) if family.name.startswith("tally_")}


def test_the_catalogue_lists_every_tally_series_each_role_serves_and_nothing_else(served):
    listed = catalogue()
    assert set(listed) == set(SECTIONS.values())
    shared = listed["shared"]
    exported_anywhere: set[str] = set()
    for role in METRICS_PORTS:
        exported = _exported(served[role].metrics)
        exported_anywhere |= exported.keys()
        own = listed[role]
        assert exported.keys() - own.keys() - shared.keys() == set(), f"{role}: not in docs/metrics.md"
        assert own.keys() - exported.keys() == set(), f"{role}: catalogued but no longer served"
        for name, kind in exported.items():
            assert (own | shared)[name].type == kind, f"{name} is a {kind}"
    assert shared.keys() - exported_anywhere == set(), "catalogued but served by no role"
    total = sum(len(section) for section in listed.values())
    assert total == len(exported_anywhere) >= 45, total


def test_every_role_serves_build_info_and_process_metrics_and_no_created_series(served):
    for role, s in served.items():
        families = {f.name: f for f in text_string_to_metric_families(s.metrics)}
        (build,) = families["tally_build_info"].samples
        assert build.labels == {"version": VERSION, "role": role} and build.value == 1.0
        assert "process_cpu_seconds" in families and "process_resident_memory_bytes" in families
        assert not [line for line in s.metrics.splitlines() if "_created" in line], role


def test_catalogued_units_and_names_follow_the_conventions():
    for section in catalogue().values():
        for name, entry in section.items():
            assert entry.type in ("counter", "gauge", "histogram"), name
            assert (entry.type == "counter") == name.endswith("_total"), name
            if name.removesuffix("_total").endswith("_seconds"):
                assert "seconds" in entry.unit, name
            if name.removesuffix("_total").endswith("_bytes"):
                assert entry.unit == "bytes", name
            assert not entry.labels & {"device_id", "device", "session_id", "task_id"}, f"{name}: unbounded label"


def test_rules_and_dashboard_name_only_catalogued_series():
    listed = set().union(*catalogue().values())
    texts = [MONITORING / "rules.yaml", MONITORING / "tests" / "alerts_test.yaml", MONITORING / "dashboard.json"]
    used = {re.sub(r"_(bucket|sum|count)$", "", name)
            for path in texts for name in re.findall(r"\btally_[a-z0-9_]+", path.read_text())}
    assert used and used - listed == set()


def test_default_ports_are_the_documented_ones_everywhere():
    table = dict(re.findall(r"^\| (\w+)(?:, \w+)? \| .* \| (\d+) \| ", CATALOGUE.read_text(), re.M))
    assert {role: int(port) for role, port in table.items()} == METRICS_PORTS
    commands = {"coordinator": (coordinator_cli, ["--state-dir", "s"]),
                "aggregator": (aggregator_cli, ["--listen", "127.0.0.1:0", "--id", "a"]),
                "fleet": (client_cli, ["--coordinator", "c:1", "--devices", "2"])}
    parsed = {}
    for command, (module, argv) in commands.items():
        parser = argparse.ArgumentParser(prog="tally")
        module.register(parser.add_subparsers())
        parsed[command] = lambda extra, c=command, p=parser, a=argv: p.parse_args([c, *a, *extra])
    assert parsed["coordinator"]([]).metrics_port == METRICS_PORTS["coordinator"]
    assert parsed["aggregator"]([]).metrics_port == METRICS_PORTS["aggregator"]
    assert parsed["fleet"]([]).metrics_port is None  # a device serves nothing unless asked
    assert parsed["fleet"](["--metrics-port"]).metrics_port == METRICS_PORTS["client"]
    assert parsed["fleet"](["--metrics-port", "0"]).metrics_port == 0
    for args in (parsed["coordinator"]([]), parsed["fleet"](["--metrics-port"])):
        assert args.metrics_addr == "127.0.0.1"
    manifests = [*(ROOT / "k8s" / "base").glob("*.yaml"), *(ROOT / "k8s" / "components" / "loadtest").glob("*.yaml")]
    base = [doc for path in manifests for doc in yaml.safe_load_all(path.read_text()) if doc and "kind" in doc]
    declared = {}
    for workload in base:
        if workload["kind"] in ("StatefulSet", "Job"):
            (container,) = workload["spec"]["template"]["spec"]["containers"]
            port = next(p["containerPort"] for p in container["ports"] if p["name"] == "metrics")
            assert f"--metrics-port={port}" in container["args"] and "--metrics-addr=0.0.0.0" in container["args"]
            declared[workload["metadata"]["labels"]["app.kubernetes.io/component"]] = port
    assert declared == {"coordinator": 9464, "aggregator": 9465, "fleet": 9466}


def test_health_endpoints_say_alive_and_ready_and_stop_with_the_service(served):
    for role, s in served.items():
        assert s.healthz == (200, "ok\n") and s.readyz == (200, "ready\n"), role
        assert s.refused_after_stop, role


def test_readyz_follows_the_readiness_it_is_given():
    ready = False
    server = MetricsServer(ClientMetrics().registry, ready=lambda: ready)
    base = f"http://127.0.0.1:{server.start()}"
    try:
        assert _get(f"{base}/readyz") == (503, "not ready\n")
        assert _get(f"{base}/healthz") == (200, "ok\n")
        ready = True
        assert _get(f"{base}/readyz") == (200, "ready\n")
    finally:
        server.stop()


def test_a_metrics_port_in_use_is_a_one_line_message(tmp_path, capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        parser = argparse.ArgumentParser(prog="tally")
        coordinator_cli.register(parser.add_subparsers())
        args = parser.parse_args(["coordinator", "--state-dir", str(tmp_path / "state"), "--insecure",
                                  "--listen", "127.0.0.1:0", "--metrics-port", port])
        assert args.run(args) == 1
        err = capsys.readouterr().err
        assert f"tally coordinator: metrics server on 127.0.0.1:{port}: Address already in use" in err
        assert "Traceback" not in err
        parser = argparse.ArgumentParser(prog="tally")
        client_cli.register(parser.add_subparsers())
        args = parser.parse_args(["fleet", "--coordinator", "127.0.0.1:1", "--devices", "1", "--insecure",
                                  "--synthetic", "--no-progress", "--metrics-port", port])
        with pytest.raises(SystemExit, match=f"^--metrics-port: metrics server on 127.0.0.1:{port}: Address already"):
            args.run(args)
