"""The images `make images` builds, and the dev overlay's pods run from them as containers.

`make test-containers` runs this module after `make images`; `make test` leaves it out. A machine
that cannot run containers skips it with the reason, except under `make test-containers`
(TALLY_REQUIRE_CONTAINERS=1) or in CI (TALLY_REQUIRE_TOOLS=1), where that is a failure (support.tools).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import textwrap
import time
import tomllib
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from cryptography import x509

from support import tools
from support.containers import (
    CANNOT_HONOUR,
    RUNTIME,
    ContainerPod,
    can_run_containers,
    podman,
    pull,
    quantity_bytes,
    remove_everything,
    service_hosts,
    start,
)
from support.deploy import ROOT, free_port
from support.gateway import LOG_LINE, HAProxy, edge_overlay, haproxy_config
from support.manifests import K8S, LocalPod, ManifestCluster, find, image_entrypoint, load_secrets, one, render
from support.operator_scrape import scrape_configs, targets
from support.postgres import needs_postgres, postgres_server
from support.prometheus import LivePrometheus, needs_prometheus
from support.registry import Registry
from tally.cli import main as tally_main

pytestmark = pytest.mark.containers

VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
ROLES = ("aggregator", "coordinator", "client")
COMPILERS = ("gcc", "cc", "c++", "g++", "clang", "ld", "as", "make")
BASE_IMAGE = "localhost/tally-base:bookworm"
BUILT_BY = "org.tally.built-by=docker/build-images.sh"  # the label of every image `make images` builds


@pytest.fixture(scope="module")
def images() -> dict[str, str]:
    why = can_run_containers()
    missing = [r for r in ROLES if why is None
               and podman("image", "exists", f"localhost/tally-{r}:{VERSION}", check=False).returncode != 0]
    if missing:
        why = f"images not built (`make images`): {', '.join(missing)}"
    # What the dev-overlay test needs besides: without it that test would skip, not fail.
    for program, package in (("prometheus", "prometheus"), ("kubectl", "kubectl with kustomize")):
        if why is None and shutil.which(program) is None:
            why = f"{program} is not installed ({package})"
    if why is not None:
        tools.missing(why)
    return {role: f"localhost/tally-{role}:{VERSION}" for role in ROLES}


def _inside(image: str, script: str) -> subprocess.CompletedProcess[str]:
    """``script`` in a throwaway container of ``image``, as the image's own user."""
    return podman("run", "--rm", "--pull", "never", *RUNTIME, "--read-only", "--entrypoint", "python3", image,
                  "-c", script, check=False)


@pytest.mark.parametrize("role", ROLES)
def test_each_image_runs_its_role_as_a_user_under_tini(images: dict[str, str], role: str) -> None:
    inspected = json.loads(podman("image", "inspect", images[role]).stdout)[0]
    config = inspected["Config"]
    assert config["Entrypoint"] == image_entrypoint(images[role])
    assert config["Entrypoint"][:2] == ["tini", "--"]
    assert config["User"] == "10001:10001"
    assert "tally-probe" in " ".join(inspected["Healthcheck"]["Test"])
    result = _inside(images[role], "import os, shutil, sys; print(os.getuid(), shutil.which('tini'), "
                                   f"shutil.which('{config['Entrypoint'][-1]}'))")
    assert result.returncode == 0, result.stderr
    uid, tini, program = result.stdout.split()
    assert uid == "10001" and tini != "None" and program.startswith("/opt/tally/bin/")
    # tini is PID 1 and the role its child: the role's --help answers through it.
    helped = podman("run", "--rm", "--pull", "never", *RUNTIME, images[role], "--help", check=False)
    assert helped.returncode == 0 and "usage: tally-" in helped.stdout, helped.stderr


def test_the_aggregator_image_has_no_torch_no_scipy_and_no_compiler(images: dict[str, str]) -> None:
    script = ("import importlib.util, shutil; "
              f"print([m for m in ('torch', 'scipy', 'onnx', 'sklearn') if importlib.util.find_spec(m)]); "
              f"print([c for c in {COMPILERS!r} if shutil.which(c)])")
    result = _inside(images["aggregator"], script)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[:2] == ["[]", "[]"], result.stdout
    # The check itself can fail: the coordinator's image does carry torch, the CPU build.
    coordinator = _inside(images["coordinator"], "import torch; print(torch.version.cuda)")
    assert coordinator.stdout.strip() == "None", coordinator.stdout + coordinator.stderr


# -- the dev overlay in containers ---------------------------------------------------------------


def _operator_objects() -> list[dict[str, Any]]:
    return render(K8S / "monitoring")


def _prometheus(directory: Path, namespace: str, objects: list[dict[str, Any]],
                pods: list[ContainerPod]) -> LivePrometheus:
    """A real Prometheus scraping the pods as the operator would configure it from the rendered
    ServiceMonitor and PodMonitor, with the PrometheusRule's groups as its rules."""
    monitoring = _operator_objects()
    monitors = find(monitoring, "ServiceMonitor") + find(monitoring, "PodMonitor")
    jobs = []
    for monitor in monitors:
        for job in scrape_configs(monitor, namespace):
            groups = targets(monitor, objects, [p.running() for p in pods], namespace)
            (directory / job["file_sd_configs"][0]["files"][0]).write_text(json.dumps(groups))
            job["file_sd_configs"][0]["files"] = [str(directory / job["file_sd_configs"][0]["files"][0])]
            jobs.append(job)
    rule = one(monitoring, "PrometheusRule", "tally")
    (directory / "rules.yaml").write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    return LivePrometheus(directory, {
        # The monitors set their own scrape intervals; rules are evaluated every 5 s (the stack's
        # default is 30 s: only the wait shortens, not what fires).
        "global": {"evaluation_interval": "5s"},
        "rule_files": [str(directory / "rules.yaml")],
        "scrape_configs": jobs,
    })


