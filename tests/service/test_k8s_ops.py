"""``tally k8s``: every object it would send passes the schema; the admin-API part runs against a
real coordinator; the parts that need an API server run where one is configured."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from support.deploy import JOB_SPEC, poll_until_ok
from support.manifests import K8S, kubernetes_validate, render, versions
from tally.cli import main as tally_main
from tally.cli.k8s import coordinator_jobs
from tally.ops import k8s
from tally.ops.cluster import ProcessCluster


@pytest.fixture(scope="module")
def fleet_template() -> dict[str, Any]:
    return k8s.find_object(render(K8S / "overlays" / "dev"), "Job", k8s.FLEET_JOB)


@settings(max_examples=25, deadline=None)
@given(devices=st.integers(1, 100_000), shards=st.integers(1, 200), parallelism=st.none() | st.integers(1, 300),
       dropout=st.none() | st.floats(0.0, 0.99))
def test_fleet_jobs_pass_the_schema_and_shard_the_fleet(
    fleet_template: dict[str, Any], devices: int, shards: int, parallelism: int | None, dropout: float | None
) -> None:
    if devices < shards:
        with pytest.raises(ValueError, match="--devices"):
            k8s.fleet_job(fleet_template, devices=devices, shards=shards)
        return
    job = k8s.fleet_job(fleet_template, devices=devices, shards=shards, parallelism=parallelism, dropout=dropout)
    for version in versions():
        kubernetes_validate.validate(job, version, strict=True)
    spec = job["spec"]
    assert spec["completions"] == shards and spec["completionMode"] == "Indexed"
    assert spec["parallelism"] == min(parallelism or shards, shards)
    env = {e["name"]: e.get("value") for e in spec["template"]["spec"]["containers"][0]["env"]}
    assert (env["FLEET_DEVICES"], env["FLEET_SHARDS"]) == (str(devices), str(shards))
    if dropout is not None:
        assert float(env["FLEET_DROPOUT"]) == dropout
    assert fleet_template["spec"]["completions"] == 2, "the overlay's template is left as it was"


@pytest.mark.parametrize("kwargs, flag", [
    ({"devices": 10, "shards": 0}, "--shards"),
    ({"devices": 10, "shards": 2, "parallelism": 0}, "--parallelism"),
    ({"devices": 10, "shards": 2, "dropout": 1.0}, "--dropout"),
])
def test_fleet_job_refuses_bad_values_naming_the_option(
    fleet_template: dict[str, Any], kwargs: dict[str, Any], flag: str
) -> None:
    with pytest.raises(ValueError, match=flag):
        k8s.fleet_job(fleet_template, **kwargs)


CUSTOM = ("cert-manager.io/", "monitoring.coreos.com/", "gateway.networking.k8s.io/")


@pytest.mark.parametrize("overlay", ["dev", "prod", "loadtest", "edge"])
def test_apply_sends_valid_objects_in_dependency_order(overlay: str, tmp_path: Path) -> None:
    assert tally_main(["certs", "--out", str(tmp_path / "certs"), "--k8s-secrets", str(tmp_path / "k8s")]) == 0
    objects = k8s.apply_order(k8s.render(K8S / "overlays" / overlay) + k8s.load_manifests(tmp_path / "k8s"))
    kinds = [o["kind"] for o in objects]
    assert kinds[0] == "Namespace"
    custom = [i for i, o in enumerate(objects) if o["apiVersion"].startswith(CUSTOM)]
    assert custom == list(range(len(objects) - len(custom), len(objects))), "custom resources go last"
    assert max(i for i, k in enumerate(kinds) if k == "Secret") < kinds.index("StatefulSet")
    for obj in objects:
        if not obj["apiVersion"].startswith(CUSTOM):
            for version in versions():
                kubernetes_validate.validate(obj, version, strict=True)


def test_render_prints_an_overlay_offline_in_apply_order() -> None:
    """`tally k8s render OVERLAY` needs no cluster (no kubeconfig either): the overlay's objects
    as YAML, in the order apply sends them."""
    import yaml

    result = subprocess.run([sys.executable, "-m", "tally.cli", "k8s", "render", str(K8S / "overlays" / "prod")],
                            capture_output=True, text=True, timeout=120,
                            env={**os.environ, "KUBECONFIG": "/nonexistent"})
    assert result.returncode == 0, result.stderr
    printed = [doc for doc in yaml.safe_load_all(result.stdout) if doc]
    assert printed == k8s.apply_order(render(K8S / "overlays" / "prod"))
    assert printed[0]["kind"] == "Namespace" and not [o for o in printed if o["kind"] == "Job"]


def test_cli_errors_are_one_line(tmp_path: Path) -> None:
    for action in ("apply", "render"):
        result = subprocess.run([sys.executable, "-m", "tally.cli", "k8s", action, str(tmp_path / "nowhere")],
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 2 and result.stderr.startswith("tally k8s: kubectl kustomize")
        assert "Traceback" not in result.stderr
    result = subprocess.run([sys.executable, "-m", "tally.cli", "k8s", "fleet", "--devices", "3", "--shards", "4"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "--devices (3) must be at least --shards (4)" in result.stderr


def test_status_reads_jobs_and_rounds_from_a_real_coordinator(tmp_path: Path) -> None:
    jobs = tmp_path / "jobs"
    jobs.mkdir()
    (jobs / "digits.yaml").write_text(JOB_SPEC.format(name="digits", rounds=2, cohort=10))
    services = ProcessCluster(tmp_path, aggregators=0, checkin_hold_s=None, coordinator_flags=["--jobs-dir", str(jobs)])
    tls = services.certs

    async def scenario() -> None:
        async with services:
            job_id = (await services.processes["coordinator"].line(r"submitted digits.yaml as job (\S+)")).group(1)
            port = services.port
            poll_until_ok([sys.executable, "-m", "tally.ops.probe", f"localhost:{port}", "--tls-dir",
                           str(tls / "device")])
            token = (services.state / "admin.token").read_text().strip()
            rows = coordinator_jobs(f"localhost:{port}", tls / "device", token)
            assert [r[0] for r in rows] == [job_id]
            assert rows[0][1] in ("PENDING", "RUNNING") and rows[0][4] == "0"
            with pytest.raises(RuntimeError, match="UNAUTHENTICATED|PERMISSION_DENIED"):
                coordinator_jobs(f"localhost:{port}", tls / "device", "not-the-token")

    asyncio.run(scenario())


@pytest.fixture
def cluster() -> k8s.Cluster:
    """Only a cluster named on purpose: these tests create the namespace there."""
    context = os.environ.get("TALLY_K8S_TEST_CONTEXT")
    if not context:
        pytest.skip("no Kubernetes API server for tests: set TALLY_K8S_TEST_CONTEXT to a kubeconfig "
                    "context (e.g. a kind cluster) to run them")
    try:
        return k8s.Cluster(context=context)
    except k8s.K8sError as exc:
        pytest.skip(f"TALLY_K8S_TEST_CONTEXT={context}: {exc}")


def test_apply_dry_run_and_status_against_a_cluster(cluster: k8s.Cluster, tmp_path: Path) -> None:
    assert tally_main(["certs", "--out", str(tmp_path / "certs"), "--k8s-secrets", str(tmp_path / "k8s")]) == 0
    objects = k8s.render(K8S / "overlays" / "dev") + k8s.load_manifests(tmp_path / "k8s")
    lines = cluster.apply([o for o in objects if o["kind"] == "Namespace"])
    lines += cluster.apply(objects, dry_run=True)
    assert len(lines) == len(objects) + 1
    assert isinstance(cluster.status("tally").pods, list)
