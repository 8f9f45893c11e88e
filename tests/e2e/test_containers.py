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

from support import tools
from support.containers import (
    CANNOT_HONOUR,
    RUNTIME,
    ContainerPod,
    can_run_containers,
    podman,
    remove_everything,
    service_hosts,
    start,
)
from support.deploy import ROOT
from support.manifests import K8S, LocalPod, ManifestCluster, find, image_entrypoint, load_secrets, one, render
from support.operator_scrape import scrape_configs, targets
from support.postgres import needs_postgres, postgres_server
from support.prometheus import LivePrometheus, needs_prometheus
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


# -- the Kubernetes page, run ------------------------------------------------------------------

PAGE = ROOT / "docs" / "kubernetes.md"
# Commands of the page that need what this machine has not: a cluster's API server, a registry.
NEEDS_A_CLUSTER = ("tally k8s apply", "tally k8s fleet", "tally k8s status", "kubectl apply", "kubectl port-forward",
                   "podman push", "docker push")


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
    try:
        for block in (textwrap.dedent(b) for b in blocks):
            if any(command in block for command in NEEDS_A_CLUSTER):
                skipped.append(block.strip())
                continue
            done = subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=clone, capture_output=True,
                                  text=True, timeout=2000, env={**os.environ, "CI": "true"})
            assert done.returncode == 0, f"{block}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
            ran.append((block, done.stdout))
        # `make images` pruned what its own builds left, and nothing of anyone else's.
        assert podman("image", "exists", foreign, check=False).returncode == 0, "make images pruned a foreign image"
        ours = podman("images", "--quiet", "--filter", "dangling=true", "--filter", f"label={BUILT_BY}").stdout.split()
        assert not ours, f"make images left dangling images of its own: {ours}"
    finally:
        podman("rmi", foreign, check=False)
    print("not run here (a cluster or a registry):\n" + "\n---\n".join(skipped))
    commands = " ".join(block for block, _ in ran)
    for step in ("tally certs", "make images", "tally k8s render", "kubectl kustomize"):
        assert step in commands, f"the page no longer runs {step}"
    # What the steps made is what the later steps and the manifests use.
    written = load_secrets(clone / "deploy" / "k8s")
    assert {"tally-coordinator-tls", "tally-aggregator-tls", "tally-device-ca", "tally-enrolment"} <= set(written)
    prod = [d for d in yaml.safe_load_all((clone / "deploy" / "prod.yaml").read_text()) if d]
    counts = dict(re.findall(r"\b(dev|prod|loadtest)\s+(?:has\s+)?(\d+)", page[page.index("3. Render"):]))
    assert int(counts["prod"]) == len(prod)
    assert int(counts["dev"]) == int(next(out for block, out in ran if "kubectl kustomize" in block).split()[-1])
    assert int(counts["loadtest"]) == len(render(K8S / "overlays" / "loadtest"))
    for role in ROLES:
        assert podman("image", "exists", images[role], check=False).returncode == 0
