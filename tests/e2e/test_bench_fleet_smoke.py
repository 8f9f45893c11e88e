"""bench/fleet.py and bench/checkin.py at a smoke size: real processes over TLS, their JSON."""

from __future__ import annotations

import importlib
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _bench_run(tmp_path: Path, script: str, *args: str, timeout: float = 240) -> tuple[dict, str]:
    """The JSON a bench wrote with --json, and what it printed."""
    out = tmp_path / "out.json"
    done = subprocess.run([sys.executable, str(ROOT / "bench" / script), *args, "--json", str(out)],
                          cwd=tmp_path, timeout=timeout, capture_output=True, text=True)
    assert done.returncode == 0, f"{script} exited {done.returncode}: {done.stderr[-4000:]}"
    return json.loads(out.read_text()), done.stdout


def _bench(tmp_path: Path, script: str, *args: str, timeout: float = 240) -> dict:
    return _bench_run(tmp_path, script, *args, timeout=timeout)[0]


def test_fleet_bench_audits_every_sum_and_itemises_the_aggregators_cpu(tmp_path, monkeypatch):
    result, printed = _bench_run(tmp_path, "fleet.py", "--devices", "60", "--shards", "2", "--cohort", "20",
                                 "--aggregators", "2", "--hidden", "8", "--rounds", "1", "--checkin-rate", "50")
    assert result["rounds_committed"] == 1 and len(result["round_metrics"]) == 1
    # A person reads a summary ending in a verdict, not ~190 lines of JSON (issue 39); the JSON
    # is in the file --json names.
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    fleet = importlib.import_module("fleet")
    assert printed == fleet.summary(result, 1) + "\n" and not printed.lstrip().startswith("{")
    assert "rounds          1 of 1 committed" in printed
    assert re.search(r"^  sums audited    [1-9]\d* exact, 0 wrong, 0 foreign$", printed, re.M), printed
    assert printed.endswith("good: every round committed and every committed sum exact\n")
    assert not fleet.good(result, 2) and "NOT GOOD" in fleet.summary(result, 2)  # a round short
    # docs/load-testing.md's first load test shows a summary of this shape: the same lines in order.
    sample = re.search(r"```text\n(.+?)\n```", (ROOT / "docs" / "load-testing.md").read_text(), re.S).group(1)
    labels = lambda text: [line[:18].strip() for line in text.splitlines()]  # noqa: E731
    assert labels(sample)[1:] == labels(printed)[1:]
    assert result["audit"]["exact"] >= 1 and result["audit"]["mismatch"] == result["audit"]["foreign"] == 0
    assert ({"coordinator", "aggregator-1", "aggregator-2", "fleet-0", "fleet-1"}
            <= result["cpu_seconds_per_round"].keys())
    shards = result["fleet_shards"]
    assert len(shards) == 2 and sum(s["tasks_done"] for s in shards) == result["fleet"]["tasks_done"]
    # The first commit's CPU (enrolment included) is measured apart; one round has no steady state.
    assert result["cpu_seconds_until_first_commit"]["coordinator"] > 0
    assert result["cpu_seconds_per_round_after_the_first"] == {}
    engine = result["aggregator_engine_cpu_seconds_per_round"]
    assert any({"advertise_keys", "masked_input", "unmask"} <= phases.keys() for phases in engine.values())
    # A serving aggregator's CPU splits into engine, wire conversion both ways, and the rest.
    itemised = [cpu for cpu in result["aggregator_cpu_itemised_per_round"].values() if cpu["wire_decode"] > 0]
    assert itemised and all(cpu["wire_encode"] > 0 and cpu["engine"] > 0 for cpu in itemised)
    assert all(cpu["total"] == pytest.approx(cpu["engine"] + cpu["wire_decode"] + cpu["wire_encode"] + cpu["rest"])
               for cpu in itemised)
    assert {"selection", "aggregation", "update"} <= result["coordinator_phase_seconds_per_round"].keys()
    latency = result["device_latency_seconds"]
    assert latency["rpc"]["CheckIn"]["count"] >= 60 and {"share_keys", "masked_input"} <= latency["phase"].keys()


