"""Rendered Kubernetes manifests, and pods from them started as local processes.

``LocalPod`` does what a kubelet would with a pod template, on 127.0.0.1: it writes every mounted
Secret, ConfigMap, emptyDir and volume claim into a directory, resolves the container's env
(``fieldRef`` included) and expands ``$(VAR)`` in command and args as Kubernetes does, then remaps
what only differs between a cluster and one machine: mount paths to those directories, container
ports to free local ports, and Service or pod DNS names to ``localhost`` (which every server
certificate covers). Everything else (the command, flags, file names, env names) runs as written,
so a manifest that drifted from the code fails here.
"""

from __future__ import annotations

import base64
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from support import tools
from support.deploy import ROOT, free_port

K8S = ROOT / "k8s"
OVERLAYS = ("dev", "prod", "loadtest", "replicas", "edge")
FLEET_OVERLAYS = ("dev", "loadtest")  # those with the simulated fleet (components/loadtest)
kubernetes_validate = tools.require_module("kubernetes_validate.utils", "the test extra installs it")


def versions() -> list[str]:
    """Kubernetes 1.29 through the newest version kubernetes-validate bundles."""
    found = {v for v in kubernetes_validate.all_versions() if tuple(map(int, v.split(".")[:2])) >= (1, 29)}
    return sorted(found, key=lambda v: tuple(map(int, v.split("."))))


def kubectl() -> str:
    return tools.require("kubectl", "it renders the kustomize overlays")