def _metric(pod: ContainerPod, name: str) -> float:
    """A pod's own /metrics, summed over the series of ``name``."""
    port = next(p["containerPort"] for p in pod.container["ports"] if p["name"] == "metrics")
    with urllib.request.urlopen(f"http://{pod.ip}:{port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    return sum(float(m.group(1)) for m in re.finditer(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def _job(coordinator: ContainerPod, device: ContainerPod, *action: str) -> subprocess.CompletedProcess[str]:
    """``tally job ACTION...`` from this machine against ``coordinator``, with the admin token
    from its state volume and the CA ``device`` trusts."""
    state = podman("volume", "inspect", coordinator.volumes["state"], "--format", "{{.Mountpoint}}").stdout.strip()
    return subprocess.run(
        [sys.executable, "-m", "tally.cli", "job", *action, "--coordinator", f"{coordinator.ip}:7000",
         "--server-name", "tally-coordinator", "--state-dir", f"{state}/state",
         "--tls-dir", str(device.local.mounts["/etc/tally/tls"])],
        capture_output=True, text=True, timeout=60)


def _doomed(job_spec: str) -> str:
    """``job_spec`` made to fail within seconds: no device of its population exists, and its
    round may not retry an empty selection."""
    doomed = yaml.safe_load(job_spec)
    doomed.update(name="doomed", population="nobody", retries=0,
                  deadlines={**doomed.get("deadlines", {}), "checkin": 1})
    return yaml.safe_dump(doomed)


def _alert(prometheus: LivePrometheus, name: str, pod: str) -> str | None:
    states = [a["state"] for a in prometheus.alerts() if a["labels"]["alertname"] == name
              and a["labels"].get("pod") == pod]
    return states[0] if states else None


@needs_prometheus
def test_the_dev_overlay_runs_in_containers_and_prometheus_sees_an_aggregator_go_down(
        images: dict[str, str], tmp_path: Path) -> None:
    """Coordinator, two aggregators and the fleet Job's two pods, each a container exactly as its
    manifest says; a real Prometheus configured from the ServiceMonitor/PodMonitor. One
    aggregator stopped: TallyAggregatorDown fires for that pod and no other; once it is back, the
    coordinator and the fleet start and the ConfigMap's job commits every round through secure
    aggregation, in both aggregators (before its job: a job waiting out a two-minute outage
    without devices would spend its retry budget on empty selection windows). Then a job made
    to fail: TallyJobFailed fires for the namespace, and had not before."""
    objects = render(K8S / "overlays" / "dev")
    namespace = one(objects, "Namespace", "tally")["metadata"]["name"]
    assert tally_main(["certs", "--out", str(tmp_path / "certs"), "--k8s-secrets", str(tmp_path / "k8s")]) == 0
    cluster = ManifestCluster(objects, load_secrets(tmp_path / "k8s"), tmp_path / "pods", namespace=namespace)
    prefix = f"tally-e2e-{secrets.token_hex(3)}"
    subnet = f"10.{200 + secrets.randbelow(50)}.{secrets.randbelow(250)}"
    aggregators = one(objects, "StatefulSet", "tally-aggregator")
    coordinator_set = one(objects, "StatefulSet", "tally-coordinator")
    job = one(objects, "Job", "tally-fleet")
    pods = [ContainerPod(LocalPod(cluster, coordinator_set, "tally-coordinator-0"), coordinator_set,
                         f"{subnet}.10", prefix)]
    pods += [ContainerPod(LocalPod(cluster, aggregators, f"tally-aggregator-{i}"), aggregators,
                          f"{subnet}.{20 + i}", prefix)
             for i in range(aggregators["spec"]["replicas"])]
    fleet = [ContainerPod(LocalPod(cluster, job, f"tally-fleet-{i}-x{i}",
                                   annotations={"batch.kubernetes.io/job-completion-index": str(i)}),
                          job, f"{subnet}.{30 + i}", prefix)
             for i in range(job["spec"]["completions"])]
    coordinator, aggregator_pods = pods[0], pods[1:]
    assert len(aggregator_pods) == 2, "the dev overlay runs two aggregators"
    unhonoured = {field: why for pod in pods + fleet for field, why in pod.unhonoured().items()}
    if find(objects, "NetworkPolicy"):
        unhonoured["NetworkPolicy"] = CANNOT_HONOUR["NetworkPolicy"]
    print("not honoured here:\n" + "\n".join(f"  {f}: {why}" for f, why in sorted(unhonoured.items())))
    hosts = service_hosts(cluster, pods)
    prometheus = None
    network = f"{prefix}-net"
    try:
        podman("network", "create", "--subnet", f"{subnet}.0/24", network)
        (tmp_path / "prometheus").mkdir()
        prometheus = _prometheus(tmp_path / "prometheus", namespace, objects, pods + fleet)
        for pod in aggregator_pods:
            start(pod, network, hosts)
        for pod in aggregator_pods:
            pod.until_started()
        prometheus.until('count(up{job="tally-aggregator"} == 1)', lambda v: v == 2, deadline_s=90)

        down = aggregator_pods[1]
        podman("stop", down.container_name, timeout=120)
        prometheus.until(f'up{{pod="{down.name}"}}', lambda v: v == 0, deadline_s=60)
        assert _alert(prometheus, "TallyAggregatorDown", down.name) in (None, "pending")
        prometheus.until(f'count(ALERTS{{alertname="TallyAggregatorDown", alertstate="firing", pod="{down.name}"}})',
                         lambda v: v == 1, deadline_s=240)
        assert _alert(prometheus, "TallyAggregatorDown", aggregator_pods[0].name) is None, "only the stopped one"
        podman("start", down.container_name, timeout=120)  # the kubelet restarting the container
        down.until_started()
        prometheus.until(f'up{{pod="{down.name}"}}', lambda v: v == 1, deadline_s=60)

        # The coordinator and the fleet Job's pods start together, as an apply starts them; the
        # coordinator submits the ConfigMap's job at start.
        for pod in [coordinator, *fleet]:
            start(pod, network, hosts)
        coordinator.until_started()
        prometheus.until('count(up{job=~"tally-coordinator|tally-aggregator"} == 1)', lambda v: v == 3, deadline_s=90)
        # The scraped series carry the names the dashboard and rules query by.
        labels = {(s["job"], s["pod"], s["namespace"]) for s in prometheus.series('up{job=~"tally-.*"}')}
        assert labels >= {("tally-aggregator", "tally-aggregator-1", namespace),
                          ("tally-coordinator", "tally-coordinator-0", namespace)}, labels
        job_spec = next(m["data"]["digits.yaml"] for m in find(objects, "ConfigMap")
                        if "digits.yaml" in m.get("data", {}))
        rounds = yaml.safe_load(job_spec)["rounds"]
        committed = f'sum(tally_coordinator_rounds_committed_total{{pod="{coordinator.name}"}})'
        try:
            prometheus.until(committed, lambda v: v == rounds, deadline_s=300)
        except AssertionError as stalled:
            raise AssertionError(f"{stalled}\n{coordinator.logs()}\n{fleet[0].logs()}") from None
        for pod in fleet:
            assert pod.exit_code(timeout=120) == 0, pod.logs()
            assert re.search(r"fleet of \d+", pod.logs()), pod.logs()
        assert _metric(coordinator, "tally_coordinator_rounds_committed_total") == rounds
        for pod in aggregator_pods:
            assert _metric(pod, "tally_aggregator_sessions_finished_total") >= 1, f"{pod.name} served no session"
        listing = _job(coordinator, fleet[0], "list")
        assert re.search(r"^digits-\w+\s+SUCCEEDED", listing.stdout, re.M), listing.stdout + listing.stderr
        failed = (f'count(ALERTS{{alertname="TallyJobFailed", alertstate="firing", namespace="{namespace}"}}) '
                  "or vector(0)")
        assert prometheus.value(failed) == 0, "a job failed before one was made to"
        (tmp_path / "doomed.yaml").write_text(_doomed(job_spec))
        submitted = _job(coordinator, fleet[0], "submit", str(tmp_path / "doomed.yaml"))
        assert submitted.returncode == 0, submitted.stdout + submitted.stderr
        # A scrape (15 s, the ServiceMonitor's) and an evaluation (5 s) after the job fails.
        prometheus.until(failed, lambda v: v == 1, deadline_s=90)
        assert re.search(r"^doomed-\w+\s+FAILED", _job(coordinator, fleet[0], "list").stdout, re.M)
        for pod in pods:
            assert pod.probe("livenessProbe").returncode == 0, pod.logs()
    finally:
        try:
            remove_everything(prefix)
        finally:
            if prometheus is not None:
                prometheus.stop()


# -- the replicas overlay in containers ----------------------------------------------------------


def _replicas_with_a_fleet(directory: Path, rounds: int, devices: int) -> list[dict[str, Any]]:
    """The replicas overlay with the load-test Job of ``devices`` devices and a digits job of
    ``rounds`` rounds, composed as an operator would compose them (a kustomization of their own
    that names ours)."""
    directory.mkdir()
    job = yaml.safe_load((K8S / "overlays" / "dev" / "jobs" / "digits.yaml").read_text())
    (directory / "digits.yaml").write_text(yaml.safe_dump({**job, "rounds": rounds}))
    (directory / "fleet.yaml").write_text(yaml.safe_dump({
        "apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "tally-fleet"},
        "spec": {"template": {"spec": {"containers": [
            {"name": "fleet", "env": [{"name": "FLEET_DEVICES", "value": str(devices)}]}]}}},
    }))
    ours = Path(os.path.relpath(K8S, directory))  # kustomize takes no absolute paths
    (directory / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", "namespace": "tally",
        "resources": [str(ours / "overlays" / "replicas")],
        "components": [str(ours / "components" / "loadtest"), str(ours / "components" / "images")],
        "configMapGenerator": [{"name": "tally-jobs", "files": ["digits.yaml"]}],
        "patches": [{"path": "fleet.yaml"}],
    }))
    return render(directory)