def test_checkin_capacity_bench_reports_each_rate_step(tmp_path):
    result = _bench(tmp_path, "checkin.py", "capacity", "--rates", "50", "100", "--step-seconds", "1",
                    "--repeats", "1", "--pool", "20", "--generators", "1")
    (run,) = result["runs"]
    assert [s["target_per_s"] for s in run["steps"]] == [50.0, 100.0]
    assert all(s["sent"] == s["answered"] + s["failures"] and s["p99_ms"] >= s["p50_ms"] for s in run["steps"])
    assert result["capacity_per_s_median"] in (0.0, 50.0, 100.0)


def test_population_bench_charges_each_registration_and_check_in_the_coordinators_cpu(tmp_path):
    """A population at rest; 30 devices register on their own channels and check in at two rates,
    from two generator processes, against the coordinator in one and in two processes and against
    the gRPC floor: every call answered (a come-back time: no job runs), CPU charged to both phases
    (the fronts' too), a plot. The devices keep state, so every check-in states an input ledger;
    with two processes the front answers its share of them (issue 38, problem 4: it forwarded
    every one)."""
    plot = tmp_path / "population.png"
    result = _bench(tmp_path, "population.py", "--populations", "1000", "--register", "30", "--generators", "2",
                    "--rates", "20", "40", "--step-seconds", "1", "--processes", "1", "2", "--plot", str(plot))
    assert result["generators"] == 2 and result["devices"].startswith("stateful")
    rows = result["populations"]
    assert [r["population"] for r in rows] == [1000]
    assert rows[0]["ready_seconds"] > 0 and rows[0]["bytes_per_registered_device_at_rest"] is not None
    runs = [result["floor"], *rows[0]["by_processes"]]
    assert [run["processes"] for run in runs] == [1, 1, 2]
    for run in runs:
        assert run["registrations"] == 30 and run["registration_failures"] == 0
        assert run["cpu_ms_per_registration"] > 0
        assert [s["target_per_s"] for s in run["checkin_steps"]] == [20.0, 40.0]
        assert all(s["answered"] == s["sent"] and s["failures"] == 0 and s["server_cpu_s"] > 0
                   for s in run["checkin_steps"]), run["checkin_steps"]
        assert run["checkin_capacity_per_s"] == 40.0 and run["cpu_ms_per_checkin"] > 0
        assert run["database_cpu_ms_per_registration"] is None  # SQLite: in the coordinator's own
    one, two = rows[0]["by_processes"]
    assert one["share_answered_by_coordinator"] == 1.0 and 0 < two["share_answered_by_coordinator"] < 1, two
    assert plot.read_bytes().startswith(b"\x89PNG")


def test_population_bench_stops_its_rate_steps_after_the_first_one_over_the_latency_limit(tmp_path):
    """No call can be answered within 0.001 ms: every generator sees its first step overloaded, and
    they all stop there instead of sending the steps above it."""
    result = _bench(tmp_path, "population.py", "--populations", "100", "--register", "6", "--generators", "2",
                    "--rates", "5", "10", "20", "--step-seconds", "1", "--processes", "1", "--p99-ms", "0.001")
    for run in [result["floor"], *result["populations"][0]["by_processes"]]:
        (step,) = run["checkin_steps"]
        assert step["target_per_s"] == 5.0 and step["answered"] == step["sent"] == 5 and step["failures"] == 0
        assert run["checkin_capacity_per_s"] == 0.0 and run["cpu_ms_per_checkin"] is None


@pytest.mark.full  # a minute: `make test` has the SQLite run above, CI runs this one too
def test_population_bench_keeps_the_store_in_postgres_when_given_one(tmp_path, postgres):
    """The same measurements with the store in a database of its own on the server (a replica's
    store), which the bench drops afterwards."""
    import psycopg

    # 100 registrations: the database's CPU for 10 (~0.7 ms each) can fall within one clock tick.
    result = _bench(tmp_path, "population.py", "--populations", "200", "--register", "100", "--rates", "10",
                    "--step-seconds", "1", "--processes", "1", "--database", postgres.url())
    assert result["store"] == "postgresql"
    (run,) = result["populations"][0]["by_processes"]
    assert run["registrations"] == 100 and run["registration_failures"] == 0 and run["cpu_ms_per_registration"] > 0
    assert all(s["answered"] == s["sent"] and s["failures"] == 0 for s in run["checkin_steps"])
    # The server on this machine is charged too, apart: each registration writes a row there.
    assert run["database_cpu_ms_per_registration"] > 0
    assert all(s["database_cpu_ms_per_checkin"] is not None for s in run["checkin_steps"])
    with psycopg.connect(postgres.url()) as conn:
        left = conn.execute("SELECT datname FROM pg_database WHERE datname LIKE 'tally_bench_%'").fetchall()
    assert left == []


