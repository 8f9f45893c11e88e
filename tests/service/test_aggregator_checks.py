"""The coordinator checks each aggregator as what it is (issue 39, item 4): given an aggregator's
device port instead of its control port it logged `aggregator up` and the job then failed with
`OpenSession failed: UNIMPLEMENTED`; an unreachable second aggregator was never mentioned, and
`tally_coordinator_aggregators_up` had no per-aggregator label. Real aggregator, real coordinator."""

from __future__ import annotations

import logging
import socket

from support.aggregator import OWNER_TOKENS
from support.stack import PLAINTEXT, Stack, in_process, run, scrape_text, spec
from tally.coordinator.rounds import cohort_sessions
from tally.coordinator.rounds.aggregators import DEVICE_PORT, AggregatorPool
from tally.loadtest.synthetic import SyntheticUpdates
from tally.security import load_or_create_ticket_key


def _dead_address() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{probe.getsockname()[1]}"


def test_a_device_port_and_a_dead_aggregator_are_named_at_start_in_metrics_and_in_the_job_failure(
    tmp_path, monkeypatch, caplog
):
    monkeypatch.setattr(cohort_sessions, "NO_AGGREGATOR_WAIT_S", 0.5)  # no aggregator will come back
    caplog.set_level(logging.INFO, logger="tally.coordinator.rounds.aggregators")
    dead = _dead_address()

    async def main():
        async with in_process() as services:
            state = tmp_path / "state"
            public = load_or_create_ticket_key(state).public_key()
            aggregator = await services.aggregator(PLAINTEXT, public, "agg-1", control_listen="127.0.0.1:0")
            right = AggregatorPool([("agg-1", f"127.0.0.1:{aggregator.control_port}")], PLAINTEXT, 1 << 20,
                                   OWNER_TOKENS)
            try:
                assert await right.healthy() == ["agg-1"]  # its control port passes the same check
            finally:
                await right.close()
            coordinator = await services.coordinator(
                PLAINTEXT, state, [("agg-1", f"127.0.0.1:{aggregator.port}"), ("agg-2", dead)])
            pool = coordinator.jobs.pool
            assert await pool.healthy() == []
            metrics = scrape_text(coordinator.metrics_port)
            stack = Stack(services, [aggregator], coordinator)
            job_id, _ = await stack.run_job(spec("no-aggregator", 1, 5).replace("retries: 3", "retries: 0"),
                                            [SyntheticUpdates(f"sim-{i:05d}", 0) for i in range(5)])
            return aggregator.port, pool.unusable(), metrics, (await stack.job(job_id)).message

    device_port, unusable, metrics, message = run(main())
    assert unusable["agg-1"] == f"127.0.0.1:{device_port} does not serve AggregatorControl: {DEVICE_PORT}"
    assert unusable["agg-2"].startswith("health check: UNAVAILABLE")
    downs = {r.fields["aggregator_id"]: r.fields["reason"] for r in caplog.records
             if r.getMessage() == "aggregator down"}
    assert downs == unusable  # each configured aggregator's state, logged as the coordinator starts
    assert 'tally_coordinator_aggregator_up{aggregator="agg-1"} 0.0' in metrics
    assert 'tally_coordinator_aggregator_up{aggregator="agg-2"} 0.0' in metrics
    assert "cannot form cohorts: no healthy aggregator; aggregators not used: " in message
    assert f"agg-1: {unusable['agg-1']}" in message and f"agg-2: {unusable['agg-2']}" in message