def _until(what: str, check: Callable[[], bool], deadline_s: float) -> None:
    end = time.monotonic() + deadline_s
    while not check():
        if time.monotonic() > end:
            raise AssertionError(f"not within {deadline_s} s: {what}")
        time.sleep(0.5)  # nothing to wait on but the pods' next metrics


def _leaders(pods: list[ContainerPod]) -> list[str]:
    """The coordinator pods whose tally_coordinator_leader reads 1. A stopped pod reads nothing,
    nor does one between following and leading (its metrics port changes hands)."""
    def leads(pod: ContainerPod) -> bool:
        try:
            return pod.state() == "running" and _metric(pod, "tally_coordinator_leader") == 1
        except OSError:
            return False
    return [p.name for p in pods if leads(p)]


@needs_postgres
def test_coordinator_replicas_run_in_containers_over_postgresql_and_one_takes_over_from_a_killed_leader(
        images: dict[str, str], tmp_path: Path) -> None:
    """The replicas overlay's pods (three coordinators, three aggregators) as containers exactly as
    their manifests say, over a real PostgreSQL server outside the "cluster" (the operator's
    ``tally-database`` Secret names it), with the load-test Job's devices. The devices reach one
    follower (the Service's name resolves to it). The leader is SIGKILLed once a round has
    committed: another replica takes the lead, the job finishes every round, the fleet's pods
    exit 0, and the killed pod, started again as a kubelet would, follows."""
    # Devices that sent their masked input in the attempt the kill cut short are not seated again
    # in that round (the differencing rule): the fleet is large enough for a retry without them.
    rounds, devices = 4, 24
    objects = _replicas_with_a_fleet(tmp_path / "overlay", rounds, devices)
    assert tally_main(["certs", "--out", str(tmp_path / "certs"), "--k8s-secrets", str(tmp_path / "k8s")]) == 0
    prefix = f"tally-e2e-{secrets.token_hex(3)}"
    subnet = f"10.{200 + secrets.randbelow(50)}.{secrets.randbelow(250)}"
    network = f"{prefix}-net"
    try:
        podman("network", "create", "--subnet", f"{subnet}.0/24", network)
        gateway = json.loads(podman("network", "inspect", network).stdout)[0]["subnets"][0]["gateway"]
        with postgres_server(tmp_path / "postgres", listen=gateway, clients=f"{subnet}.0/24", start=False) as database:
            secret_store = load_secrets(tmp_path / "k8s") | {"tally-database": {"url": database.url("tally").encode()}}
            cluster = ManifestCluster(objects, secret_store, tmp_path / "pods", namespace="tally")
            coordinator_set = one(objects, "StatefulSet", "tally-coordinator")
            aggregator_set = one(objects, "StatefulSet", "tally-aggregator")
            job = one(objects, "Job", "tally-fleet")

            def pod(workload: dict[str, Any], name: str, ip: str, **extra: Any) -> ContainerPod:
                return ContainerPod(LocalPod(cluster, workload, name, ip=ip, **extra), workload, ip, prefix)

            coordinators = [pod(coordinator_set, f"tally-coordinator-{i}", f"{subnet}.{10 + i}")
                            for i in range(coordinator_set["spec"]["replicas"])]
            aggregators = [pod(aggregator_set, f"tally-aggregator-{i}", f"{subnet}.{20 + i}")
                           for i in range(aggregator_set["spec"]["replicas"])]
            fleet = [pod(job, f"tally-fleet-{i}-x{i}", f"{subnet}.{30 + i}",
                         annotations={"batch.kubernetes.io/job-completion-index": str(i)})
                     for i in range(job["spec"]["completions"])]
            assert len(coordinators) == 3 and len(aggregators) == 3
            unhonoured = {field: why for p in coordinators + aggregators + fleet
                          for field, why in p.unhonoured().items()}
            unhonoured |= {kind: "no cert-manager here: `tally certs` writes the same Secrets"
                           for kind in ("Certificate", "Issuer") if find(objects, kind)}
            unhonoured |= {"NetworkPolicy": CANNOT_HONOUR["NetworkPolicy"],
                           "HorizontalPodAutoscaler": "three aggregators, the StatefulSet's replicas, stay three"}
            print("not honoured here:\n" + "\n".join(f"  {f}: {why}" for f, why in sorted(unhonoured.items())))
            # The Service's name resolves to its first pod: a follower, so the devices' calls are
            # forwarded to whichever replica leads.
            leader, follower = coordinators[0], coordinators[1]
            hosts = service_hosts(cluster, [follower, *coordinators, *aggregators])

            for p in aggregators:
                start(p, network, hosts)
            database.start()  # on the network's gateway, which exists once a container is on it
            database.database("tally")
            for p in aggregators:
                p.until_started()
            start(leader, network, hosts)
            leader.until_started()
            for p in coordinators[1:]:
                start(p, network, hosts)
            for p in coordinators[1:]:
                p.until_started()
            assert _leaders(coordinators) == [leader.name], [p.logs() for p in coordinators]

            for p in fleet:
                start(p, network, hosts)
            committed = lambda: _metric(leader, "tally_coordinator_rounds_committed_total") >= 1  # noqa: E731
            try:
                _until("the first round committed", committed, deadline_s=300)
            except AssertionError as stalled:
                raise AssertionError(f"{stalled}\n{leader.logs()}\n{follower.logs()}\n{fleet[0].logs()}") from None
            podman("kill", "--signal", "KILL", leader.container_name)
            killed = time.monotonic()
            survivors = coordinators[1:]
            _until("one surviving replica leads", lambda: len(_leaders(survivors)) == 1, deadline_s=60)
            print(f"a surviving replica leads {time.monotonic() - killed:.1f} s after the leader's SIGKILL")
            for p in fleet:
                assert p.exit_code(timeout=420) == 0, p.logs() + "\n" + "\n".join(c.logs() for c in survivors)
            listing = _job(follower, fleet[0], "list")
            assert re.search(r"^digits-\w+\s+SUCCEEDED", listing.stdout, re.M), listing.stdout + listing.stderr
            new_leader = next(p for p in survivors if p.name in _leaders(survivors))
            assert _metric(new_leader, "tally_coordinator_rounds_committed_total") >= 1, "the new leader committed none"

            podman("start", leader.container_name, timeout=120)  # the kubelet restarting the container
            leader.until_started()
            assert _leaders(coordinators) == [new_leader.name]
            for p in coordinators + aggregators:
                assert p.probe("livenessProbe").returncode == 0, p.logs()
    finally:
        remove_everything(prefix)


