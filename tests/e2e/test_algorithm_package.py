"""Issue 41, proven end to end: `tally new algorithm` writes a package whose tests pass as written,
and the example package (examples/algorithm-package, that command's output for `fedavgm`),
installed into a fresh virtual environment with pip, is what that environment's coordinator and
devices run. Its tests (tally.testing) then run there: rounds through the real secure sum with
dropouts; a secure job through real services with a fleet that has the package, every committed
sum exact; a fleet without it and a fleet with another version checked in but never seated."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from tally.cli.new import write_algorithm_package
from tally.ops.cluster import ProcessCluster
from tally.wire.v1 import common_pb2

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "algorithm-package"


def _files(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): p.read_text() for p in sorted(root.rglob("*"))
            if p.is_file() and "__pycache__" not in p.parts and ".egg-info" not in str(p)}


def test_the_example_package_is_what_the_scaffold_writes(tmp_path):
    write_algorithm_package("fedavgm", tmp_path / "fedavgm")
    assert _files(tmp_path / "fedavgm") == _files(EXAMPLE)


def fresh_environment(where: Path) -> Path:
    """A new virtual environment whose own site-packages is empty but for what is installed into
    it; the shared one's (numpy, torch, grpc) is reachable through a .pth file, and tally itself
    comes from this checkout (PYTHONPATH), as the other tests take it."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True)
    python = where / "bin" / "python"
    own = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         check=True, capture_output=True, text=True).stdout.strip()
    Path(own, "shared.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return python


def pip_install(python: Path, package: Path) -> None:
    """Install ``package`` (a wheel, or a source directory, built from a copy: setuptools builds
    in the tree, and the checkout must stay clean)."""
    if package.is_dir():
        package = Path(shutil.copytree(package, python.parents[1] / "sources" / package.name,
                                       ignore=shutil.ignore_patterns("__pycache__", "build", "*.egg-info")))
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "--no-deps",
                    "--no-build-isolation", "--no-index", str(package)], check=True)


def test_packages_installed_in_a_fresh_environment_pass_their_generated_tests_there(tmp_path):
    python = fresh_environment(tmp_path / "venv")
    second = tmp_path / "tally-my-algo"
    write_algorithm_package("my_algo", second)
    for package in (EXAMPLE, second):
        pip_install(python, package)
    env = {**os.environ, "PYTHONPATH": str(REPO)}

    listed = subprocess.run([str(python), "-m", "tally.cli", "algorithms", "list", "--json"], env=env, check=True,
                            capture_output=True, text=True, cwd=tmp_path)
    installed = {row["name"]: (row["package"], row["version"]) for row in json.loads(listed.stdout)["algorithms"]}
    assert installed["fedavgm"] == ("tally-fedavgm", "0.1.0") and installed["my_algo"] == ("tally-my-algo", "0.1.0")
    assert installed["fedavg"][0] == "tally" and json.loads(listed.stdout)["refused"] == []

    tests = subprocess.run([str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", str(EXAMPLE / "tests"),
                            str(second / "tests")], env=env, capture_output=True, text=True, cwd=tmp_path,
                           timeout=600)
    assert tests.returncode == 0, tests.stdout[-4000:] + tests.stderr[-2000:]
    assert "6 passed" in tests.stdout, tests.stdout[-2000:]


def test_the_shared_environment_has_no_fedavgm():
    from tally.algorithms import packages

    assert "fedavgm" not in packages.names()


