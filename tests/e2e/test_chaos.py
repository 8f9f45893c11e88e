"""The fault campaign (issue 8) at CI size, and the synthetic fleet's command against real
processes: services over TLS on 127.0.0.1, killed and restarted; every committed sum checked."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys

import pytest

from tally.chaos.campaign import FAULTS, MISBEHAVIOURS, Campaign, CampaignConfig, VaryingDropouts, failed_round
from tally.client.retry import RetryPolicy
from tally.coordinator.state.leadership import Leadership
from tally.coordinator.state.store import Store
from tally.loadtest import Fleet
from tally.loadtest.fleet import device_ids
from tally.loadtest.synthetic import SyntheticUpdates
from tally.ops.cluster import ProcessCluster, wait_for
from tally.wire.v1 import common_pb2


def _fedavg_spec(name: str, cohort: int, extra: str) -> str:
    """A 2-round FedAvg job of a small mlp for the synthetic devices, plus ``extra`` YAML lines."""
    return (f"name: {name}\nalgorithm: fedavg\nrounds: 2\ncohort_size: {cohort}\nmin_cohort: 5\n"
            f"over_selection: 1.2\nmodel: {{kind: mlp, inputs: 64, classes: 10, hidden: 8, seed: 0}}\n{extra}\n")


@pytest.mark.parametrize("blocks", [1, pytest.param(2, marks=pytest.mark.full)])
def test_a_short_campaign_meets_every_invariant_under_every_fault(tmp_path, blocks: int):
    """Faults come in shuffled blocks of each fault once: one block in ``make test``, two in full."""
    config = CampaignConfig(rounds=blocks * len(FAULTS), seed=3)
    result = asyncio.run(asyncio.wait_for(Campaign(config, tmp_path).run(), 900))
    assert result.violations == []
    assert {r.fault for r in result.rounds} == set(FAULTS)
    committed = [r for r in result.rounds if r.outcome == "committed"]
    assert committed and all(r.sums_exact >= 1 and r.sums_wrong == 0 for r in committed)
    # A job that failed says why (the coordinator's message); a committed round has no reason.
    assert all(bool(r.reason) == (r.outcome == "job_failed") for r in result.rounds)
    assert all(bool(r.attempts) == (r.outcome == "job_failed") for r in result.rounds)
    kills = [r for r in result.rounds if r.fault.startswith("kill_")]
    # Each kill lands in a round the job is running (not in one it finished, nor after it ended).
    assert all(re.search(r"killed round \d+ in (SELECTION|AGGREGATION)", r.detail) for r in kills), \
        [r.detail for r in kills]
    report = result.to_dict()
    assert sum(row["rounds"] for row in report["faults"]) == config.rounds
    assert set(report["cpu_seconds"]) == {"coordinator", "aggregator-1", "aggregator-2"}


def test_a_dropout_fault_for_one_attempt_ends_after_that_attempts_sessions():
    """The coordinator seats a retry at once from devices it held meanwhile, so a fault meant to
    fail one attempt is bounded by sessions, not switched off when someone sees the abort."""
    plan = VaryingDropouts(seed=3)
    devices = [plan.draws(f"d{i}") for i in range(50)]
    plan.set(1.0, ("share_keys",), sessions=24)
    first = [next(d) for d in devices[:24]]
    later = [next(d) for d in devices[24:]] + [next(d) for d in devices[:24]]
    assert first == ["share_keys"] * 24 and later == [None] * 50
    plan.set(1.0, ("unmask",))  # unbounded again
    assert {next(d) for d in devices} == {"unmask"}


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_a_failed_round_says_how_each_attempt_ended_and_whom_its_retries_could_not_seat(tmp_path, request, backend):
    """What the campaign records beside a job failure, read back from a real coordinator
    database (one coordinator's SQLite file, or the replicas' PostgreSQL): every attempt's
    ending in order, and the seats still held when the job failed (a released seat, or one of
    another round, does not count)."""
    url = request.getfixturevalue("postgres_url") if backend == "postgresql" else None
    cluster = ProcessCluster(tmp_path, aggregators=1, replicas=2 if url else 1, database_url=url)
    leadership = Leadership(url) if url else None  # over PostgreSQL only a leader writes
    store = Store(cluster.state, url, leadership.try_lead() if leadership else None)
    endings = ["masked_input[update]: 5 devices answered, at least 13 are required",
               "interrupted: coordinator stopped", "advertise_keys: 6 devices answered, at least 7 are required"]
    for now, ending in enumerate(endings):
        attempt = store.start_attempt("job", 3, float(now))
        store.finish_attempt("job", 3, attempt, now + 0.5, ending)
    store.add_seated("job", 3, [("d1", "t1"), ("d2", "t2"), ("d3", "t3")])
    store.release_seats("job", 3, [("d2", "t2")])
    store.add_seated("job", 4, [("d9", "t9")])
    store.add_seated("other", 3, [("d8", "t8")])
    store.close()
    if leadership:
        leadership.close()
    with cluster.database() as db:
        assert failed_round(db, "job", 3) == (endings, 2)


def test_every_kind_of_device_misbehaviour_leaves_the_rounds_exact(tmp_path):
    config = CampaignConfig(rounds=len(MISBEHAVIOURS), seed=5, faults=("misbehaviour",))
    result = asyncio.run(asyncio.wait_for(Campaign(config, tmp_path).run(), 900))
    assert result.violations == []
    assert [r.detail.split()[1] for r in result.rounds] == list(MISBEHAVIOURS)
    assert all(r.outcome == "committed" and r.sums_exact >= 1 and r.sums_wrong == 0 for r in result.rounds), \
        [(r.detail, r.outcome) for r in result.rounds]
    # Duplicates, replays, garbage and late inputs are refused by name (which ones a round saw
    # depends on which devices it selected); stalled devices are outwaited.
    assert {"duplicate_message", "malformed", "wrong_sender", "stale_message", "out_of_phase"} & set(result.refused)


@pytest.mark.parametrize("processes", [1, 3])
def test_the_synthetic_fleet_command_checks_every_sum_it_was_in(tmp_path, processes):
    """With --processes 3 the devices run in three processes (each serves its own metrics) and
    the parent merges their fingerprints: every cohort sum is exact, none holds a foreign device."""

    async def main():
        cluster = ProcessCluster(tmp_path / "cluster")
        try:
            await cluster.start()
            job_id = await cluster.submit(_fedavg_spec("synthetic-cli", cohort=12,
                                                       extra="secure: {dropout_rate: 0.1, corrupt_rate: 0.05}"))
            argv = [sys.executable, "-m", "tally.cli", "fleet", "--coordinator", cluster.target,
                    "--tls-dir", str(cluster.certs / "device"), "--devices", "20", "--synthetic", "--no-progress",
                    "--enrolment-key", str(cluster.certs / "coordinator" / "enrolment.key"),
                    "--audit-token-file", str(cluster.state / "admin.token"), "--until-job-done", job_id,
                    "--json", str(tmp_path / "fleet.json"), "--processes", str(processes), "--metrics-port", "0",
                    "--report", str(tmp_path / "report")]
            done = await asyncio.to_thread(subprocess.run, argv, capture_output=True, text=True, timeout=300)
            return done, (await cluster.job(job_id)).committed_round
        finally:
            await cluster.stop()

    done, committed = asyncio.run(main())
    assert done.returncode == 0, done.stderr
    report = json.loads((tmp_path / "fleet.json").read_text())
    assert committed == 2 and report["audit"]["mismatch"] == 0 and report["audit"]["foreign"] == 0
    assert report["audit"]["exact"] >= 2  # both rounds, every cohort
    assert "sum audit: exact" in done.stderr
    assert report["devices"] == 20 and "fleet of 20:" in done.stderr
    assert done.stderr.count("metrics on http://") == processes
    # The report merges every process's timeline: calls, phases and both rounds as devices saw them.
    summary = json.loads((tmp_path / "report" / "report.json").read_text())
    assert summary["rpc_seconds"]["CheckIn"]["count"] >= 20 and summary["fleet"]["devices"] == 20
    assert {"advertise_keys", "share_keys", "masked_input", "unmask"} <= set(summary["phase_seconds"])
    assert all(0 < p["p50"] <= p["p95"] <= p["p99"] for p in summary["phase_seconds"].values())
    assert sorted(summary["rounds"]) == [f"{report['jobs'][0]}/1", f"{report['jobs'][0]}/2"]
    assert (tmp_path / "report" / "report.png").stat().st_size > 10_000


def test_a_round_waits_for_an_aggregator_when_every_one_is_down(tmp_path):
    """Regression (fault campaign, seed 21): with every aggregator killed at once, the round's
    attempts failed in under a second ("no healthy aggregator") and spent the retry budget before
    the restarted processes were back; the job failed. Now the attempt waits for one."""

    async def main():
        cluster = ProcessCluster(tmp_path / "cluster", aggregators=2)
        fleet = None
        try:
            await cluster.start()
            job_id = await cluster.submit(_fedavg_spec(
                "all-down", cohort=10, extra="retries: 1\ndeadlines: {checkin: 20, download: 6, advertise_keys: 4, "
                                             "share_keys: 4, masked_input: 6, unmask: 4}"))
            fleet = Fleet(cluster.target, cluster.tls, [SyntheticUpdates(i, 1) for i in device_ids("down", 24)],
                          retry=RetryPolicy(initial_seconds=0.2, max_seconds=1.0), enrolment_key=cluster.enrolment_key,
                          id_prefix="down", audit=True)
            running = asyncio.create_task(fleet.run(until=fleet.until_job_done(job_id, every_seconds=0.2)))

            async def committed(n: int) -> bool:
                return (await cluster.job(job_id)).committed_round >= n

            assert await wait_for(lambda: committed(1), timeout=60), "round 1 never committed"
            for name in ("aggregator-1", "aggregator-2"):
                await cluster.kill(name)
            # Both stay down until round 2 has found no aggregator at cohort formation (the
            # coordinator logs that it waits for one) or, without the fix, the job has failed.
            log = cluster.processes["coordinator"].log

            async def stuck() -> bool:
                return ("waiting for one" in log.read_text()
                        or (await cluster.job(job_id)).state == common_pb2.JOB_STATE_FAILED)

            # Under load round 2's first attempt may form its cohorts before the kill and fail on
            # it; its retry then meets no aggregator, with devices left that the first did not seat.
            assert await wait_for(stuck, timeout=150), "round 2 never reached cohort formation"
            for name in ("aggregator-1", "aggregator-2"):
                await cluster.restart(name)
            await asyncio.wait_for(running, 120)
            return await cluster.job(job_id)
        finally:
            if fleet is not None:
                fleet.close()
            await cluster.stop()

    job = asyncio.run(main())
    assert job.committed_round == 2, job.message


@pytest.mark.full
def test_a_campaign_with_device_fronts_survives_fronts_and_the_coordinator_killed(tmp_path):
    """The coordinator serving devices from two processes: a device front SIGKILLed mid-round
    (the coordinator starts it again) and the coordinator itself SIGKILLed, its orphaned front
    then exiting so that the restarted coordinator can bind the port. Every invariant holds."""
    faults = ("kill_device_front", "kill_coordinator", "none")
    config = CampaignConfig(rounds=2 * len(faults), seed=4, faults=faults, device_processes=2)
    result = asyncio.run(asyncio.wait_for(Campaign(config, tmp_path).run(), 900))
    assert result.violations == []
    assert {r.fault for r in result.rounds} == set(faults)
    assert all("killed round" in r.detail for r in result.rounds if r.fault.startswith("kill_")), \
        [r.detail for r in result.rounds]
    committed = [r for r in result.rounds if r.outcome == "committed"]
    assert committed and all(r.sums_exact >= 1 and r.sums_wrong == 0 for r in committed)


@pytest.mark.full
def test_a_campaign_over_coordinator_replicas_survives_its_leader_killed_or_paused_and_the_devices_replica_killed(
        tmp_path, postgres_url):
    """Two coordinator replicas over a real PostgreSQL server: whichever leads SIGKILLed mid-round,
    or SIGSTOPped past its lease and resumed once the other leads (it stops by itself), and the
    replica the devices and the Admin API reach (leading or not) SIGKILLed; each comes back as a
    replica would. Every invariant holds, read from the PostgreSQL database (no attempt started by
    an epoch older than one before it: the resumed leader started none)."""
    faults = ("kill_leader", "pause_leader", "kill_coordinator", "none")
    config = CampaignConfig(rounds=2 * len(faults), seed=6, faults=faults, replicas=2)
    result = asyncio.run(asyncio.wait_for(Campaign(config, tmp_path, database_url=postgres_url).run(), 900))
    assert result.violations == []
    assert {r.fault for r in result.rounds} == set(faults)
    kills = [r.detail for r in result.rounds if r.fault.startswith("kill_")]
    assert all(re.match(r"coordinator(-2)? killed round \d+ in (SELECTION|AGGREGATION)", d) for d in kills), kills
    pauses = [r.detail for r in result.rounds if r.fault == "pause_leader"]
    assert pauses and all(re.match(r"coordinator(-2)? paused round \d+ in (SELECTION|AGGREGATION) for [\d.]+ s, "
                                   r"coordinator(-2)? took over, the resumed one stopped", d) for d in pauses), pauses
    committed = [r for r in result.rounds if r.outcome == "committed"]
    assert committed and all(r.sums_exact >= 1 and r.sums_wrong == 0 for r in committed)
    assert "postgresql://" not in json.dumps(result.to_dict()), "the record names no password"


def test_a_campaign_refuses_front_faults_without_fronts():
    with pytest.raises(ValueError, match="device_processes > 1"):
        CampaignConfig(faults=("kill_device_front",))


def test_a_campaign_refuses_leader_faults_without_replicas_and_replicas_without_a_database(tmp_path):
    for fault in ("kill_leader", "pause_leader"):
        with pytest.raises(ValueError, match=f"{fault} needs replicas > 1"):
            CampaignConfig(faults=(fault,))
    with pytest.raises(ValueError, match="PostgreSQL"):
        ProcessCluster(tmp_path, replicas=2)


def test_a_campaign_sent_sigterm_stops_every_process_it_started(tmp_path):
    """``kill`` on the harness (as a CI timeout or an operator sends it) stops its coordinator,
    aggregators and fleet before it exits: none is left holding ports and cores."""
    import psutil

    campaign = subprocess.Popen([sys.executable, "-m", "tally.cli", "chaos", "--rounds", "50", "--aggregators", "2",
                                 "--workdir", str(tmp_path)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                text=True)
    try:
        parent = psutil.Process(campaign.pid)
        started: list[psutil.Process] = []

        def ours(child: psutil.Process) -> bool:
            try:
                return "tally.cli" in " ".join(child.cmdline())
            except psutil.Error:  # ended since it was listed
                return False

        async def all_started() -> bool:  # two aggregators and the coordinator
            started[:] = [c for c in parent.children(recursive=True) if ours(c)]
            return len(started) >= 3 and (tmp_path / "state" / "admin.token").exists()

        assert asyncio.run(wait_for(all_started, 120)), campaign.stderr
        campaign.terminate()
        assert campaign.wait(60) == 143
        assert "terminated; its processes are stopped" in campaign.stderr.read()
        gone, alive = psutil.wait_procs(started, timeout=5)
        assert alive == [], [p.cmdline() for p in alive]
    finally:
        if campaign.poll() is None:
            campaign.kill()
