"""Pods of rendered manifests run as podman containers, as a kubelet would run them.

``ContainerPod`` turns one pod template into ``podman run`` flags: the manifest's image (``start``
pulls it first when it names a registry), entrypoint and args (``$(VAR)`` expanded), env
(``fieldRef`` resolved), user and groups, read-only root filesystem, dropped capabilities, no
privilege escalation, CPU and memory limits, Secrets and ConfigMaps as read-only files with their
modes and fsGroup, emptyDirs as tmpfs of their size limit, the volume claim as a podman volume,
and the Services' DNS names as host entries on a network the test creates. Whatever a manifest
says that none of this honours is returned by ``unhonoured()`` with the reason, so a test lists it
instead of dropping it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from support.manifests import LocalPod, ManifestCluster, expand
from support.operator_scrape import RunningPod

PODMAN = ["podman", "--cgroup-manager=cgroupfs"]
# crun fails on this machine's hybrid cgroups; without explicit limits setrlimit is refused.
RUNTIME = ["--runtime", "/usr/sbin/runc", "--ulimit", "nofile=20000:20000", "--ulimit", "nproc=4096:4096"]

# What a manifest may say that these containers cannot honour, and why (a field not listed here
# and not honoured fails the test, so a new manifest feature is looked at, not dropped).
CANNOT_HONOUR = {
    "resources.requests": "scheduling: no scheduler places these containers",
    "affinity": "scheduling: one machine is every node and zone",
    "topologySpreadConstraints": "scheduling: one machine is every node and zone",
    "resources.limits.ephemeral-storage": "podman sets no writable-layer quota (the root is read-only anyway)",
    "serviceAccountName": "no API server; automountServiceAccountToken is false, so no token is mounted",
    "volumeClaimTemplates.resources.requests.storage": "a podman volume has no size",
    "job.backoffLimitPerIndex": "each index runs once and must succeed",
    "job.maxFailedIndexes": "each index runs once and must succeed",
    "job.activeDeadlineSeconds": "the test's own deadline bounds the run",
    "job.ttlSecondsAfterFinished": "the test removes every container it made",
    "NetworkPolicy": "the podman network enforces no policy",
    "restartPolicy": "a container that stops stays stopped; the test restarts it as a kubelet would",
}
# Pod and security-context fields run_args carries out (or, for restartPolicy, the test does).
POD_FIELDS = {"containers", "securityContext", "volumes", "serviceAccountName", "automountServiceAccountToken",
              "terminationGracePeriodSeconds", "restartPolicy", "affinity", "topologySpreadConstraints"}
SECURITY_FIELDS = {"runAsUser", "runAsGroup", "runAsNonRoot", "fsGroup", "readOnlyRootFilesystem", "capabilities",
                   "allowPrivilegeEscalation", "privileged", "seccompProfile"}

_QUANTITY = {"Ki": 1024, "Mi": 1024 ** 2, "Gi": 1024 ** 3}


def podman(*args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([*PODMAN, *args], capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(f"podman {' '.join(args)}: {result.stderr.strip()[-2000:]}")
    return result


def can_run_containers() -> str | None:
    """None when podman can run a container here, else why not."""
    if shutil.which("podman") is None or not shutil.which("runc"):
        return "podman and runc are not installed (`make images` installs them)"
    result = subprocess.run([*PODMAN, "info", "--format", "{{.Host.OCIRuntime.Name}}"], capture_output=True,
                            text=True, timeout=60)
    if result.returncode != 0:
        return f"podman cannot run here: {result.stderr.strip()[-300:]}"
    return None


def quantity_bytes(quantity: str) -> int:
    for suffix, factor in _QUANTITY.items():
        if quantity.endswith(suffix):
            return int(quantity[:-2]) * factor
    return int(quantity)


@dataclass
class ContainerPod:
    """One pod of a workload template as a podman container on ``network`` at ``ip``."""

    local: LocalPod
    workload: dict[str, Any]
    ip: str
    prefix: str  # of every container, volume and network this test run makes
    volumes: dict[str, str] = field(default_factory=dict)  # claim name -> podman volume

    @property
    def name(self) -> str:
        return self.local.name

    @property
    def container_name(self) -> str:
        return f"{self.prefix}-{self.name}"

    @property
    def container(self) -> dict[str, Any]:
        return self.local.container

    def running(self) -> RunningPod:
        labels = dict(self.workload["spec"]["template"]["metadata"]["labels"])
        if self.workload["kind"] == "StatefulSet":  # the label its controller gives each pod
            labels["statefulset.kubernetes.io/pod-name"] = self.name
        return RunningPod(self.name, labels, self.ip, self.container["name"], self.container.get("ports", []))

    def run_args(self, network: str, hosts: dict[str, str]) -> list[str]:
        """``podman run`` flags and the image and args; ``hosts``: DNS name -> IP."""
        spec, container = self.local.spec, self.container
        pod_security = spec.get("securityContext", {})
        security = {**pod_security, **container.get("securityContext", {})}
        args = ["run", "--detach", "--name", self.container_name, "--hostname", self.name, "--network", network,
                "--ip", self.ip, "--pull", "never", *RUNTIME,
                "--stop-timeout", str(spec.get("terminationGracePeriodSeconds", 30))]
        for host, ip in sorted(hosts.items()):
            args += ["--add-host", f"{host}:{ip}"]
        if "runAsUser" in security:
            args += ["--user", f"{security['runAsUser']}:{security.get('runAsGroup', security['runAsUser'])}"]
        if "fsGroup" in pod_security:
            args += ["--group-add", str(pod_security["fsGroup"])]
        if security.get("readOnlyRootFilesystem"):
            args += ["--read-only", "--read-only-tmpfs=false"]
        for capability in security.get("capabilities", {}).get("drop", []):
            args += ["--cap-drop", capability.lower()]
        if security.get("allowPrivilegeEscalation") is False:
            args += ["--security-opt", "no-new-privileges"]
        limits = container.get("resources", {}).get("limits", {})
        if "cpu" in limits:
            cpu = limits["cpu"]
            args += ["--cpus", str(int(cpu[:-1]) / 1000 if cpu.endswith("m") else float(cpu))]
        if "memory" in limits:  # no swap beyond the limit: a kubelet's pod would be OOM-killed
            memory = str(quantity_bytes(limits["memory"]))
            args += ["--memory", memory, "--memory-swap", memory]
        for name, value in self.local.env.items():
            args += ["--env", f"{name}={value}"]
        args += self._mounts()
        argv = [expand(a, self.local.env) for a in container.get("args", [])]
        if "command" in container:
            args += ["--entrypoint", json.dumps([expand(a, self.local.env) for a in container["command"]])]
        return [*args, container["image"], *argv]

    def _mounts(self) -> list[str]:
        volumes = {v["name"]: v for v in self.local.spec.get("volumes", [])}
        flags = []
        for mount in self.container.get("volumeMounts", []):
            target, volume = mount["mountPath"], volumes.get(mount["name"])
            if volume is None:  # the StatefulSet's volume claim
                name = self.volumes.setdefault(mount["name"], f"{self.prefix}-{self.name}-{mount['name']}")
                flags += ["--mount", f"type=volume,source={name},destination={target}"]
            elif "emptyDir" in volume:
                size = volume["emptyDir"].get("sizeLimit")
                flags += ["--mount", f"type=tmpfs,destination={target},tmpfs-mode=1777"
                          + (f",tmpfs-size={quantity_bytes(size)}" if size else "")]
            else:
                readonly = ",ro=true" if mount.get("readOnly") else ""
                flags += ["--mount", f"type=bind,source={self.local.mounts[target]},destination={target}{readonly}"]
        return flags

    def create_volumes(self) -> None:
        """The claims' volumes, owned by the fsGroup as a kubelet's fsGroup change would leave them."""
        group = self.local.spec.get("securityContext", {}).get("fsGroup")
        for mount in self.container.get("volumeMounts", []):
            if mount["name"] in self.volumes:
                volume = self.volumes[mount["name"]]
                podman("volume", "create", volume)
                path = podman("volume", "inspect", volume, "--format", "{{.Mountpoint}}").stdout.strip()
                if group is not None:
                    shutil.chown(path, group=group)
                    os.chmod(path, 0o2775)

    def unhonoured(self) -> dict[str, str]:
        """The fields of this pod's manifest that ``run_args`` does not carry out, with why."""
        found = {}
        container, spec = self.container, self.local.spec
        if container.get("resources", {}).get("requests"):
            found["resources.requests"] = CANNOT_HONOUR["resources.requests"]
        if "ephemeral-storage" in container.get("resources", {}).get("limits", {}):
            found["resources.limits.ephemeral-storage"] = CANNOT_HONOUR["resources.limits.ephemeral-storage"]
        for key in ("serviceAccountName", "affinity", "topologySpreadConstraints"):
            if key in spec:
                found[key] = CANNOT_HONOUR[key]
        for template in self.workload["spec"].get("volumeClaimTemplates", []):
            if template["spec"].get("resources", {}).get("requests", {}).get("storage"):
                key = "volumeClaimTemplates.resources.requests.storage"
                found[key] = CANNOT_HONOUR[key]
        if self.workload["kind"] == "Job":
            for key in ("backoffLimitPerIndex", "maxFailedIndexes", "activeDeadlineSeconds", "ttlSecondsAfterFinished"):
                if key in self.workload["spec"]:
                    found[f"job.{key}"] = CANNOT_HONOUR[f"job.{key}"]
        known = {"name", "image", "imagePullPolicy", "command", "args", "env", "ports", "resources",
                 "securityContext", "volumeMounts", "startupProbe", "readinessProbe", "livenessProbe"}
        unknown = set(container) - known
        unknown |= {f"spec.{k}" for k in set(spec) - POD_FIELDS}
        security = {**spec.get("securityContext", {}), **container.get("securityContext", {})}
        unknown |= {f"securityContext.{k}" for k in set(security) - SECURITY_FIELDS}
        assert not unknown, f"{self.name}: fields this test does not run: {sorted(unknown)}"
        # runAsNonRoot holds (a numeric non-zero user), privileged is off, seccomp is podman's
        # default profile, and no token is mounted: nothing to add to the flags for them.
        assert security.get("runAsUser", 0) != 0 or not security.get("runAsNonRoot")
        assert not security.get("privileged")
        assert security.get("seccompProfile", {}).get("type", "RuntimeDefault") == "RuntimeDefault"
        assert spec.get("automountServiceAccountToken") is False or "serviceAccountName" not in spec
        if "restartPolicy" in spec or self.workload["kind"] != "Job":  # a StatefulSet's pods: Always
            found["restartPolicy"] = CANNOT_HONOUR["restartPolicy"]
        assert container.get("imagePullPolicy", "IfNotPresent") in ("IfNotPresent", "Never"), \
            "the images are local: a pull policy that pulls cannot be honoured"
        return found

    # -- what a kubelet does after start ---------------------------------------------------------

    def probe(self, kind: str) -> subprocess.CompletedProcess[str]:
        """One run of the probe; slower than its timeoutSeconds (plus two seconds for the exec
        itself) counts as a failure, as the kubelet counts it."""
        command = [expand(a, self.local.env) for a in self.container[kind]["exec"]["command"]]
        limit = self.container[kind].get("timeoutSeconds", 1) + 2
        started = time.monotonic()
        try:
            result = podman("exec", self.container_name, *command, check=False, timeout=limit)
        except subprocess.TimeoutExpired:
            return subprocess.CompletedProcess(command, 1, "", f"{kind} took over {limit} s")
        if result.returncode == 0 and time.monotonic() - started > limit:
            return subprocess.CompletedProcess(command, 1, "", f"{kind} took over {limit} s")
        return result

    def until_started(self) -> None:
        """Run the startup probe every periodSeconds until it passes, at most failureThreshold
        times; then the readiness and liveness probes must pass."""
        probe = self.container["startupProbe"]
        last = None
        for _ in range(probe.get("failureThreshold", 3)):
            last = self.probe("startupProbe")
            if last.returncode == 0:
                break
            if self.state() != "running":
                break
            time.sleep(probe.get("periodSeconds", 10))  # the probe's own period, as the kubelet
        assert last is not None and last.returncode == 0, (
            f"{self.name}: startup probe failed: {last.stderr.strip() if last else ''}\n{self.logs()}")
        for kind in ("readinessProbe", "livenessProbe"):
            result = self.probe(kind)
            assert result.returncode == 0, f"{self.name}: {kind} failed: {result.stderr}\n{self.logs()}"

    def state(self) -> str:
        return podman("inspect", self.container_name, "--format", "{{.State.Status}}").stdout.strip()

    def exit_code(self, timeout: float) -> int:
        return int(podman("wait", self.container_name, timeout=timeout).stdout.strip())

    def logs(self, lines: int = 40) -> str:
        result = podman("logs", "--tail", str(lines), self.container_name, check=False)
        return result.stdout + result.stderr