# -- the edge overlay: devices outside, through an SNI gateway, images from a registry -------------

EDGE_DOMAIN = "edge.test"
# A synthetic job (every committed sum checkable exactly), secure, for the outside fleet.
EDGE_JOB = ("name: outside\nalgorithm: fedavg\nrounds: 2\ncohort_size: 10\nover_selection: 1.2\nmin_cohort: 5\n"
            "model: {kind: mlp, inputs: 64, classes: 10, hidden: 8, seed: 0}\n"
            "secure: {dropout_rate: 0.1, corrupt_rate: 0.05}\n"
            "deadlines: {checkin: 60, download: 60, advertise_keys: 30, share_keys: 30, masked_input: 60, "
            "unmask: 30}\n")
OUTSIDE_DEVICES = 20
HELD_CONNECTIONS = 4000  # held open at once through the gateway by one aggregator pod
ARRIVING_AT_ONCE = 500  # of them, connecting together


def _pushed(tmp_path: Path, registry: Registry) -> Path:
    """A copy of k8s/ whose images component `make images REGISTRY=...` rewrote after pushing
    the images to ``registry`` (docker/push-images.sh, the step it runs)."""
    k8s = tmp_path / "k8s"
    shutil.copytree(K8S, k8s)
    env = {**os.environ, "REGISTRY": f"{registry.address}/tally", "TLS_VERIFY": "false",
           "IMAGES_COMPONENT": str(k8s / "components" / "images")}
    pushed = subprocess.run(["bash", str(ROOT / "docker" / "push-images.sh")], capture_output=True, text=True,
                            timeout=1800, env=env)
    assert pushed.returncode == 0, pushed.stderr[-3000:]
    return k8s


def _endpoints(objects: list[dict[str, Any]], pods: list[ContainerPod]) -> Callable[[str, int], list[str]]:
    """What a Service port's EndpointSlice would list: ip:containerPort of each running pod it selects."""
    def endpoints(service: str, port: int) -> list[str]:
        spec = one(objects, "Service", service)["spec"]
        target = next(p["targetPort"] for p in spec["ports"] if p["port"] == port)
        found = []
        for pod in pods:
            running = pod.running()
            if spec["selector"].items() <= running.labels.items() and pod.state() == "running":
                found += [f"{pod.ip}:{p['containerPort']}" for p in running.ports
                          if target in (p["name"], p["containerPort"])]
        return found
    return endpoints


