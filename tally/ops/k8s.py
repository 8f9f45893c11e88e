"""What ``tally k8s`` sends to a cluster, and the calls that send it.

The request bodies are built by plain functions (``apply_order``, ``fleet_job``) so tests can
schema-validate exactly what would be sent without an API server; ``Cluster`` is the thin part that
talks to one through the official ``kubernetes`` client (server-side apply, so repeated applies
and other field managers' changes merge instead of fighting).
"""

from __future__ import annotations

import copy
import shutil
import subprocess
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

FIELD_MANAGER = "tally"
FLEET_JOB = "tally-fleet"
COORDINATOR_POD = "tally-coordinator-0"
ADMIN_TOKEN_PATH = "/var/lib/tally/state/admin.token"
WORKLOADS = ("tally-coordinator", "tally-aggregator")
# Applied first: what later objects live in or refer to.
_FIRST = ("Namespace", "ServiceAccount", "Secret", "ConfigMap", "Role", "RoleBinding")
# API groups under k8s.io that are custom resources all the same (installed with their controller).
_CUSTOM_K8S_IO = ("gateway.networking.k8s.io",)


class K8sError(RuntimeError):
    """A problem an operator can act on (no cluster, kustomize failed, a bad value)."""


def render(overlay: Path, kubectl: str | None = None) -> list[dict[str, Any]]:
    """``kubectl kustomize overlay``: the objects of an overlay, in kustomize's order."""
    program = kubectl or shutil.which("kubectl")
    if program is None:
        raise K8sError("kubectl is needed to render kustomize overlays and was not found on PATH")
    result = subprocess.run([program, "kustomize", str(overlay)], capture_output=True, text=True)
    if result.returncode != 0:
        raise K8sError(f"kubectl kustomize {overlay}: {result.stderr.strip()}")
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def load_manifests(directory: Path) -> list[dict[str, Any]]:
    """Every object in ``directory/*.yaml`` (e.g. what ``tally certs --k8s-secrets`` wrote)."""
    if not directory.is_dir():
        raise K8sError(f"--secrets {directory}: no such directory")
    objects = []
    for path in sorted(directory.glob("*.yaml")):
        objects += [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    if not objects:
        raise K8sError(f"--secrets {directory}: no manifests (*.yaml) in it")
    return objects


def apply_order(objects: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Namespaces, identities, Secrets and ConfigMaps first, custom resources (cert-manager,
    Prometheus operator, Gateway API) last, everything else in between, each group in its given
    order."""

    def rank(obj: dict[str, Any]) -> int:
        if obj["kind"] in _FIRST:
            return _FIRST.index(obj["kind"])
        group = obj["apiVersion"].rpartition("/")[0]
        custom = "." in group and (not group.endswith(".k8s.io") or group in _CUSTOM_K8S_IO)
        return len(_FIRST) + custom

    return sorted(objects, key=rank)


def fleet_job(template: dict[str, Any], *, devices: int, shards: int, parallelism: int | None = None,
              dropout: float | None = None) -> dict[str, Any]:
    """The overlay's fleet Job for ``devices`` simulated devices in ``shards`` indexed pods, at
    most ``parallelism`` at a time (default: all). Values out of range raise ``ValueError``
    naming the option."""
    if shards < 1:
        raise ValueError(f"--shards must be at least 1, got {shards}")
    if devices < shards:
        raise ValueError(f"--devices ({devices}) must be at least --shards ({shards})")
    if parallelism is not None and not 1 <= parallelism:
        raise ValueError(f"--parallelism must be at least 1, got {parallelism}")
    if dropout is not None and not 0.0 <= dropout < 1.0:
        raise ValueError(f"--dropout must be in [0, 1), got {dropout}")
    job = copy.deepcopy(template)
    job["metadata"] = {k: v for k, v in job["metadata"].items()
                       if k in ("name", "namespace", "labels", "annotations")}
    job.pop("status", None)
    job["spec"]["completions"] = shards
    job["spec"]["parallelism"] = min(parallelism or shards, shards)
    job["spec"]["maxFailedIndexes"] = min(job["spec"].get("maxFailedIndexes", 0), shards)
    (container,) = job["spec"]["template"]["spec"]["containers"]
    values = {"FLEET_DEVICES": str(devices), "FLEET_SHARDS": str(shards)}
    if dropout is not None:
        values["FLEET_DROPOUT"] = repr(float(dropout))
    for var in container["env"]:
        if var["name"] in values:
            var["value"] = values.pop(var["name"])
    if values:
        raise K8sError(f"the overlay's fleet Job has no env {sorted(values)}: is it Tally's?")
    return job


def find_object(objects: Iterable[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    for obj in objects:
        if obj["kind"] == kind and obj["metadata"]["name"] == name:
            return obj
    raise K8sError(f"no {kind} {name} in the rendered overlay")


@dataclass
class PodState:
    name: str
    phase: str
    ready: bool
    restarts: int


@dataclass
class ClusterStatus:
    pods: list[PodState] = field(default_factory=list)
    ready: dict[str, tuple[int, int]] = field(default_factory=dict)  # StatefulSet -> (ready, wanted)
    fleet: dict[str, int] | None = None  # active, succeeded, failed, completions


class Cluster:
    """A Kubernetes API server reached through a kubeconfig (or the pod's service account)."""

    def __init__(self, kubeconfig: Path | None = None, context: str | None = None) -> None:
        from kubernetes import client, config, dynamic
        from kubernetes.config.config_exception import ConfigException

        try:
            if kubeconfig is None and context is None and _in_cluster():
                config.load_incluster_config()
            else:
                config.load_kube_config(config_file=str(kubeconfig) if kubeconfig else None, context=context)
        except (ConfigException, OSError, TypeError) as exc:
            raise K8sError(f"no Kubernetes API configured (kubeconfig, context): {exc}") from None
        self.api_client = client.ApiClient()
        self.core = client.CoreV1Api(self.api_client)
        self.apps = client.AppsV1Api(self.api_client)
        self.batch = client.BatchV1Api(self.api_client)
        self._dynamic_client: Any = None
        self._dynamic = dynamic

    @property
    def dynamic(self) -> Any:
        if self._dynamic_client is None:
            self._dynamic_client = self._dynamic.DynamicClient(self.api_client)
        return self._dynamic_client

    def apply(self, objects: Iterable[dict[str, Any]], *, dry_run: bool = False) -> list[str]:
        """Server-side apply of each object, in ``apply_order``; one line per object."""
        done = []
        for obj in apply_order(objects):
            resource = self.dynamic.resources.get(api_version=obj["apiVersion"], kind=obj["kind"])
            kwargs = {"dry_run": "All"} if dry_run else {}
            self.dynamic.server_side_apply(
                resource, body=obj, namespace=obj["metadata"].get("namespace"),
                field_manager=FIELD_MANAGER, force_conflicts=True, **kwargs,
            )
            done.append(f"{obj['kind']}/{obj['metadata']['name']} applied{' (dry run)' if dry_run else ''}")
        return done

    def launch_fleet(self, job: dict[str, Any], *, timeout_s: float = 120.0) -> str:
        """Create the fleet Job, or scale a running one when only its parallelism changed (a Job's
        completions and pod template are immutable: another fleet replaces the old Job)."""
        from kubernetes.client.exceptions import ApiException

        namespace, name = job["metadata"]["namespace"], job["metadata"]["name"]
        try:
            current = self.batch.read_namespaced_job(name, namespace)
        except ApiException as exc:
            if exc.status != 404:
                raise
            current = None
        if current is not None:
            same = (current.spec.completions == job["spec"]["completions"]
                    and _env(current.spec.template.spec.containers[0]) == _env_dict(job))
            if same and not (current.status.succeeded or 0) + (current.status.failed or 0):
                self.batch.patch_namespaced_job(name, namespace, {"spec": {"parallelism": job["spec"]["parallelism"]}})
                return f"job/{name} scaled to parallelism {job['spec']['parallelism']}"
            self.batch.delete_namespaced_job(name, namespace, propagation_policy="Foreground")
            deadline = time.monotonic() + timeout_s
            while True:
                try:
                    self.batch.read_namespaced_job(name, namespace)
                except ApiException as exc:
                    if exc.status == 404:
                        break
                    raise
                if time.monotonic() > deadline:
                    raise K8sError(f"job/{name} still being deleted after {timeout_s:.0f} s")
                time.sleep(1.0)  # polling the API server for the deletion, with a deadline
        self.batch.create_namespaced_job(namespace, job)
        return f"job/{name} created: {job['spec']['completions']} shards, parallelism {job['spec']['parallelism']}"

    def status(self, namespace: str) -> ClusterStatus:
        from kubernetes.client.exceptions import ApiException

        out = ClusterStatus()
        pods = self.core.list_namespaced_pod(namespace, label_selector="app.kubernetes.io/name=tally")
        for pod in pods.items:
            statuses = pod.status.container_statuses or []
            out.pods.append(PodState(pod.metadata.name, pod.status.phase or "Unknown",
                                     bool(statuses) and all(s.ready for s in statuses),
                                     sum(s.restart_count for s in statuses)))
        for name in WORKLOADS:
            try:
                sts = self.apps.read_namespaced_stateful_set(name, namespace)
            except ApiException as exc:
                if exc.status == 404:
                    continue
                raise
            out.ready[name] = (sts.status.ready_replicas or 0, sts.spec.replicas or 0)
        try:
            job = self.batch.read_namespaced_job(FLEET_JOB, namespace)
            out.fleet = {"active": job.status.active or 0, "succeeded": job.status.succeeded or 0,
                         "failed": job.status.failed or 0, "completions": job.spec.completions or 0}
        except ApiException as exc:
            if exc.status != 404:
                raise
        return out

    def admin_token(self, namespace: str) -> str:
        """The coordinator's admin token, read inside its pod (needs pods/exec)."""
        from kubernetes.stream import stream

        text = stream(self.core.connect_get_namespaced_pod_exec, COORDINATOR_POD, namespace,
                      command=["cat", ADMIN_TOKEN_PATH], stderr=True, stdin=False, stdout=True, tty=False)
        return text.strip()


def _in_cluster() -> bool:
    return Path("/var/run/secrets/kubernetes.io/serviceaccount/token").exists()


def _env(container: Any) -> dict[str, str]:
    return {e.name: e.value for e in container.env or [] if e.value is not None}


def _env_dict(job: dict[str, Any]) -> dict[str, str]:
    (container,) = job["spec"]["template"]["spec"]["containers"]
    return {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}