def test_pacing_holds_an_idle_population_at_or_below_the_target_rate(tmp_path):
    """200 idle devices come back every ~5 s unpaced (~40/s); paced at 15/s they may not exceed it."""
    rate = 15.0
    result = _bench(tmp_path, "checkin.py", "pacing", "--devices", "200", "--rate", str(rate),
                    "--seconds", "36", "--every", "6")
    assert result["settled_median_per_s"] is not None
    assert result["settled_median_per_s"] <= 1.3 * rate, result["rates"]


def test_grpc_floor_bench_runs_a_sessions_messages_over_tls(tmp_path):
    result = _bench(tmp_path, "grpc_floor.py", "--streams", "5", "--dim", "100", "--k", "3", "--rounds", "2", "--tls")
    # 5 device and 6 server messages per stream; every measured round read the server's CPU.
    assert result["tls"] and result["messages_per_round"] == 5 * 11
    assert len(result["server_cpu_seconds_per_round"]) == 2
    assert result["server_cpu_seconds_median"] == pytest.approx(
        result["server_cpu_microseconds_per_message"] * result["messages_per_round"] / 1e6)


def test_every_fleet_bench_option_says_what_it_is_and_its_default():
    """Issue 25, item 7: `bench/fleet.py --help` listed options with neither."""
    import re

    out = subprocess.run([sys.executable, str(ROOT / "bench" / "fleet.py"), "--help"], capture_output=True, text=True,
                         check=True).stdout
    options = out.split("options:", 1)[1]
    entries = re.split(r"\n  (?=-)", options)[1:]
    assert len(entries) >= 12
    for entry in entries:
        flag = entry.split()[0]
        assert len(entry.split(None, 2)) > 2 or flag in ("-h,",), entry  # a description follows
        if flag.startswith("--") and flag not in ("--plain", "--semi-honest", "--json", "--keep"):
            assert "(default:" in " ".join(entry.split()), entry


def _wait_at(barrier) -> None:
    barrier.wait()  # raises BrokenBarrierError once the barrier is aborted


def _die() -> None:
    raise SystemExit(3)


def test_a_population_generator_that_dies_ends_the_others_and_the_benchmark_at_once(monkeypatch):
    """One generator gone before it reports: the others, waiting at the lockstep barrier, are let
    go (not left for its 10-minute timeout), and the benchmark fails naming the dead one."""
    import importlib
    import multiprocessing

    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    population = importlib.import_module("population")
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(2, timeout=600)
    workers = [context.Process(target=_wait_at, args=(barrier,)), context.Process(target=_die)]
    for worker in workers:
        worker.start()
    try:
        with pytest.raises(RuntimeError, match="generator 1 exited with status 3"):
            population._outcomes(workers, context.Queue(), barrier)
        workers[0].join(60)
        assert workers[0].exitcode not in (None, 0)  # broke out of the barrier
    finally:
        for worker in workers:
            worker.kill()


def test_no_bench_scripts_help_points_at_an_issue_and_the_fleet_bench_offers_a_first_load_test():
    """Issue 39: `bench/fleet.py --help` said "(issue 8)", which tells a reader nothing."""
    helped = {}
    for script in sorted((ROOT / "bench").glob("*.py")):
        done = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=120)
        if done.returncode == 0 and "usage:" in done.stdout:  # the others are modules the scripts import
            helped[script.name] = done.stdout
    assert len(helped) >= 12 and "fleet.py" in helped, sorted(helped)
    assert {name: re.findall(r"\b[Ii]ssues? #?\d+", text) for name, text in helped.items()
            if re.search(r"\b[Ii]ssues? #?\d+", text)} == {}
    assert "A first load test, under a minute: bench/fleet.py --devices 300 --cohort 60 --rounds 2" in (
        " ".join(helped["fleet.py"].split()))