def _hold_connections(gateway: int, name: str, ca: Path, count: int,
                      while_held: Callable[[], int]) -> tuple[int, float, int]:
    """``count`` devices' own connections (one channel each) through the gateway to ``name``, each
    through a TLS handshake with the pod and a health check, ``ARRIVING_AT_ONCE`` at a time, then
    all held open together: how many answered SERVING, the seconds that took, and
    ``while_held()`` asked while they are all open."""
    import asyncio

    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from tally.security import TLSConfig
    from tally.security.tls import open_aio_channel

    async def main() -> tuple[int, float, int]:
        # A local subchannel pool: each channel its own TCP connection, as separate phones have.
        channels = [open_aio_channel(f"127.0.0.1:{gateway}", TLSConfig(ca=ca, server_name=name),
                                     [("grpc.use_local_subchannel_pool", 1)]) for _ in range(count)]
        started, replies = time.monotonic(), []
        try:
            # Devices arrive in waves (a cohort's members at a session's start), not all in one instant.
            for wave in range(0, count, ARRIVING_AT_ONCE):
                replies += await asyncio.gather(*(health_pb2_grpc.HealthStub(c).Check(
                    health_pb2.HealthCheckRequest(), timeout=300) for c in channels[wave:wave + ARRIVING_AT_ONCE]),
                    return_exceptions=True)
            took = time.monotonic() - started
            serving = sum(1 for r in replies if getattr(r, "status", None) == health_pb2.HealthCheckResponse.SERVING)
            return serving, took, await asyncio.to_thread(while_held)
        finally:
            await asyncio.gather(*(c.close() for c in channels))

    return asyncio.run(main())


def _memory(pod: ContainerPod) -> int:
    """The container's memory use in bytes, as its cgroup counts it (what a memory limit caps)."""
    used = podman("stats", "--no-stream", "--format", "{{.MemUsage}}", pod.container_name).stdout
    number, unit = re.fullmatch(r"([\d.]+)\s*([kMG]?B)", used.split("/")[0].strip()).groups()
    return int(float(number) * {"B": 1, "kB": 1000, "MB": 1000 ** 2, "GB": 1000 ** 3}[unit])


def _backend_stats(gateway: HAProxy) -> dict[str, dict[str, int]]:
    return {row["pxname"]: {k: int(row[k] or 0) for k in ("scur", "smax", "stot")}
            for row in gateway.stats() if row["svname"] == "BACKEND"}