def service_hosts(cluster: ManifestCluster, pods: Sequence[ContainerPod]) -> dict[str, str]:
    """The DNS names cluster DNS would answer, as host entries: each Service (short and qualified)
    for the first pod it selects, and each pod of a headless Service as ``pod.service[...]``."""
    hosts = {}
    for service in (o for o in cluster.objects if o["kind"] == "Service"):
        name, selector = service["metadata"]["name"], service["spec"].get("selector", {})
        chosen = [p for p in pods if selector and selector.items() <= p.running().labels.items()]
        qualified = ("", f".{cluster.namespace}", f".{cluster.namespace}.svc",
                     f".{cluster.namespace}.svc.cluster.local")
        for suffix in qualified:
            if chosen:
                hosts[name + suffix] = chosen[0].ip
            if service["spec"].get("clusterIP") == "None":
                for pod in chosen:
                    hosts[f"{pod.name}.{name}{suffix}"] = pod.ip
    return hosts


def remove_everything(prefix: str) -> None:
    """Every container, volume and network whose name starts with ``prefix``, even after a failure."""
    for kind, remove in (("ps --all", ["rm", "--force", "--time", "5"]), ("volume ls", ["volume", "rm", "--force"]),
                         ("network ls", ["network", "rm", "--force"])):
        names = podman(*kind.split(), "--format", "{{.Name}}" if kind != "ps --all" else "{{.Names}}",
                       check=False).stdout.split()
        ours = [n for n in names if n.startswith(prefix)]
        if ours:
            podman(*remove, *ours, check=False, timeout=180)


def pull(image: str) -> None:
    """What a kubelet does first with an image it does not have: pull it from its registry (one on
    loopback speaks plain HTTP)."""
    plain = image.split("/", 1)[0].rsplit(":", 1)[0] in ("127.0.0.1", "localhost")
    podman("pull", "--quiet", f"--tls-verify={str(not plain).lower()}", image, timeout=900)


def start(pod: ContainerPod, network: str, hosts: dict[str, str]) -> None:
    if not pod.container["image"].startswith("localhost/"):  # from a registry: pulled, as a kubelet would
        pull(pod.container["image"])
    args = pod.run_args(network, hosts)  # names the claims' volumes
    pod.create_volumes()
    podman(*args, timeout=180)
