"""``tally fleet --processes`` (issue 8): the sub-shards of P processes tile their shard exactly,
statistics of several processes combine into the fleet's, the default follows the cores this
process may use, and a SIGTERM to the parent ends every process cleanly with merged statistics."""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from tally.cli.fleet_run import _block
from tally.loadtest.fleet import FleetStats
from tally.loadtest.processes import DEVICES_PER_EXTRA_PROCESS, _part, available_cores, default_processes
from tally.ops.cluster import ProcessCluster, wait_for


def _args(devices: int, shard: tuple[int, int]) -> argparse.Namespace:
    return argparse.Namespace(devices=devices, shard=shard, audit_out=None, audit_token_file=None,
                              synthetic=True, metrics_port=9400, progress=True, json=None, processes=None,
                              report=None)


@settings(max_examples=60, deadline=None)
@given(devices=st.integers(1, 100_000), shards=st.integers(1, 8), processes=st.integers(1, 16), data=st.data())
def test_the_blocks_of_a_shards_processes_tile_it_exactly(devices, shards, processes, data):
    shard = data.draw(st.integers(0, shards - 1))
    first, end = _block(devices, shard, shards)
    parts = [_part(_args(devices, (shard, shards)), processes, p, Path("/nonexistent")) for p in range(processes)]
    blocks = [_block(devices, *part.shard) for part in parts]
    covered = [i for lo, hi in blocks for i in range(lo, hi)] if end - first < 5000 else None
    assert blocks[0][0] == first and blocks[-1][1] == end
    assert all(a[1] == b[0] for a, b in zip(blocks, blocks[1:]))  # contiguous, in order, no overlap
    if covered is not None:
        assert covered == list(range(first, end))
    assert [part.metrics_port for part in parts] == [9400 + p for p in range(processes)]
    assert all(part.processes == 1 and not part.progress and part.audit_out is not None for part in parts)


def _stats(devices: int, rounds: dict, jobs: list, version: str = "", over: bool = True) -> FleetStats:
    return FleetStats(devices=devices, checkins=2 * devices, tasks_done=devices, sessions_completed=devices,
                      sessions_aborted=1, dropouts=1, bytes_up=100 * devices, bytes_down=10, retries=0,
                      clipped_values=0, last_model_version=version, rounds=rounds, elapsed_seconds=float(devices),
                      jobs=jobs, last_error="", jobs_over=over)


def test_statistics_of_several_processes_combine_into_the_fleets():
    combined = FleetStats.combine([
        _stats(3, {"a": [1, 2]}, ["a"], "v2"),
        _stats(5, {"a": [2, 3], "b": [1]}, ["a", "b"], over=False),
    ])
    assert (combined.devices, combined.checkins, combined.bytes_up, combined.sessions_aborted) == (8, 16, 800, 2)
    assert combined.rounds == {"a": [1, 2, 3], "b": [1]} and combined.jobs == ["a", "b"]
    assert combined.elapsed_seconds == 5.0 and combined.last_model_version == "v2"
    assert not combined.jobs_over  # one process still sees a job running


def test_the_default_is_one_process_per_core_with_enough_devices_for_each():
    cores = available_cores()
    assert cores >= 1
    assert default_processes(DEVICES_PER_EXTRA_PROCESS - 1) == 1
    assert default_processes(10**6) == cores
    assert default_processes(2 * DEVICES_PER_EXTRA_PROCESS) == min(cores, 2)


def _checkins(exposition: str) -> float:
    return sum(sample.value for family in text_string_to_metric_families(exposition)
               for sample in family.samples if sample.name == "tally_coordinator_checkins_total")


@pytest.mark.parametrize("processes, sig", [(2, signal.SIGTERM), (1, signal.SIGINT)])
def test_a_signal_to_a_fleet_ends_it_cleanly_with_merged_statistics(tmp_path, processes, sig):
    """SIGTERM, or Ctrl-C's SIGINT, ends every process with its statistics and exit code 0, and
    nothing on stderr but log lines: no traceback, no "exception was never retrieved"."""
    async def main():
        cluster = ProcessCluster(tmp_path / "cluster", aggregators=1)
        try:
            await cluster.start()
            argv = [sys.executable, "-m", "tally.cli", "fleet", "--coordinator", cluster.target,
                    "--tls-dir", str(cluster.certs / "device"), "--devices", "6", "--synthetic",
                    "--no-progress", "--stay", "--processes", str(processes), "--json", str(tmp_path / "fleet.json"),
                    "--enrolment-key", str(cluster.certs / "coordinator" / "enrolment.key")]
            fleet = await asyncio.create_subprocess_exec(*argv, stderr=subprocess.PIPE)

            async def checked_in() -> bool:  # every device of both processes has checked in
                return _checkins(await asyncio.to_thread(cluster.scrape, "coordinator")) >= 6

            assert await wait_for(checked_in, timeout=60), "the fleet's devices never all checked in"
            fleet.send_signal(sig)
            _, stderr = await asyncio.wait_for(fleet.communicate(), 60)
            return fleet.returncode, stderr.decode()
        finally:
            await cluster.stop()

    code, stderr = asyncio.run(main())
    assert code == 0, stderr
    assert "Traceback" not in stderr and "never retrieved" not in stderr, stderr
    report = json.loads((tmp_path / "fleet.json").read_text())
    assert report["devices"] == 6 and report["checkins"] >= 6, report