def test_devices_outside_reach_the_edge_overlay_only_through_an_sni_gateway_with_images_from_a_registry(
        images: dict[str, str], tmp_path: Path) -> None:
    """The images pushed to a real registry (Debian's docker-registry) and pinned by digest in the
    rendered overlay; prod's servers with the edge gateway component as containers pulled from it;
    HAProxy configured from the rendered Gateway and TLSRoutes as the only way in, on one port of
    127.0.0.1; a fleet outside the pods' network (the client image on the host's network, whose
    DNS answers the external names with the gateway's address) runs a secure job: it commits,
    every cohort sum exact. A device that dials a pod name with no route is refused at the
    gateway, one with a wrong SNI gets a named TLS error, and the gateway's log holds routing facts
    only. Then the measured figure: devices' own connections held at once through the gateway by
    one aggregator pod."""
    tools.require("haproxy", "Debian's haproxy: `make gateway-tools` installs it")
    registry = Registry(tmp_path / "registry")
    gateway: HAProxy | None = None
    prefix = f"tally-e2e-{secrets.token_hex(3)}"
    subnet = f"10.{200 + secrets.randbelow(50)}.{secrets.randbelow(250)}"
    network = f"{prefix}-net"
    try:
        k8s = _pushed(tmp_path, registry)
        port = free_port()
        outside = k8s / "overlays" / "outside"
        outside.mkdir()
        (outside / "outside.yaml").write_text(EDGE_JOB)
        (outside / "kustomization.yaml").write_text(yaml.safe_dump({
            "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", "namespace": "tally",
            "resources": ["../prod"], "configMapGenerator": [{"name": "tally-jobs", "files": ["outside.yaml"]}]}))
        objects = render(edge_overlay(k8s / "overlays" / "outside-edge", outside, EDGE_DOMAIN, port))
        pinned = {c["image"] for o in find(objects, "StatefulSet") for c in o["spec"]["template"]["spec"]["containers"]}
        by_digest = rf"{re.escape(registry.address)}/tally/tally-(coordinator|aggregator)@sha256:[0-9a-f]{{64}}"
        assert len(pinned) == 2 and all(re.fullmatch(by_digest, image) for image in pinned), pinned
        component = yaml.safe_load((k8s / "components" / "images" / "kustomization.yaml").read_text())
        client_image = next(f"{e['newName']}@{e['digest']}" for e in component["images"] if e["name"] == "tally-client")
        assert tally_main(["certs", "--out", str(tmp_path / "certs"), "--k8s-secrets", str(tmp_path / "k8s-secrets"),
                           "--dns", f"tally-coordinator.{EDGE_DOMAIN}", "--dns", f"*.aggregators.{EDGE_DOMAIN}"]) == 0
        cluster = ManifestCluster(objects, load_secrets(tmp_path / "k8s-secrets"), tmp_path / "pods", namespace="tally")
        coordinator_set = one(objects, "StatefulSet", "tally-coordinator")
        aggregator_set = one(objects, "StatefulSet", "tally-aggregator")
        coordinator = ContainerPod(LocalPod(cluster, coordinator_set, "tally-coordinator-0"), coordinator_set,
                                   f"{subnet}.10", prefix)
        aggregators = [ContainerPod(LocalPod(cluster, aggregator_set, f"tally-aggregator-{i}"), aggregator_set,
                                    f"{subnet}.{20 + i}", prefix) for i in range(aggregator_set["spec"]["replicas"])]
        unhonoured = {f: why for p in [coordinator, *aggregators] for f, why in p.unhonoured().items()}
        unhonoured |= {kind: "no cert-manager here: `tally certs --dns` writes the same Secrets"
                       for kind in ("Certificate", "Issuer")}
        unhonoured |= {"NetworkPolicy": CANNOT_HONOUR["NetworkPolicy"],
                       "HorizontalPodAutoscaler": "the StatefulSet's three aggregators stay three",
                       "Gateway": "HAProxy, configured from the Gateway and its TLSRoutes, is the gateway"}
        print("not honoured here:\n" + "\n".join(f"  {f}: {why}" for f, why in sorted(unhonoured.items())))
        hosts = service_hosts(cluster, [coordinator, *aggregators])
        podman("network", "create", "--subnet", f"{subnet}.0/24", network)
        for pod in [*aggregators, coordinator]:
            start(pod, network, hosts)  # pulled from the registry by digest first
            assert pod.container["image"] in json.loads(podman("image", "inspect", pod.container["image"]).stdout)[0][
                "RepoDigests"]
        for pod in [*aggregators, coordinator]:
            pod.until_started()
        gateway = HAProxy(tmp_path / "gateway", haproxy_config(objects, "tally-edge", "tls", f"127.0.0.1:{port}",
                                                               _endpoints(objects, [coordinator, *aggregators])))

        # The device outside: the client image on the host's network; its resolver answers every
        # external name with the gateway's address (a wildcard DNS record would), nothing else.
        device = tmp_path / "device"
        (device / "tls").mkdir(parents=True)
        shutil.copy(tmp_path / "certs" / "device" / "ca.pem", device / "tls" / "ca.pem")
        shutil.copy(tmp_path / "certs" / "coordinator" / "enrolment.key", device / "enrolment.key")
        state = podman("volume", "inspect", coordinator.volumes["state"], "--format", "{{.Mountpoint}}").stdout.strip()
        shutil.copy(Path(state) / "state" / "admin.token", device / "admin.token")
        (device / "out").mkdir()
        for path in device.rglob("*"):
            path.chmod(0o777 if path.is_dir() else 0o644)
        device.chmod(0o755)
        names = [f"tally-coordinator.{EDGE_DOMAIN}"] + [f"tally-aggregator-{i}.aggregators.{EDGE_DOMAIN}"
                                                         for i in range(_most(objects))]
        pull(client_image)
        fleet = podman(
            "run", "--detach", "--name", f"{prefix}-outside", "--network", "host", *RUNTIME, "--pull", "never",
            "--read-only", "--user", "10001:10001", "--cap-drop", "all", "--tmpfs", "/tmp", "--env", "HOME=/tmp",
            *(a for name in names for a in ("--add-host", f"{name}:127.0.0.1")),
            "-v", f"{device}:/device:ro", "-v", f"{device / 'out'}:/out",
            client_image, "--coordinator", f"tally-coordinator.{EDGE_DOMAIN}:{port}", "--devices", str(OUTSIDE_DEVICES),
            "--synthetic", "--tls-dir", "/device/tls", "--enrolment-key", "/device/enrolment.key",
            "--audit-token-file", "/device/admin.token", "--json", "/out/fleet.json", "--no-progress",
            "--metrics-addr", "127.0.0.1", "--metrics-port", "0").stdout.strip()  # models cached in memory
        code = int(podman("wait", fleet, timeout=600).stdout.strip())
        logs = podman("logs", fleet, check=False)
        assert code == 0, logs.stdout[-3000:] + logs.stderr[-3000:] + coordinator.logs()
        report = json.loads((device / "out" / "fleet.json").read_text())
        assert report["audit"]["exact"] >= 2 and report["audit"]["mismatch"] == 0, report["audit"]
        listing = _job(coordinator, aggregators[0], "list")
        assert re.search(r"^outside-\w+\s+SUCCEEDED", listing.stdout, re.M), listing.stdout + listing.stderr
        served = _backend_stats(gateway)
        assert served["tally_edge_coordinator_7000"]["stot"] >= 1
        reached = [i for i in range(len(aggregators)) if served[f"tally_edge_aggregator_{i}_7001"]["stot"] >= 1]
        assert reached, served
        for i in reached:
            assert _metric(aggregators[i], "tally_aggregator_sessions_finished_total") >= 1

        # Refused at the gateway: a pod's in-cluster name (no route); a wrong name, named as TLS.
        ca = tmp_path / "certs" / "device"
        probe = subprocess.run([sys.executable, "-m", "tally.ops.probe", f"127.0.0.1:{port}", "--tls-dir", str(ca),
                                "--server-name", "tally-aggregator-0.tally-aggregator"],
                               capture_output=True, text=True, timeout=60)
        assert probe.returncode == 1, probe.stdout + probe.stderr
        wrong = subprocess.run([sys.executable, "-m", "tally.cli", "client", "--device-id", "d", "--shard", "0",
                                "--shards", "2", "--hidden", "8", "--connect-timeout", "2",
                                "--coordinator", f"127.0.0.1:{port}", "--server-name", "tally-coordinator.wrong.test",
                                "--tls-dir", str(ca), "--state-dir", str(tmp_path / "wrong")],
                               capture_output=True, text=True, timeout=120)
        assert wrong.returncode == 1
        assert "TLS: the connection was closed during the handshake: a gateway" in " ".join(wrong.stderr.split())

        # The measured figure: devices' own connections to one aggregator pod, held at once.
        target = f"tally-aggregator-0.aggregators.{EDGE_DOMAIN}"
        idle = _memory(aggregators[0])
        serving, took, held = _hold_connections(port, target, ca / "ca.pem", HELD_CONNECTIONS,
                                                lambda: _memory(aggregators[0]))
        peak = _backend_stats(gateway)["tally_edge_aggregator_0_7001"]["smax"]
        limit = quantity_bytes(aggregators[0].container["resources"]["limits"]["memory"])
        per_connection = (held - idle) / HELD_CONNECTIONS
        print(f"gateway: {serving} of {HELD_CONNECTIONS} connections to one aggregator pod answered in {took:.1f} s, "
              f"peak {peak} at once through the gateway; the pod's memory {idle / 2**20:.0f} -> "
              f"{held / 2**20:.0f} MiB, "
              f"{per_connection / 1024:.1f} KiB per connection ({(limit - idle) / per_connection:,.0f} in its "
              f"{limit / 2**30:.0f} GiB limit)")
        assert serving == HELD_CONNECTIONS and peak >= HELD_CONNECTIONS
        assert aggregators[0].probe("livenessProbe").returncode == 0, aggregators[0].logs()

        log = gateway.log()
        connections = [line for line in log if " sni=" in line]
        assert connections and all(LOG_LINE.match(line) for line in connections), [
            line for line in connections if not LOG_LINE.match(line)][:5]
        refused = [line for line in connections if "sni=tally-aggregator-0.tally-aggregator " in line]
        assert refused and all(line.endswith(" PR") for line in refused), refused
        secrets_seen = [(device / "admin.token").read_text().strip(), (device / "enrolment.key").read_bytes().hex()]
        assert not any(secret in line for secret in secrets_seen for line in log)
    finally:
        try:
            remove_everything(prefix)
        finally:
            if gateway is not None:
                gateway.stop()
            registry.stop()


