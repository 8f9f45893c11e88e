"""What the Prometheus operator makes of a ServiceMonitor or PodMonitor, for a Prometheus outside
a cluster.

The operator turns each monitor endpoint into a scrape job over Kubernetes service discovery,
whose relabelling keeps the targets the monitor's selector and port pick and names them (job,
namespace, service, pod, container, endpoint) before the monitor's own relabelings run. Here the
same relabelling runs over ``file_sd`` targets that carry the ``__meta_kubernetes_*`` labels
Kubernetes discovery would give each running pod, so the selectors, port names and relabelings
written in ``k8s/monitoring`` decide what is scraped and how it is labelled, as in a cluster.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any


def _sanitise(name: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", name)


@dataclass(frozen=True)
class RunningPod:
    """A pod as discovery sees it: name, labels, IP, and its one container's name and ports."""

    name: str
    labels: dict[str, str]
    ip: str
    container: str
    ports: list[dict[str, Any]]  # the container's ports, as in the manifest

    def port(self, target: int | str) -> int | None:
        for port in self.ports:
            if target in (port["containerPort"], port.get("name")):
                return port["containerPort"]
        return None


def _selector_keeps(prefix: str, selector: dict[str, Any]) -> list[dict[str, Any]]:
    rules = []
    for key, value in sorted(selector.get("matchLabels", {}).items()):
        name = _sanitise(key)
        rules.append({"action": "keep", "source_labels": [f"__meta_kubernetes_{prefix}_label_{name}",
                                                          f"__meta_kubernetes_{prefix}_labelpresent_{name}"],
                      "regex": f"({value});true"})
    unsupported = set(selector) - {"matchLabels"}
    assert not unsupported, f"selector fields not translated here: {sorted(unsupported)}"
    return rules


def _common(kind: str) -> list[dict[str, Any]]:
    rules = [{"source_labels": ["job"], "target_label": "__tmp_prometheus_job_name"}]
    if kind == "ServiceMonitor":
        rules += [{"source_labels": ["__meta_kubernetes_endpoint_address_target_kind",
                                     "__meta_kubernetes_endpoint_address_target_name"],
                   "separator": ";", "regex": f"{kind_};(.*)", "replacement": "${1}", "target_label": label}
                  for kind_, label in (("Node", "node"), ("Pod", "pod"))]
    return rules


