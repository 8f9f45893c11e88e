"""Prometheus for operators (issue 7): the alert and recording rules checked and unit-tested by
promtool, the operator's objects carrying the same rules, and a real Prometheus server scraping
the coordinator and two aggregators through a real job, its numbers checked against the job's."""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml

from client_sdk import DropoutPlan
from test_full_stack import run, spec, stack, trainers

ROOT = Path(__file__).resolve().parents[1]
MONITORING = ROOT / "k8s" / "monitoring"
RULES = MONITORING / "rules.yaml"
PROMTOOL, PROMETHEUS = shutil.which("promtool"), shutil.which("prometheus")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool not installed (Debian package prometheus; `make test` installs it)")
needs_prometheus = pytest.mark.skipif(
    PROMETHEUS is None, reason="prometheus not installed (Debian package prometheus; `make test` installs it)")


def _rules() -> list[dict]:
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]


@needs_promtool
def test_the_rules_pass_promtool_and_every_alert_fires_and_stays_silent_in_its_unit_tests():
    for args in (["check", "rules", str(RULES)], ["test", "rules", str(MONITORING / "tests" / "alerts_test.yaml")]):
        result = subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stdout + result.stderr
    alerts = {r["alert"] for r in _rules() if "alert" in r}
    cases = [case for test in yaml.safe_load((MONITORING / "tests" / "alerts_test.yaml").read_text())["tests"]
             for case in test["alert_rule_test"]]
    fired = {c["alertname"] for c in cases if c["exp_alerts"]}
    silent = {c["alertname"] for c in cases if not c["exp_alerts"]}
    assert len(alerts) == 9 and alerts == fired, alerts ^ fired
    # Each alert also has a case where it must stay silent (the certificate's: the coordinator's
    # certificate, 100 days out, beside the aggregator's that fires).
    assert alerts - silent == {"TallyCertificateExpiring"}