def _most(objects: list[dict[str, Any]]) -> int:
    return one(objects, "HorizontalPodAutoscaler", "tally-aggregator")["spec"]["maxReplicas"]


# -- an algorithm package's job, in images that include it -----------------------------------------

PACKAGE = ROOT / "examples" / "algorithm-package"
# The package's example job, bounded: one cohort of digits devices training a small mlp, two rounds.
PACKAGE_ROUNDS = 2
PACKAGE_DEVICES = 8


def _package_job() -> str:
    job = yaml.safe_load((PACKAGE / "job.yaml").read_text())
    job.update(rounds=PACKAGE_ROUNDS, cohort_size=6, min_cohort=5, over_selection=1.0,
               model={**job["model"], "hidden": 8}, secure={"dropout_rate": 0.1, "corrupt_rate": 0.05},
               deadlines={"checkin": 60, "download": 60, "advertise_keys": 30, "share_keys": 30,
                          "masked_input": 60, "unmask": 30})
    return yaml.safe_dump(job)


def _with_packages(image: str, wheels: Path, tag: str) -> str:
    """``image`` with the wheels in ``wheels`` installed: one layer, as docs/adding-an-algorithm.md
    shows (docker/packages.Dockerfile)."""
    podman("build", "--quiet", "--format", "docker", *RUNTIME, "--pull=never", "--build-arg", f"IMAGE={image}",
           "-f", str(ROOT / "docker" / "packages.Dockerfile"), "-t", tag, str(wheels), timeout=600)
    return tag


def _owned_by_the_images_user(directory: Path) -> Path:
    for path in [directory, *directory.rglob("*")]:
        os.chown(path, 10001, 10001)
    return directory


def test_a_secure_job_of_an_algorithm_package_commits_in_images_that_include_it(
        images: dict[str, str], tmp_path: Path) -> None:
    """The example package's wheel added to the coordinator and client images (the aggregator sums
    whatever it is given and needs none); the coordinator's image lists it, and an aggregator, that
    coordinator and a fleet of digits devices, each a container of its image, run the package's
    job through the secure sum: every round commits, every committed sum exact."""
    prefix = f"tally-e2e-{secrets.token_hex(3)}"
    wheels = tmp_path / "wheels"
    source = shutil.copytree(PACKAGE, tmp_path / "package", ignore=shutil.ignore_patterns("build", "*.egg-info"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "--no-index",
                    "-w", str(wheels), str(source)], check=True, timeout=300)
    built: dict[str, str] = {}
    try:
        for role in ("coordinator", "client"):
            built[role] = _with_packages(images[role], wheels, f"localhost/tally-{role}:{VERSION}-{prefix}")
        listed = podman("run", "--rm", "--pull", "never", *RUNTIME, "--read-only", "--entrypoint", "python3",
                        built["coordinator"], "-m", "tally.cli", "algorithms", "list", "--json")
        rows = {row["name"]: row for row in json.loads(listed.stdout)["algorithms"]}
        assert rows["fedavgm"]["package"] == "tally-fedavgm", rows

        assert tally_main(["certs", "--out", str(tmp_path / "certs")]) == 0  # they name 127.0.0.1
        certs = _owned_by_the_images_user(tmp_path / "certs")
        for name in ("state", "jobs", "out"):
            (tmp_path / name).mkdir()
        (tmp_path / "jobs" / "fedavgm.yaml").write_text(_package_job())
        _owned_by_the_images_user(tmp_path)
        device, control, coordinator = free_port(), free_port(), free_port()
        container = ("run", "--detach", "--network", "host", *RUNTIME, "--pull", "never", "--read-only",
                     "--user", "10001:10001", "--cap-drop", "all", "--tmpfs", "/tmp", "--env", "HOME=/tmp")
        podman(*container, "--name", f"{prefix}-aggregator", "-v", f"{certs / 'aggregator-1'}:/etc/tally/tls:ro",
               images["aggregator"], "--listen", f"127.0.0.1:{device}", "--control-listen", f"127.0.0.1:{control}",
               "--id", "aggregator-1", "--tls-dir", "/etc/tally/tls", "--metrics-port", "0")
        podman(*container, "--name", f"{prefix}-coordinator", "-v", f"{certs / 'coordinator'}:/etc/tally/tls:ro",
               "-v", f"{tmp_path / 'state'}:/var/lib/tally", "-v", f"{tmp_path / 'jobs'}:/jobs:ro",
               built["coordinator"], "--listen", f"127.0.0.1:{coordinator}", "--state-dir", "/var/lib/tally",
               "--tls-dir", "/etc/tally/tls", "--aggregator", f"aggregator-1=127.0.0.1:{control}",
               "--jobs-dir", "/jobs", "--metrics-port", "0")

        def serving() -> bool:
            """The coordinator wrote its admin token (it checked the job first): the fleet reads it."""
            if (tmp_path / "state" / "admin.token").exists():
                return True
            state = podman("inspect", "--format", "{{.State.Status}}", f"{prefix}-coordinator").stdout.strip()
            assert state == "running", podman("logs", f"{prefix}-coordinator", check=False).stderr[-3000:]
            return False

        _until("the coordinator wrote its admin token", serving, deadline_s=120)
        fleet = podman(*container, "--name", f"{prefix}-fleet", "-v", f"{certs / 'device'}:/etc/tally/tls:ro",
                       "-v", f"{certs / 'coordinator' / 'enrolment.key'}:/device/enrolment.key:ro",
                       "-v", f"{tmp_path / 'state'}:/device/state:ro", "-v", f"{tmp_path / 'out'}:/out",
                       built["client"], "--coordinator", f"127.0.0.1:{coordinator}", "--devices",
                       str(PACKAGE_DEVICES), "--tls-dir", "/etc/tally/tls", "--enrolment-key", "/device/enrolment.key",
                       "--audit-token-file", "/device/state/admin.token", "--json", "/out/fleet.json",
                       "--no-progress", "--metrics-addr", "127.0.0.1", "--metrics-port", "0").stdout.strip()
        code = int(podman("wait", fleet, timeout=600).stdout.strip())
        logs = podman("logs", fleet, check=False)
        served = podman("logs", f"{prefix}-coordinator", check=False)
        assert code == 0, logs.stdout[-3000:] + logs.stderr[-3000:] + served.stderr[-3000:]
        report = json.loads((tmp_path / "out" / "fleet.json").read_text())
        assert report["audit"]["exact"] >= PACKAGE_ROUNDS and report["audit"]["mismatch"] == 0, report["audit"]
        listing = subprocess.run(
            [sys.executable, "-m", "tally.cli", "job", "list", "--coordinator", f"127.0.0.1:{coordinator}",
             "--state-dir", str(tmp_path / "state"), "--tls-dir", str(certs / "device")],
            capture_output=True, text=True, timeout=60)
        assert re.search(r"^fedavgm-digits-\w+\s+SUCCEEDED\s+fedavgm\b", listing.stdout, re.M), (
            listing.stdout + listing.stderr)
    finally:
        try:
            remove_everything(prefix)
        finally:
            if built:
                podman("rmi", "--force", *built.values(), check=False)