def scrape_configs(monitor: dict[str, Any], namespace: str) -> list[dict[str, Any]]:
    """One scrape job per endpoint of ``monitor``, its targets read from ``targets.json`` files
    named ``<job name>.json`` beside the Prometheus config."""
    kind, name = monitor["kind"], monitor["metadata"]["name"]
    spec = monitor["spec"]
    endpoints = spec["endpoints"] if kind == "ServiceMonitor" else spec["podMetricsEndpoints"]
    # What this translation carries; a monitor saying more (metricRelabelings, tlsConfig,
    # namespaceSelector, ...) fails here rather than be scraped without it.
    untranslated = set(spec) - {"selector", "endpoints", "podMetricsEndpoints", "jobLabel"}
    untranslated |= {k for e in endpoints for k in e} - {"port", "interval", "scheme", "path", "relabelings"}
    assert not untranslated, f"{kind} {name}: fields not translated here: {sorted(untranslated)}"
    prefix = "service" if kind == "ServiceMonitor" else "pod"
    port_label = "__meta_kubernetes_endpoint_port_name" if kind == "ServiceMonitor" else \
        "__meta_kubernetes_pod_container_port_name"
    jobs = []
    for i, endpoint in enumerate(endpoints):
        job_name = f"{'serviceMonitor' if kind == 'ServiceMonitor' else 'podMonitor'}/{namespace}/{name}/{i}"
        relabel = [*_common(kind), *_selector_keeps(prefix, spec["selector"]),
                   {"action": "keep", "source_labels": [port_label], "regex": endpoint["port"]},
                   {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"}]
        if kind == "ServiceMonitor":
            relabel.append({"source_labels": ["__meta_kubernetes_service_name"], "target_label": "service"})
        relabel += [{"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
                    {"source_labels": ["__meta_kubernetes_pod_container_name"], "target_label": "container"},
                    {"action": "drop", "source_labels": ["__meta_kubernetes_pod_phase"], "regex": "(Failed|Succeeded)"}]
        if kind == "ServiceMonitor":
            relabel.append({"source_labels": ["__meta_kubernetes_service_name"], "target_label": "job",
                            "replacement": "${1}"})
        else:
            relabel.append({"target_label": "job", "replacement": f"{namespace}/{name}"})
        if "jobLabel" in spec:
            relabel.append({"source_labels": [f"__meta_kubernetes_{prefix}_label_{_sanitise(spec['jobLabel'])}"],
                            "target_label": "job", "regex": "(.+)", "replacement": "${1}"})
        relabel.append({"target_label": "endpoint", "replacement": endpoint["port"]})
        relabel += [{_snake(k): v for k, v in rule.items()} for rule in endpoint.get("relabelings", [])]
        jobs.append({
            "job_name": job_name,
            "scrape_interval": endpoint.get("interval", "30s"),
            "scheme": endpoint.get("scheme", "http"),
            "metrics_path": endpoint.get("path", "/metrics"),
            "file_sd_configs": [{"files": [f"{_sanitise(job_name)}.json"]}],
            "relabel_configs": relabel,
        })
    return jobs


def _snake(key: str) -> str:
    """The operator's camelCase relabeling fields as Prometheus's snake_case."""
    return {"sourceLabels": "source_labels", "targetLabel": "target_label"}.get(key, key)


def targets(monitor: dict[str, Any], objects: list[dict[str, Any]], pods: list[RunningPod],
            namespace: str) -> list[dict[str, Any]]:
    """The target groups Kubernetes discovery would give ``monitor``'s jobs: for a ServiceMonitor
    every port of every Service's endpoints (role ``endpoints``), for a PodMonitor every port of
    every pod (role ``pod``), each with its ``__meta_kubernetes_*`` labels."""
    groups = []
    for pod in pods:
        pod_labels = {"__meta_kubernetes_namespace": namespace, "__meta_kubernetes_pod_name": pod.name,
                      "__meta_kubernetes_pod_container_name": pod.container,
                      "__meta_kubernetes_pod_phase": "Running", "__meta_kubernetes_pod_ip": pod.ip}
        for key, value in pod.labels.items():
            pod_labels[f"__meta_kubernetes_pod_label_{_sanitise(key)}"] = value
            pod_labels[f"__meta_kubernetes_pod_labelpresent_{_sanitise(key)}"] = "true"
        if monitor["kind"] == "PodMonitor":
            for port in pod.ports:
                groups.append({"targets": [f"{pod.ip}:{port['containerPort']}"], "labels": {
                    **pod_labels, "__meta_kubernetes_pod_container_port_name": port.get("name", "")}})
            continue
        for service in (o for o in objects if o["kind"] == "Service"):
            selector = service["spec"].get("selector", {})
            if not selector or not selector.items() <= pod.labels.items():
                continue
            service_labels = {"__meta_kubernetes_service_name": service["metadata"]["name"]}
            for key, value in service["metadata"].get("labels", {}).items():
                service_labels[f"__meta_kubernetes_service_label_{_sanitise(key)}"] = value
                service_labels[f"__meta_kubernetes_service_labelpresent_{_sanitise(key)}"] = "true"
            for port in service["spec"]["ports"]:
                number = pod.port(port.get("targetPort", port["port"]))
                if number is None:
                    continue
                groups.append({"targets": [f"{pod.ip}:{number}"], "labels": {
                    **pod_labels, **service_labels, "__meta_kubernetes_endpoint_port_name": port.get("name", ""),
                    "__meta_kubernetes_endpoint_address_target_kind": "Pod",
                    "__meta_kubernetes_endpoint_address_target_name": pod.name}})
    return groups