def test_the_operator_objects_carry_the_rules_and_select_the_services():
    rule = yaml.safe_load((MONITORING / "prometheus-rule.yaml").read_text())
    assert rule["kind"] == "PrometheusRule" and rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["spec"]["groups"] == yaml.safe_load(RULES.read_text())["groups"]
    monitors = list(yaml.safe_load_all((MONITORING / "service-monitor.yaml").read_text()))
    service_monitor = next(m for m in monitors if m["kind"] == "ServiceMonitor")
    selector = service_monitor["spec"]["selector"]["matchLabels"]
    base = [doc for path in (ROOT / "k8s" / "base").glob("*.yaml") for doc in yaml.safe_load_all(path.read_text())
            if doc]
    services = {d["metadata"]["name"]: d for d in base if d["kind"] == "Service"}
    for name in ("tally-coordinator", "tally-aggregator"):  # the job names the rules use
        service = services[name]
        assert selector.items() <= service["metadata"]["labels"].items()
        assert "metrics" in {p["name"] for p in service["spec"]["ports"]}
    pod_monitor = next(m for m in monitors if m["kind"] == "PodMonitor")
    fleet = next(d for d in base if d["kind"] == "Job")
    pod = fleet["spec"]["template"]
    assert pod_monitor["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert "metrics" in {p["name"] for c in pod["spec"]["containers"] for p in c.get("ports", [])}
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl not installed: the monitoring kustomization was not rendered")
    rendered = subprocess.run(["kubectl", "kustomize", str(MONITORING)], capture_output=True, text=True, timeout=60)
    assert rendered.returncode == 0, rendered.stderr
    kinds = sorted(d["kind"] for d in yaml.safe_load_all(rendered.stdout))
    assert kinds == ["PodMonitor", "PrometheusRule", "ServiceMonitor"]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class LivePrometheus:
    """A real Prometheus scraping the given targets every second, with Tally's rules loaded."""

    def __init__(self, directory: Path, targets: dict[str, list[int]]) -> None:
        self.port = _free_port()
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(RULES)],
            "scrape_configs": [{"job_name": job, "static_configs": [{"targets": [f"127.0.0.1:{p}" for p in ports]}]}
                               for job, ports in targets.items()],
        }
        (directory / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.process = subprocess.Popen(
            [PROMETHEUS, f"--config.file={directory / 'prometheus.yml'}", f"--storage.tsdb.path={directory / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def query(self, expr: str) -> list[dict]:
        url = f"http://127.0.0.1:{self.port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        with urllib.request.urlopen(url, timeout=5) as reply:
            body = json.loads(reply.read())
        assert body["status"] == "success", body
        return body["data"]["result"]

    def value(self, expr: str) -> float | None:
        result = self.query(expr)
        return float(result[0]["value"][1]) if result else None

    def until(self, expr: str, predicate, deadline_s: float = 60.0) -> float:
        """Poll ``expr`` until ``predicate(value)`` holds (scrapes arrive every second)."""
        end = time.monotonic() + deadline_s
        last = None
        while time.monotonic() < end:
            try:
                last = self.value(expr)
            except OSError:  # not listening yet
                last = None
            if last is not None and predicate(last):
                return last
            time.sleep(0.2)  # nothing to wait on but the next scrape
        raise AssertionError(f"{expr} = {last} after {deadline_s} s")

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)


def _own(registries, name: str) -> float:
    """What the services' own registries say (sum over every label set)."""
    return sum(sample.value for registry in registries for metric in registry.collect()
               for sample in metric.samples if sample.name == name)


@needs_prometheus
def test_a_real_prometheus_scrapes_a_job_and_agrees_with_it(tmp_path):
    # Twice the cohort: an attempt that fails after its masked inputs can only retry with devices
    # that sent none (issue 12's rule).
    rounds, n, cohort = 2, 40, 20
    devices, _ = trainers(n)

    async def main():
        async with stack(tmp_path) as s:
            prometheus = LivePrometheus(tmp_path, {
                "tally-coordinator": [s.coordinator.metrics_port],
                "tally-aggregator": [a.metrics_port for a in s.aggregators],
            })
            try:
                await asyncio.to_thread(prometheus.until, 'sum(up{job=~"tally-.*"})', lambda v: v == 3)
                job_id, _ = await s.run_job(spec("watched", rounds, cohort=cohort).replace(
                    "dropout_rate: 0.1", "dropout_rate: 0.25").replace("min_cohort: 5", "min_cohort: 8"),
                    devices, dropout=DropoutPlan(0.1, seed=3))
                job = await s.job(job_id)
                registries = [a.metrics.registry for a in s.aggregators]
                committed = await asyncio.to_thread(
                    prometheus.until, "sum(tally_coordinator_rounds_committed_total)", lambda v: v >= job.committed_round)
                phases = _own(registries, "tally_aggregator_phase_duration_seconds_count")
                scraped_phases = await asyncio.to_thread(
                    prometheus.until, "sum(tally_aggregator_phase_duration_seconds_count)", lambda v: v >= phases)
                dropouts = _own(registries, "tally_aggregator_dropouts_total")
                scraped_dropouts = await asyncio.to_thread(
                    prometheus.until, "sum(tally_aggregator_dropouts_total) or vector(0)", lambda v: v >= dropouts)
                evaluated = {r.get("record") or r["alert"]: prometheus.query(r["expr"]) for r in _rules()}
                up = prometheus.value('up{job="tally-coordinator"}')
                return job, committed, phases, scraped_phases, dropouts, scraped_dropouts, evaluated, up
            finally:
                prometheus.stop()

    job, committed, phases, scraped_phases, dropouts, scraped_dropouts, evaluated, up = run(main())
    assert job.committed_round == rounds and committed == rounds
    assert phases > 0 and scraped_phases == phases  # every phase the aggregators timed, scraped
    assert scraped_dropouts == dropouts
    assert up == 1.0
    assert len(evaluated) == len(_rules())  # every rule expression parses and runs on live data
    assert evaluated["TallyCoordinatorDown"] == [] and evaluated["TallyAggregatorDown"] == []


def test_certificate_expiry_is_exported_and_follows_a_renewal(tmp_path):
    from prometheus_client import CollectorRegistry

    from tally.metrics import watch_certificate
    from tally.security import certs

    certs.write_deployment(tmp_path, days=30)
    registry = CollectorRegistry()
    watch_certificate(registry, tmp_path / "aggregator-1" / "aggregator.pem", "aggregator")
    expiry = registry.get_sample_value("tally_tls_certificate_expiry_timestamp_seconds", {"role": "aggregator"})
    assert 29 * 86400 < expiry - time.time() <= 31 * 86400
    certs.write_deployment(tmp_path / "renewed", days=90)
    renewed = (tmp_path / "renewed" / "aggregator-1" / "aggregator.pem").read_bytes()
    certs.write_file_atomic(tmp_path / "aggregator-1" / "aggregator.pem", renewed, 0o644)
    later = registry.get_sample_value("tally_tls_certificate_expiry_timestamp_seconds", {"role": "aggregator"})
    assert 89 * 86400 < later - time.time() <= 91 * 86400
    plain = CollectorRegistry()
    watch_certificate(plain, None, "coordinator")
    assert plain.get_sample_value("tally_tls_certificate_expiry_timestamp_seconds", {"role": "coordinator"}) is None