# -- the Kubernetes page, run ------------------------------------------------------------------

PAGE = ROOT / "docs" / "kubernetes.md"
# Commands of the page that need what this machine has not: a cluster's API server (and the
# gateway's DNS names, which only a cluster's gateway answers).
NEEDS_A_CLUSTER = ("tally k8s apply", "tally k8s fleet", "tally k8s status", "kubectl apply", "kubectl port-forward",
                   "kubectl -n", "helm install", "edge.example.org:443")
# The page's registry; the test runs its blocks against a real one on 127.0.0.1 instead.
PAGE_REGISTRY = "registry.example.org"


def _dangling_image_of_someone_else(directory: Path) -> str:
    """The id of an untagged image this project did not build (another user's leftover, say)."""
    (directory / "foreign").mkdir()
    (directory / "foreign" / "Containerfile").write_text(f"FROM {BASE_IMAGE}\nLABEL org.example.owner=someone-else\n")
    image = podman("build", "--quiet", "--pull=never", "-t", "localhost/not-tally:leftover",
                   str(directory / "foreign")).stdout.strip().splitlines()[-1]
    podman("untag", image)
    return image


def _copy_of_the_repository(target: Path) -> None:
    """The tracked files as they are in this working tree (a fresh clone of what is committed,
    plus what is not yet), modification times kept; the venv is shared, not rebuilt."""
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True)
    for name in filter(None, tracked.stdout.split("\0")):
        source = ROOT / name
        if source.is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / name)
    (target / ".venv").symlink_to(ROOT / ".venv")


@pytest.mark.timeout(2400)  # `make images` again, from the copy (cached layers; minutes on 2 cores)
def test_the_kubernetes_pages_commands_run_in_order_as_far_as_no_cluster_is_needed(
        images: dict[str, str], tmp_path: Path) -> None:
    page = PAGE.read_text()
    blocks = re.findall(r"^ *```bash\n(.*?)^ *```", page, re.M | re.S)
    clone = tmp_path / "tally"
    _copy_of_the_repository(clone)
    ran, skipped = [], []
    foreign = _dangling_image_of_someone_else(tmp_path)
    registry = Registry(tmp_path / "registry")
    try:
        for block in (textwrap.dedent(b) for b in blocks):
            if any(command in block for command in NEEDS_A_CLUSTER):
                skipped.append(block.strip())
                continue
            done = subprocess.run(["bash", "-euo", "pipefail", "-c", block.replace(PAGE_REGISTRY, registry.address)],
                                  cwd=clone, capture_output=True, text=True, timeout=2000,
                                  env={**os.environ, "CI": "true", "TLS_VERIFY": "false"})
            assert done.returncode == 0, f"{block}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
            ran.append((block, done.stdout))
        # `make images` pruned what its own builds left, and nothing of anyone else's.
        assert podman("image", "exists", foreign, check=False).returncode == 0, "make images pruned a foreign image"
        ours = podman("images", "--quiet", "--filter", "dangling=true", "--filter", f"label={BUILT_BY}").stdout.split()
        assert not ours, f"make images left dangling images of its own: {ours}"
    finally:
        registry.stop()
        podman("rmi", foreign, check=False)
    print("not run here (a cluster):\n" + "\n---\n".join(skipped))
    written = load_secrets(clone / "deploy" / "k8s")
    commands = " ".join(block for block, _ in ran)
    for step in ("tally certs", f"make images REGISTRY={PAGE_REGISTRY}/", "tally k8s render", "kubectl kustomize",
                 "k8s/kube-prometheus-stack", "tally enrol"):
        assert step in commands, f"the page no longer runs {step}"
    for step in ("kubectl apply --server-side -k k8s/overlays/edge", "helm install kube-prometheus-stack",
                 "tally client --coordinator tally-coordinator.edge.example.org:443", "tally job watch",
                 "port-forward svc/kube-prometheus-stack-grafana"):
        assert any(step in " ".join(block.split()) for block in skipped), f"the page no longer shows {step}"
    # The pushed images, pinned by digest: what the rendered overlays run.
    edge = [d for d in yaml.safe_load_all((clone / "deploy" / "edge.yaml").read_text()) if d]
    pinned = {c["image"] for o in find(edge, "StatefulSet") for c in o["spec"]["template"]["spec"]["containers"]}
    assert pinned and all(re.fullmatch(rf"{re.escape(registry.address)}/tally/tally-\w+@sha256:[0-9a-f]{{64}}", image)
                          for image in pinned), pinned
    # The certificates cover the names devices outside dial.
    coordinator_names = x509.load_pem_x509_certificate(written["tally-coordinator-tls"]["tls.crt"]).extensions \
        .get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)
    assert "tally-coordinator.edge.example.org" in coordinator_names
    # What the steps made is what the later steps and the manifests use.
    assert {"tally-coordinator-tls", "tally-aggregator-tls", "tally-device-ca", "tally-enrolment"} <= set(written)
    prod = [d for d in yaml.safe_load_all((clone / "deploy" / "prod.yaml").read_text()) if d]
    counts = dict(re.findall(r"\b(dev|prod|loadtest|edge)\s+(?:has\s+)?(\d+)", page[page.index("3. Render"):]))
    assert int(counts["prod"]) == len(prod)
    assert int(counts["dev"]) == int(next(out for block, out in ran if "kubectl kustomize" in block).split()[-1])
    assert int(counts["loadtest"]) == len(render(K8S / "overlays" / "loadtest"))
    assert int(counts["edge"]) == len(edge)
    for role in ROLES:
        assert podman("image", "exists", images[role], check=False).returncode == 0
