"""Each role's extra installs into a fresh virtual environment and runs that role's server.

A wheel is built from a copy of the sources, then ``tally[aggregator]``, ``tally[coordinator]``,
``tally[client]`` (the SDK) and ``tally[loadtest]`` each go into a venv of their own (dependencies
from the package index or pip's cache, torch from the machine's wheel), and the aggregator,
coordinator and load-test venvs run one secure-aggregation job together: each server answers its
gRPC health check with the ``tally-probe`` its own venv installed, and the aggregator does so with
no torch importable.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from support.deploy import JOB_SPEC, ROOT, Service, clean_env, poll_until_ok
from tally.security import certs

pytestmark = pytest.mark.full

ROLES = ("aggregator", "coordinator", "client", "loadtest")
# The console script each role's venv must have besides tally-probe.
SCRIPTS = {"aggregator": "tally-aggregator", "coordinator": "tally-coordinator", "client": "tally-client",
           "loadtest": "tally-fleet"}
# Distributions a role must not pull in (what the image would carry for nothing).
FORBIDDEN = {
    "aggregator": {"torch", "scipy", "onnx", "onnxruntime", "scikit-learn", "matplotlib", "rich", "pyyaml",
                   "kubernetes"},
    "coordinator": {"onnxruntime", "scikit-learn", "matplotlib", "kubernetes"},
    # The SDK carries no load tester: no behaviour profiles (YAML, pydantic), no progress bars.
    "client": {"matplotlib", "kubernetes", "pyyaml", "pydantic", "rich"},
    "loadtest": {"matplotlib", "kubernetes"},
}
SOURCES = ("pyproject.toml", "README.md", "tally")


def _pip(python: Path, *args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(python), "-m", "pip", *args], capture_output=True, text=True,
                          timeout=timeout, env=clean_env())


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The project's wheel, built from a copy so the checkout gets no build/ directory."""
    src = tmp_path_factory.mktemp("src")
    for name in SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            shutil.copy2(path, src / name)
    out = tmp_path_factory.mktemp("wheel")
    built = _pip(Path(sys.executable), "wheel", "--no-deps", "--no-build-isolation", "-w", str(out), str(src))
    assert built.returncode == 0, built.stderr[-2000:]
    return next(out.glob("tally-*.whl"))


@pytest.fixture(scope="module")
def reachable_index(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Skip (visibly) when neither the package index nor pip's cache can provide dependencies."""
    probe = "grpcio-health-checking==" + metadata.version("grpcio-health-checking")
    got = _pip(Path(sys.executable), "download", "--no-deps", "-d", str(tmp_path_factory.mktemp("dl")),
               probe, timeout=300)
    if got.returncode != 0:
        pytest.skip(f"cannot fetch {probe} from the package index or pip's cache: "
                    f"{got.stderr.strip().splitlines()[-1:]}")


@pytest.fixture(scope="module")
def venvs(tmp_path_factory: pytest.TempPathFactory, wheel: Path, reachable_index: None) -> dict[str, Path]:
    """role -> bin/ of a fresh venv with ``tally[role]`` installed (and nothing of the others)."""
    out = {}
    for role in ROLES:
        venv = tmp_path_factory.mktemp(f"venv-{role}")
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, env=clean_env())
        python = venv / "bin" / "python"
        done = _pip(python, "install", "--quiet", "-c", str(ROOT / "constraints.txt"),
                    f"tally[{role}] @ {wheel.as_uri()}")
        assert done.returncode == 0, f"pip install tally[{role}]:\n{done.stderr[-3000:]}"
        out[role] = venv / "bin"
    return out


@pytest.mark.parametrize("role", ROLES)
def test_extra_installs_only_what_its_role_needs(venvs: dict[str, Path], role: str) -> None:
    listing = _pip(venvs[role] / "python", "list", "--format=freeze").stdout.lower()
    installed = {line.split("==")[0].replace("_", "-") for line in listing.splitlines()}
    assert "tally" in installed
    assert not installed & FORBIDDEN[role], f"tally[{role}] pulled in {installed & FORBIDDEN[role]}"
    for script in ("tally-probe", SCRIPTS[role]):
        assert (venvs[role] / script).exists(), script


def test_aggregator_venv_has_no_torch(venvs: dict[str, Path]) -> None:
    result = subprocess.run([str(venvs["aggregator"] / "python"), "-c", "import torch"],
                            capture_output=True, text=True, env=clean_env())
    assert result.returncode != 0 and "No module named 'torch'" in result.stderr


def test_each_role_from_its_own_venv_runs_a_job(venvs: dict[str, Path], tmp_path: Path) -> None:
    """Aggregator, coordinator and fleet, each from the venv of its extra, over mutual TLS."""
    tls = tmp_path / "certs"
    certs.write_deployment(tls, aggregators=1)
    jobs = tmp_path / "jobs"
    jobs.mkdir()
    (jobs / "digits.yaml").write_text(JOB_SPEC.format(name="packaged", rounds=1, cohort=10))
    env = clean_env()
    services: list[Service] = []
    try:
        aggregator = Service("aggregator", [
            str(venvs["aggregator"] / "tally-aggregator"), "--listen", "127.0.0.1:0", "--metrics-port", "0",
            "--control-listen", "127.0.0.1:0", "--id", "agg-1", "--tls-dir", str(tls / "aggregator-1"),
            "--require-client-cert",
        ], tmp_path, env)
        services.append(aggregator)
        found = aggregator.wait_for(r"port (\d+), control API on port (\d+)")
        device_port, control_port = found.group(1), found.group(2)
        poll_until_ok([str(venvs["aggregator"] / "tally-probe"), f"localhost:{device_port}",
                       "--tls-dir", str(tls / "device")], env=env)

        coordinator = Service("coordinator", [
            str(venvs["coordinator"] / "tally-coordinator"), "--listen", "127.0.0.1:0", "--metrics-port", "0",
            "--state-dir", str(tmp_path / "state"), "--tls-dir", str(tls / "coordinator"),
            "--aggregator", f"agg-1=localhost:{control_port}", "--jobs-dir", str(jobs),
            "--checkin-hold", "5",
        ], tmp_path, env)
        services.append(coordinator)
        port = coordinator.wait_for(r"coordinator on port (\d+)").group(1)
        job_id = coordinator.wait_for(r"submitted digits.yaml as job (\S+)").group(1)
        poll_until_ok([str(venvs["coordinator"] / "tally-probe"), f"localhost:{port}",
                       "--tls-dir", str(tls / "device")], env=env)

        fleet = subprocess.run([
            str(venvs["loadtest"] / "tally-fleet"), "--coordinator", f"localhost:{port}",
            "--devices", "10", "--hidden", "16", "--tls-dir", str(tls / "device"),
            "--enrolment-key", str(tls / "coordinator" / "enrolment.key"), "--no-progress",
            "--until-job-done", job_id,
        ], capture_output=True, text=True, timeout=600, env=env)
        assert fleet.returncode == 0, fleet.stderr[-3000:]
        assert "fleet of 10" in fleet.stderr
        status = subprocess.run([
            sys.executable, "-m", "tally.cli", "job", "status", job_id, "--coordinator", f"localhost:{port}",
            "--state-dir", str(tmp_path / "state"), "--tls-dir", str(tls / "device"),
        ], capture_output=True, text=True, timeout=60)
        assert "SUCCEEDED" in status.stdout, status.stdout + status.stderr
    finally:
        for service in reversed(services):
            service.stop()