def render(path: Path) -> list[dict[str, Any]]:
    """``kubectl kustomize path`` as a list of objects (fails the test with kustomize's message)."""
    result = subprocess.run([kubectl(), "kustomize", str(path)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"kubectl kustomize {path}:\n{result.stderr}"
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def find(objects: list[dict[str, Any]], kind: str, name: str | None = None) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]


def one(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = find(objects, kind, name)
    assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
    return found[0]


def env_value(container: dict[str, Any], name: str) -> str:
    values = [e["value"] for e in container.get("env", []) if e["name"] == name and "value" in e]
    assert values, f"{container['name']} has no env {name}"
    return values[-1]


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion: defined names are replaced, ``$$`` escapes, others stay."""
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                  lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), text)


@dataclass
class ManifestCluster:
    """What the local pods share: the namespace, Secrets, ConfigMaps, Services and every pod's
    local port for each container port."""

    objects: list[dict[str, Any]]
    secrets: dict[str, dict[str, bytes]]
    root: Path
    namespace: str = "tally"
    ports: dict[tuple[str, int], int] = field(default_factory=dict)  # (pod, containerPort) -> local

    def config_maps(self) -> dict[str, dict[str, bytes]]:
        return {o["metadata"]["name"]: {k: v.encode() for k, v in o.get("data", {}).items()}
                for o in find(self.objects, "ConfigMap")}

    def local_port(self, pod: str, port: int) -> int:
        return self.ports.setdefault((pod, port), free_port())

    def is_service_host(self, host: str) -> bool:
        """``host`` names a Service, or a pod behind a headless one (``pod.svc[.ns[.svc...]]``)."""
        labels = host.split(".")
        services = {o["metadata"]["name"] for o in find(self.objects, "Service")}
        return labels[0] in services or (len(labels) > 1 and labels[1] in services)

    def resolve(self, host: str, port: int) -> int:
        """The local port behind ``host:port``: a Service name (``svc[.ns[.svc...]]``) or a
        StatefulSet pod behind a headless Service (``pod.svc.ns.svc``)."""
        labels = host.split(".")
        services = {o["metadata"]["name"]: o for o in find(self.objects, "Service")}
        if labels[0] in services:
            service, pod_name = services[labels[0]], None
        else:
            service, pod_name = services[labels[1]], labels[0]
        target = next(p for p in service["spec"]["ports"] if p["port"] == port)["targetPort"]
        for (pod, container_port), local in self.ports.items():
            if (pod_name is None or pod == pod_name) and self._serves(pod, service, target, container_port):
                return local
        raise AssertionError(f"nothing behind {host}:{port} is running")

    def _serves(self, pod: str, service: dict[str, Any], target: int | str, container_port: int) -> bool:
        for kind in ("StatefulSet", "Deployment"):
            for workload in find(self.objects, kind):
                template = workload["spec"]["template"]
                selector = service["spec"].get("selector", {})
                if (not pod.startswith(workload["metadata"]["name"])
                        or not selector.items() <= template["metadata"]["labels"].items()):
                    continue
                for container in template["spec"]["containers"]:
                    for p in container.get("ports", []):
                        if p["containerPort"] == container_port and target in (p["containerPort"], p.get("name")):
                            return True
        return False


class LocalPod:
    """One pod of a workload's template, its first container ready to run locally."""

    def __init__(self, cluster: ManifestCluster, workload: dict[str, Any], pod_name: str,
                 annotations: dict[str, str] | None = None, ip: str | None = None) -> None:
        self.cluster, self.name, self.ip = cluster, pod_name, ip
        self.spec = workload["spec"]["template"]["spec"]
        (self.container,) = self.spec["containers"]
        self.annotations = annotations or {}
        self.dir = cluster.root / pod_name
        self.mounts = self._materialise(workload)
        self.env = self._env()

    # -- volumes ---------------------------------------------------------------------------------

    def _materialise(self, workload: dict[str, Any]) -> dict[str, Path]:
        """mountPath -> local directory, with the volume's files written in it as a kubelet
        would: each file with its item's mode or the volume's defaultMode, group-owned by the
        pod's fsGroup (where this process may chown)."""
        claims = {t["metadata"]["name"] for t in workload["spec"].get("volumeClaimTemplates", [])}
        volumes = {v["name"]: v for v in self.spec.get("volumes", [])}
        fs_group = self.spec.get("securityContext", {}).get("fsGroup")
        config_maps = self.cluster.config_maps()
        mounts = {}
        for mount in self.container.get("volumeMounts", []):
            local = self.dir / mount["name"]
            local.mkdir(parents=True, exist_ok=True)
            volume = volumes.get(mount["name"])
            assert volume is not None or mount["name"] in claims, f"{self.name}: no volume {mount['name']}"
            if volume is not None:
                projected = volume.get("projected")
                sources = projected["sources"] if projected else [volume]
                mode = (projected or volume.get("secret") or volume.get("configMap") or {}).get("defaultMode", 0o644)
                for source in sources:
                    if "secret" in source:
                        name = source["secret"].get("secretName") or source["secret"]["name"]
                        data, items = self.cluster.secrets[name], source["secret"].get("items")
                    elif "configMap" in source:
                        data, items = config_maps[source["configMap"]["name"]], source["configMap"].get("items")
                    else:
                        continue
                    self._write(local, data, items, mode, fs_group)
            mounts[mount["mountPath"]] = local
        return mounts

    @staticmethod
    def _write(directory: Path, data: dict[str, bytes], items: list[dict[str, Any]] | None, mode: int,
               fs_group: int | None) -> None:
        for item in items or [{"key": k, "path": k} for k in data]:
            assert item["key"] in data, f"key {item['key']} missing from a mounted Secret/ConfigMap"
            path = directory / item["path"]
            path.write_bytes(data[item["key"]])
            path.chmod(item.get("mode", mode))
            if fs_group is not None and os.geteuid() == 0:
                os.chown(path, -1, fs_group)

    # -- env and arguments -----------------------------------------------------------------------

    def _env(self) -> dict[str, str]:
        fields = {"metadata.name": self.name, "metadata.namespace": self.cluster.namespace}
        fields |= {f"metadata.annotations['{k}']": v for k, v in self.annotations.items()}
        if self.ip is not None:
            fields["status.podIP"] = self.ip
        env: dict[str, str] = {}
        for var in self.container.get("env", []):
            if "value" in var:
                env[var["name"]] = expand(var["value"], env)
            else:
                path = var["valueFrom"]["fieldRef"]["fieldPath"]
                assert path in fields, f"{self.name}: env {var['name']} from {path}, unknown here"
                env[var["name"]] = fields[path]
        return env

    def _local(self, arg: str) -> str:
        arg = expand(arg, self.env)
        # One pass, longest mount path first, only where a path starts (a local directory may
        # itself lie under a mount path such as /tmp).
        paths = "|".join(re.escape(p) for p in sorted(self.mounts, key=len, reverse=True))
        arg = re.sub(rf"(?:(?<=^)|(?<==))({paths})(?=/|$)", lambda m: str(self.mounts[m.group(1)]), arg)
        own = {p["containerPort"] for p in self.container.get("ports", [])}

        def address(m: re.Match[str]) -> str:
            host, port = m.group(1), int(m.group(2))
            if host in ("0.0.0.0", "127.0.0.1"):
                return f"127.0.0.1:{self.cluster.local_port(self.name, port)}"
            if not self.cluster.is_service_host(host):
                return m.group(0)
            return f"localhost:{self.cluster.resolve(host.replace('{i}', '0'), port)}"

        arg = re.sub(r"([A-Za-z0-9{}][A-Za-z0-9{}.-]*):(\d+)", address, arg)
        arg = re.sub(r"^(--metrics-port=)(\d+)$",
                     lambda m: m.group(1) + str(self.cluster.local_port(self.name, int(m.group(2))))
                     if int(m.group(2)) in own else m.group(0), arg)
        return arg.replace("--metrics-addr=0.0.0.0", "--metrics-addr=127.0.0.1")

    def argv(self, command: list[str]) -> list[str]:
        """A container or probe command, run from this venv's console scripts."""
        program = Path(sys.executable).parent / command[0]
        assert program.exists(), f"{command[0]} is no console script of this project"
        return [str(program), *(self._local(a) for a in command[1:])]

    def command(self) -> list[str]:
        """The image's entrypoint program (without its PID-1 init) and the manifest's args."""
        entry = self.container.get("command") or image_entrypoint(self.container["image"])[-1:]
        return self.argv([*entry, *self.container.get("args", [])])

    def process_env(self, base: dict[str, str]) -> dict[str, str]:
        env = {**base, **self.env}
        env["HOME"] = str(self.dir)  # the manifests point HOME at a writable emptyDir
        return env

    def probes(self) -> dict[str, list[str]]:
        return {kind: self.argv(self.container[kind]["exec"]["command"])
                for kind in ("startupProbe", "readinessProbe", "livenessProbe") if kind in self.container}


def image_entrypoint(image: str) -> list[str]:
    """The ENTRYPOINT of the recipe in docker/ that builds ``image`` (``.../tally-ROLE:TAG``)."""
    role = image.rsplit("/", 1)[-1].split(":")[0].removeprefix("tally-")
    recipe = (ROOT / "docker" / f"{role}.Dockerfile").read_text()
    return json.loads(re.search(r"^ENTRYPOINT (\[.*\])$", recipe, re.M).group(1))


def load_secrets(directory: Path) -> dict[str, dict[str, bytes]]:
    """Secret name -> key -> bytes, from the files ``tally certs --k8s-secrets`` wrote."""
    out = {}
    for path in sorted(directory.glob("*.yaml")):
        for secret in yaml.safe_load_all(path.read_text()):
            out[secret["metadata"]["name"]] = {k: base64.b64decode(v) for k, v in secret["data"].items()}
    return out