def test_across_environments_only_devices_with_the_coordinators_version_are_seated(tmp_path, monkeypatch):
    """The coordinator and aggregators run in an environment with the example at 0.1.0; three
    fleets, each a process of its own environment: with the package (seated, every committed sum
    exact), with 0.2.0 of it and without it (both checked in, neither seated). A job only the 0.2.0
    fleet could take fails at its first selection deadline, naming the algorithm and both versions."""
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    with_it = fresh_environment(tmp_path / "with")
    pip_install(with_it, EXAMPLE)
    newer_source = tmp_path / "newer-source"
    shutil.copytree(EXAMPLE, newer_source)
    pyproject = newer_source / "pyproject.toml"
    pyproject.write_text(pyproject.read_text().replace('version = "0.1.0"', 'version = "0.2.0"'))
    newer = fresh_environment(tmp_path / "newer")
    pip_install(newer, newer_source)
    job = (EXAMPLE / "job.yaml").read_text()

    async def fleet(python: Path, prefix: str, cluster: ProcessCluster, job_id: str, population: str = "default"):
        argv = [str(python), "-m", "tally.cli", "fleet", "--coordinator", cluster.target, "--population", population,
                "--tls-dir", str(cluster.certs / "device"), "--devices", "6", "--hidden", "16", "--no-progress",
                "--enrolment-key", str(cluster.certs / "coordinator" / "enrolment.key"), "--id-prefix", prefix,
                "--until-job-done", job_id, "--json", str(tmp_path / f"{prefix}.json"), "--metrics-port", "0",
                "--audit-token-file", str(cluster.state / "admin.token")]
        done = await asyncio.to_thread(subprocess.run, argv, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads((tmp_path / f"{prefix}.json").read_text())

    async def main():
        async with ProcessCluster(tmp_path / "cluster", python=str(with_it)) as cluster:
            job_id = await cluster.submit(job)
            reports = await asyncio.gather(fleet(with_it, "with", cluster, job_id),
                                           fleet(newer, "newer", cluster, job_id),
                                           fleet(Path(sys.executable), "without", cluster, job_id))
            first = await cluster.job(job_id)
            lonely = await cluster.submit(job.replace("name: fedavgm-digits", "name: fedavgm-newer-only")
                                          + "population: newer-only\n")
            await fleet(newer, "newer-only", cluster, lonely, population="newer-only")
            return first, reports, await cluster.job(lonely)

    first, (seated, newer_report, without_report), lonely = asyncio.run(main())
    assert first.state == common_pb2.JOB_STATE_SUCCEEDED and first.committed_round == 2, first.message
    assert seated["audit"]["exact"] >= 2 and seated["audit"]["mismatch"] == 0 and seated["audit"]["foreign"] == 0
    for report in (newer_report, without_report):
        assert report["tasks_done"] == 0 and report["checkins"] > 0  # checked in, never seated
    assert lonely.state == common_pb2.JOB_STATE_FAILED
    assert ("no device of population 'newer-only' can run algorithm 'fedavgm' version '0.1.0': 6 device(s) "
            "checked in (version '0.2.0' on 6)") in lonely.message, lonely.message


def test_an_installed_tally_serves_its_own_algorithms_from_its_wheels_entry_points(tmp_path):
    """Without a source checkout beside the package, tally's own algorithms and model kinds come from
    the installed distribution's entry points, the route every package takes (and the scaffold's
    templates ship)."""
    source = tmp_path / "source"
    shutil.copytree(REPO / "tally", source / "tally", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(REPO / name, source / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "-w", str(tmp_path / "wheel"), str(source)], check=True)
    python = fresh_environment(tmp_path / "venv")
    pip_install(python, next((tmp_path / "wheel").glob("tally-*.whl")))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    listed = subprocess.run([str(python), "-m", "tally.cli", "algorithms", "list", "--json"], env=env, check=True,
                            capture_output=True, text=True, cwd=tmp_path)
    rows = json.loads(listed.stdout)["algorithms"]
    from tally import models
    from tally.algorithms import packages

    assert {row["name"] for row in rows if row["package"] == "tally"} == set(packages.names_of("tally"))
    kinds = json.loads(listed.stdout)["models"]
    assert {(row["kind"], row["version"]) for row in kinds if row["package"] == "tally"} == set(
        models.versions().items())
    written = subprocess.run([str(python), "-m", "tally.cli", "new", "algorithm", "x", "--dir", str(tmp_path / "x")],
                             env=env, capture_output=True, text=True, cwd=tmp_path)
    assert written.returncode == 0 and (tmp_path / "x" / "tally_x" / "algorithm.py").is_file(), written.stderr
