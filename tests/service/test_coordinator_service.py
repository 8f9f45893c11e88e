"""The coordinator service over real gRPC on 127.0.0.1 with fake aggregators and scripted devices
(support.coordinator): rounds against the in-process reference, holds and selections, chunked
downloads, the device and admin APIs, restarts, retries, deadlines, TLS and the command line."""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import stat
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import grpc
import numpy as np
import onnxruntime as ort
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from support.coordinator import (
    CANCELLED,
    FAILED,
    FRAC_BITS,
    SUCCEEDED,
    CoordinatorStack,
    FakeDevice,
    FixedTrainer,
    committed_model,
    fedavg_bound,
    fedavg_contribution,
    reference_model,
    run,
    run_devices,
    spec_yaml,
)
from support.enrolment import provisioned_request
from support.stack import in_process, scrape_text
from tally.algorithms.fedavg import FedAvgOptions
from tally.cli import coordinator as coordinator_cli
from tally.coordinator.rounds.planner import (
    MIN_RETRY_S,
    Phase,
    Selection,
)
from tally.coordinator.rounds.runner import RETRY_BACKOFF_FIRST_S
from tally.models.mlp import mlp
from tally.models.params import get_params, set_params
from tally.security import (
    TicketVerifier,
    TLSConfig,
    bearer_metadata,
    certs,
    channel_credentials,
    channel_options,
    load_or_create_ticket_key,
)
from tally.security.tls import tls_config_from_args
from tally.wire.tensors import tensors_from_proto
from tally.wire.v1 import (
    admin_pb2,
    common_pb2,
    coordinator_pb2,
    coordinator_pb2_grpc,
)


def test_fedavg_over_two_aggregators_matches_the_in_process_reference(tmp_path):
    options = FedAvgOptions(local_epochs=1)
    rounds = 3

    async def main():
        async with in_process().coordinator_with_fakes(tmp_path, aggregators=2) as s:
            devices = await s.devices(10)
            job_id = await s.submit(spec_yaml("fidelity", rounds=rounds))
            watch = asyncio.create_task(s.until_done(job_id))
            seen: dict[str, Any] = {}
            first_round = asyncio.Event()

            async def before(device, task):
                # Round 1: every device holds its task until the late-comers were turned away.
                if task.round == 1 and not first_round.is_set():
                    seen[device.device_id] = task
                    if len(seen) == len(devices):
                        late = (await s.devices(1, prefix="late"))[0]
                        # Held for round 2 while round 1 aggregates, until its hold ends.
                        seen["late"] = await late.check_in_once(timeout=1.5)
                        seen["again"] = await device.check_in_once()
                        first_round.set()
                    await first_round.wait()

            events = await run_devices(devices, fedavg_contribution(options), watch, before)
            final_job = await s.job(job_id)
            metrics = scrape_text(s.service.metrics_port)
            status = await devices[0].stub.RoundStatus(
                coordinator_pb2.RoundStatusRequest(job_id=job_id), metadata=devices[0].md, timeout=5
            )
            model, round_rows = committed_model(s.service.store, job_id)
        return events, seen, final_job, metrics, status, model, round_rows

    events, seen, final_job, metrics, status, model, round_rows = run(main())
    # Over-selection target reached: nobody else gets in (a late-comer is held for the next
    # round's selection, and told to come back when its hold ends), and nobody gets two seats.
    assert seen["late"].retry_after.reason == "next selection not open yet"
    assert 0.2 <= seen["late"].retry_after.seconds <= 60
    assert seen["again"].retry_after.reason == "already assigned"
    tasks = [t for k, t in seen.items() if k.startswith("dev")]
    assert len({t.aggregator_address for t in tasks}) == 2  # two cohorts, one per aggregator
    assert sorted((t.aggregator_address, t.device_index) for t in tasks) == sorted(
        (a, i) for a in {t.aggregator_address for t in tasks} for i in range(1, 6)
    )
    assert all(t.session.min_survivors >= 5 and t.chunk_size == 1 << 20 for t in tasks)
    assert all(t.algorithm == "fedavg" and '"local_epochs": 1' in t.algorithm_options for t in tasks)

    assert final_job.state == SUCCEEDED and final_job.committed_round == rounds
    assert events[-1].state == SUCCEEDED
    commits = [e for e in events if e.phase == common_pb2.ROUND_PHASE_COMMITTED]
    assert [e.round for e in commits] == [1, 2, 3] and all(e.metrics["update.contributors"] == 10 for e in commits)
    assert status.job_state == SUCCEEDED and status.committed_round == rounds

    assert [(r.round, r.state) for r in round_rows] == [(1, "committed"), (2, "committed"), (3, "committed")]
    assert all(r.metrics["update.contributors"] == 10 and r.metrics["cohorts"] == 2 for r in round_rows)
    assert all(r.metrics["update.examples"] == sum(40 + 10 * i for i in range(10)) for r in round_rows)
    trainers = [FixedTrainer(i, 40 + 10 * i) for i in range(10)]
    expected = reference_model(get_params(mlp(64, 10, 8)), trainers, rounds, options)
    error = max(float(np.abs(model[k].astype(np.float64) - expected[k]).max()) for k in expected)
    assert 0 < error <= fedavg_bound(trainers, options, rounds, 0.05), error

    assert "tally_coordinator_rounds_committed_total 3.0" in metrics
    assert 'tally_coordinator_checkins_total{outcome="task"} 30.0' in metrics
    assert "tally_coordinator_devices_selected_total 30.0" in metrics
    assert 'tally_coordinator_cohort_sums_total{outcome="accepted"} 6.0' in metrics
    assert "tally_coordinator_aggregators_up 2.0" in metrics
    assert "tally_coordinator_round_duration_seconds_count 3.0" in metrics
    assert "tally_coordinator_model_served_bytes_total" in metrics


async def until_true(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    """Wait for a condition of the in-process coordinator (polled; bounded)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


def test_check_ins_during_aggregation_are_seated_when_the_next_round_opens(tmp_path):
    """Devices that check in while a round aggregates are held and become the next round's
    selection the moment it opens, without checking in again; a device whose hold ends leaves;
    the last round holds nobody."""
    contribute = fedavg_contribution(FedAvgOptions(local_epochs=1))

    async def main():
        async with in_process().coordinator_with_fakes(tmp_path, aggregators=1) as s:
            first = await s.devices(5, prefix="first")
            later = await s.devices(5, prefix="next")
            leaver = (await s.devices(1, prefix="leaver"))[0]
            job_id = await s.submit(spec_yaml("overlap", rounds=2, cohort=5))
            watch = asyncio.create_task(s.until_done(job_id))
            runner = s.service.jobs.runner(job_id)
            release, all_in = asyncio.Event(), asyncio.Event()
            round_one: set[str] = set()

            async def before(device, task):
                if task.round == 1:  # round 1 aggregates until the test releases it
                    round_one.add(device.device_id)
                    if len(round_one) == len(first):
                        all_in.set()
                    await release.wait()

            done = asyncio.Event()
            loops = [asyncio.create_task(d.loop(contribute, done, before)) for d in first]
            await all_in.wait()
            left = await leaver.check_in_once(timeout=1.5)  # held 0.5 s, then its hold ends
            held = [asyncio.create_task(d.check_in_once(timeout=30)) for d in later]
            await until_true(lambda: runner.holds.waiting is not None and len(runner.holds.waiting.held) == len(later))
            release.set()
            replies = await asyncio.gather(*held)  # the one check-in each made, during round 1
            in_last_round = await leaver.check_in_once(timeout=30)
            await asyncio.gather(*(d.participate(r.task, contribute) for d, r in zip(later, replies)
                                   if r.HasField("task")))
            events = await watch
            done.set()
            await asyncio.gather(*loops)
            metrics = scrape_text(s.service.metrics_port)
        return left, replies, in_last_round, events, metrics

    left, replies, in_last_round, events, metrics = run(main())
    assert left.retry_after.reason == "next selection not open yet"
    assert all(r.HasField("task") and r.task.round == 2 for r in replies), replies
    assert sorted(r.task.device_index for r in replies) == [1, 2, 3, 4, 5]  # the whole cohort
    assert in_last_round.retry_after.reason == "selection closed"
    assert events[-1].state == SUCCEEDED
    commits = [e for e in events if e.phase == common_pb2.ROUND_PHASE_COMMITTED]
    assert [(e.round, e.metrics["update.contributors"]) for e in commits] == [(1, 5), (2, 5)]
    assert "tally_coordinator_devices_seated_early_total 5.0" in metrics


def test_a_device_whose_hold_ends_as_its_cohort_forms_comes_back_at_once_for_its_task(tmp_path):
    """Held devices answer before their caller's deadline. One whose hold ends after the selection
    closed with it (sessions still opening) keeps its seat: it is told to come back at once, and
    pace steering, which would send it behind the whole population, leaves that answer alone."""

    async def main():
        async with in_process().coordinator_with_fakes(tmp_path, aggregators=1, checkin_rate=0.5) as s:
            devices = await s.devices(5)
            gate = s.aggregators[0].open_gate = asyncio.Event()
            job_id = await s.submit(spec_yaml("late-hold", rounds=1, cohort=5))
            runner = s.service.jobs.runner(job_id)
            await until_true(lambda: runner.planner is not None)
            replies = await asyncio.gather(*(d.check_in_once(timeout=2.0) for d in devices))
            opening = runner.planner.phase
            gate.set()
            again = await asyncio.gather(*(d.check_in_once(timeout=5.0) for d in devices))
            await s.admin.CancelJob(admin_pb2.CancelJobRequest(job_id=job_id), metadata=s.admin_md, timeout=5)
        return replies, opening, again

    replies, opening, again = run(main())
    assert opening is Phase.OPENING  # every hold ended while the session was opening
    assert [(r.retry_after.reason, r.retry_after.seconds) for r in replies] == [
        ("seated: come back for the task", MIN_RETRY_S)] * 5
    assert sorted(r.task.device_index for r in again) == [1, 2, 3, 4, 5]


async def held_for_round_two(
    s: CoordinatorStack, first: list[FakeDevice], later: list[FakeDevice], **job
) -> tuple[str, asyncio.Event, list]:
    """A two-round job whose round 1 aggregates (its devices wait for the returned event) while
    each of ``later`` is held for round 2 by one check-in (the returned tasks answer them)."""
    contribute = fedavg_contribution(FedAvgOptions(local_epochs=1))
    job_id = await s.submit(spec_yaml("overlap", rounds=2, cohort=len(first), **job))
    runner = s.service.jobs.runner(job_id)
    release, all_in = asyncio.Event(), asyncio.Event()
    round_one: set[str] = set()

    async def before(device, task):
        round_one.add(device.device_id)
        if len(round_one) == len(first):
            all_in.set()
        await release.wait()

    for d in first:
        asyncio.create_task(d.loop(contribute, release, before))
    await all_in.wait()
    held = [asyncio.create_task(d.check_in_once(timeout=30)) for d in later]
    await until_true(lambda: runner.holds.waiting is not None and len(runner.holds.waiting.held) == len(later))
    return job_id, release, held


def test_devices_held_for_a_jobs_next_round_are_let_go_when_another_jobs_selection_opens(tmp_path):
    async def main():
        async with in_process().coordinator_with_fakes(tmp_path, aggregators=1, checkin_rate=0.5) as s:
            first, later = await s.devices(5, prefix="first"), await s.devices(5, prefix="next")
            _, release, held = await held_for_round_two(s, first, later)
            job_b = await s.submit(spec_yaml("newer", rounds=1, cohort=5))
            replies = await asyncio.gather(*held)
            release.set()
        return job_b, replies

    job_b, replies = run(main())
    assert [(r.retry_after.reason, r.retry_after.seconds) for r in replies] == [
        (f"job {job_b} is selecting", MIN_RETRY_S)] * 5  # at once: pace steering (0.5/s) left them alone


def test_devices_held_during_an_attempt_that_fails_are_seated_by_its_retry(tmp_path):
    async def main():
        async with in_process().coordinator_with_fakes(tmp_path, aggregators=2) as s:
            first, later = await s.devices(5, prefix="first"), await s.devices(5, prefix="next")
            _, release, held = await held_for_round_two(s, first, later)
            serving = next(a for a in s.aggregators if a.sessions)
            await serving.stop()  # attempt 1 of round 1 fails while the five are held
            replies = await asyncio.gather(*held)
            release.set()
        return replies

    replies = run(main())
    assert all(r.HasField("task") and r.task.round == 1 for r in replies), replies
    assert {r.task.task_id.split("-")[0] for r in replies} == {"r1a2"}  # round 1's second attempt


def test_a_job_that_ends_answers_its_held_devices_and_holds_no_more(tmp_path):
    async def main():
        async with in_process().coordinator_with_fakes(tmp_path, aggregators=1) as s:
            first, later = await s.devices(5, prefix="first"), await s.devices(5, prefix="next")
            job_id, release, held = await held_for_round_two(s, first, later[:4])  # room for one more
            gate = s.aggregators[0].close_gate = asyncio.Event()  # the job's last act waits here
            cancel = asyncio.ensure_future(s.admin.CancelJob(
                admin_pb2.CancelJobRequest(job_id=job_id), metadata=s.admin_md, timeout=10))
            replies = await asyncio.gather(*held)
            during_close = await later[4].check_in_once(timeout=30)
            gate.set()
            await cancel
            release.set()
        return replies, during_close

    replies, during_close = run(main())
    assert [r.retry_after.reason for r in replies] == ["job is not running"] * 4
    assert during_close.HasField("retry_after") and during_close.retry_after.reason != "next selection not open yet"


def test_two_step_rounds_broadcast_the_first_sum_of_every_cohort(tmp_path, twostep):
    losses = {f"dev{i}": 0.1 * (i + 1) for i in range(10)}

    def contribute(device, step, broadcast):
        if step == "stats":
            return {"loss": losses[device.device_id], "count": 1}
        dim = 64 * 4 + 4 + 4 * 10 + 10
        scale = float(broadcast["mean_loss"]) * (1 + int(device.device_id[3:])) / 100
        return {"delta": np.full(dim, scale), "weight": 1}

    async def main():
        async with in_process().coordinator_with_fakes(tmp_path, aggregators=2) as s:
            devices = await s.devices(10, trainers=False)
            job_id = await s.submit(
                "name: two\nalgorithm: twostep\nrounds: 1\ncohort_size: 10\nover_selection: 1.0\nmin_cohort: 5\n"
                # Scripted payloads: no metric fields.
                "model: {inputs: 64, classes: 10, hidden: 4}\nevaluation: {enabled: false}\n"
            )
            tasks = await asyncio.gather(*(d.task() for d in devices))
            assert all([s.sum_id for s in t.session.sums] == ["stats", "update"] for t in tasks)
            assert all(len(t.step.broadcast) == 0 and t.step.sum_id == "stats" for t in tasks)
            # Nine devices send their first sum; the second step's broadcast must wait for all.
            for d, t in zip(devices[:9], tasks[:9]):
                await d.send(t, t.step, contribute(d, "stats", {}))
            early = await devices[0].stub.GetStep(
                coordinator_pb2.GetStepRequest(job_id=job_id, round=1, task_id=tasks[0].task_id, sum_id="update"),
                metadata=devices[0].md, timeout=5,
            )
            assert early.HasField("retry_after") and "'stats' of every cohort" in early.retry_after.reason
            # Then the last one, and everyone runs the second step.
            watch = asyncio.create_task(s.until_done(job_id))
            await devices[9].send(tasks[9], tasks[9].step, contribute(devices[9], "stats", {}))
            broadcasts = []
            for d, t in zip(devices, tasks):
                step = await d.step(t, "update")
                broadcasts.append(tensors_from_proto(step.broadcast))
                await d.send(t, step, contribute(d, "update", broadcasts[-1]))
            events = await watch
            model, rows = committed_model(s.service.store, job_id)
        return broadcasts, events, model, rows

    broadcasts, events, model, rows = run(main())
    mean_loss = sum(losses.values()) / 10
    assert all(abs(float(b["mean_loss"]) - mean_loss) <= 10 * 2.0 ** -FRAC_BITS for b in broadcasts)
    assert events[-1].state == SUCCEEDED and rows[0].metrics["stats.contributors"] == 10
    initial = get_params(mlp(64, 10, 4))
    shift = mean_loss * np.mean([(1 + i) / 100 for i in range(10)])
    for k in initial:
        assert np.abs(model[k] - (initial[k] + shift)).max() <= 1e-5


def test_large_model_downloads_in_chunks_and_exports_to_onnx(tmp_path):
    options = FedAvgOptions(local_epochs=1)
    hidden = 20_000  # 1.5 M parameters: a 6 MB model, above gRPC's default 4 MiB message limit

    async def main():
        async with in_process().coordinator_with_fakes(tmp_path, aggregators=1) as s:
            devices = await s.devices(5)
            job_id = await s.submit(spec_yaml("big", cohort=5, hidden=hidden))
            tasks = await asyncio.gather(*(d.task() for d in devices))
            first = tasks[0]
            blob, chunks = await devices[0].download(first.model_digest)
            tail, resumed = await devices[0].download(first.model_digest, offset=len(blob) // 2 + 7)
            errors = {}
            for name, request in {
                "unknown": coordinator_pb2.DownloadModelRequest(digest="0" * 64),
                "malformed": coordinator_pb2.DownloadModelRequest(digest="xyz"),
                "no digest": coordinator_pb2.DownloadModelRequest(model_version="v0"),
                "negative": coordinator_pb2.DownloadModelRequest(digest=first.model_digest, offset=-1),
                "beyond": coordinator_pb2.DownloadModelRequest(digest=first.model_digest, offset=len(blob) + 1),
                "no version": coordinator_pb2.DownloadModelRequest(model_version="v9.onnx"),
                "bad name": coordinator_pb2.DownloadModelRequest(model_version="best.onnx"),
                "mismatch": coordinator_pb2.DownloadModelRequest(model_version="latest.onnx", digest="0" * 64),
                "other job": coordinator_pb2.DownloadModelRequest(model_version="someone-else/v0.onnx"),
            }.items():
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    [c async for c in devices[0].stub.DownloadModel(request, metadata=devices[0].md, timeout=5)]
                errors[name] = err.value.code()
            watch = asyncio.create_task(s.until_done(job_id))
            await asyncio.gather(*(d.participate(t, fedavg_contribution(options)) for d, t in zip(devices, tasks)))
            events = await watch
            latest, _ = await devices[0].download(version="latest.onnx")
            by_name, _ = await devices[0].download(version=f"{job_id}/v1.onnx")
            initial_onnx, _ = await devices[0].download(version="v0.onnx")
            model, _ = committed_model(s.service.store, job_id)
        return blob, chunks, tail, resumed, errors, events, latest, by_name, initial_onnx, model, first

    blob, chunks, tail, resumed, errors, events, latest, by_name, initial_onnx, model, first = run(main())
    assert len(blob) > 4 << 20 and hashlib.sha256(blob).hexdigest() == first.model_digest
    assert len(chunks) == -(-len(blob) // first.chunk_size) and all(len(c.data) <= first.chunk_size for c in chunks)
    assert [c.offset for c in chunks] == [i * first.chunk_size for i in range(len(chunks))]
    assert all(c.total_size == len(blob) and c.digest == first.model_digest for c in chunks)
    assert tail == blob[len(blob) // 2 + 7:] and resumed[0].offset == len(blob) // 2 + 7
    assert errors == {
        "unknown": grpc.StatusCode.NOT_FOUND, "malformed": grpc.StatusCode.INVALID_ARGUMENT,
        "no digest": grpc.StatusCode.INVALID_ARGUMENT, "negative": grpc.StatusCode.INVALID_ARGUMENT,
        "beyond": grpc.StatusCode.OUT_OF_RANGE, "no version": grpc.StatusCode.NOT_FOUND,
        "bad name": grpc.StatusCode.NOT_FOUND, "mismatch": grpc.StatusCode.FAILED_PRECONDITION,
        "other job": grpc.StatusCode.NOT_FOUND,
    }
    assert events[-1].state == SUCCEEDED
    assert latest == by_name and latest != initial_onnx
    net = mlp(64, 10, hidden)
    set_params(net, model)
    x = np.random.default_rng(0).normal(size=(4, 64)).astype(np.float32)
    onnx_out = ort.InferenceSession(latest).run(None, {"input": x})[0]
    with torch.no_grad():
        assert np.abs(onnx_out - net(torch.from_numpy(x)).numpy()).max() < 1e-4


async def status_of(call) -> tuple[grpc.StatusCode, str]:
    """The gRPC status a call ends with (OK when it succeeds)."""
    try:
        await call
    except grpc.aio.AioRpcError as exc:
        return exc.code(), exc.details()
    return grpc.StatusCode.OK, ""


def test_device_calls_without_a_valid_token_or_with_bad_input_get_clear_statuses(tmp_path):
    async def main():
        async with in_process().coordinator_with_fakes(tmp_path, aggregators=1) as s:
            stub, pb = s.device_stub, coordinator_pb2
            device = (await s.devices(1))[0]
            forged = bearer_metadata(device.token[:-4] + "AAAA")
            unauthenticated = [
                stub.CheckIn(pb.CheckInRequest(), timeout=5),
                stub.CheckIn(pb.CheckInRequest(), metadata=forged, timeout=5),
                stub.RoundStatus(pb.RoundStatusRequest(job_id="x"), timeout=5),
                stub.GetStep(pb.GetStepRequest(job_id="x"), timeout=5),
                stub.DownloadModel(pb.DownloadModelRequest(digest="0" * 64), timeout=5).read(),
            ]
            codes = [await status_of(call) for call in unauthenticated]
            assert all(code == grpc.StatusCode.UNAUTHENTICATED for code, _ in codes), codes
            assert "signature invalid" in codes[1][1]
            code, _ = await status_of(stub.Register(pb.RegisterRequest(population="p"), timeout=5))
            assert code == grpc.StatusCode.INVALID_ARGUMENT
            for call in (stub.RoundStatus(pb.RoundStatusRequest(job_id="x"), metadata=device.md, timeout=5),
                         stub.GetStep(pb.GetStepRequest(job_id="x", round=1), metadata=device.md, timeout=5)):
                assert (await status_of(call))[0] == grpc.StatusCode.NOT_FOUND
            idle = await device.check_in_once()
            assert idle.retry_after.reason.startswith("no running job") and 0.2 <= idle.retry_after.seconds <= 60

            # A held check-in answers before the device's own deadline instead of timing out.
            await s.submit(spec_yaml("waiting", population="nobody"))
            impatient = (await s.devices(1, trainers=False, prefix="impatient", population="nobody"))[0]
            while True:
                started = time.monotonic()
                held = await impatient.check_in_once(timeout=1.5)
                if held.retry_after.reason != "next round starting":  # the job was still starting
                    break
            assert held.retry_after.reason == "selection still open" and 0.3 < time.monotonic() - started < 1.5

            reply = await health_pb2_grpc.HealthStub(s.channel).Check(
                health_pb2.HealthCheckRequest(service="tally.v1.Coordinator"), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            reflected = reflection_pb2_grpc.ServerReflectionStub(s.channel).ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)
            services = {svc.name async for answer in reflected for svc in answer.list_services_response.service}
            assert {"tally.v1.Coordinator", "tally.v1.Admin", "grpc.health.v1.Health"} <= services

    run(main())


def test_admin_api_needs_its_token_and_validates_submit_list_cancel_watch(tmp_path):
    async def main():
        async with in_process().coordinator_with_fakes(tmp_path, aggregators=1) as s:
            admin, md = s.admin, s.admin_md
            device = (await s.devices(1))[0]
            assert stat.S_IMODE((s.state_dir / "admin.token").stat().st_mode) == 0o600
            for metadata in (None, device.md):  # no token; a device's token
                code, _ = await status_of(admin.ListJobs(admin_pb2.ListJobsRequest(), metadata=metadata, timeout=5))
                assert code == grpc.StatusCode.UNAUTHENTICATED

            bad = "name: x\nalgorithm: nope\nrounds: 0\ncohort_size: 10\nbogus: 1\n"
            call = admin.SubmitJob(admin_pb2.SubmitJobRequest(spec_yaml=bad), metadata=md, timeout=5)
            code, details = await status_of(call)
            assert code == grpc.StatusCode.INVALID_ARGUMENT
            assert all(w in details for w in ("unknown keys ['bogus']", "algorithm: 'nope'", "rounds: must be"))
            for call in (admin.SubmitJob(admin_pb2.SubmitJobRequest(spec_yaml="a: [1"), metadata=md, timeout=5),
                         admin.SubmitJob(admin_pb2.SubmitJobRequest(), metadata=md, timeout=5),
                         admin.ListJobs(admin_pb2.ListJobsRequest(page_token="x"), metadata=md, timeout=5)):
                assert (await status_of(call))[0] == grpc.StatusCode.INVALID_ARGUMENT
            code, _ = await status_of(admin.GetJob(admin_pb2.GetJobRequest(job_id="nope"), metadata=md, timeout=5))
            assert code == grpc.StatusCode.NOT_FOUND

            request = admin_pb2.SubmitJobRequest()  # the same spec as a struct: numbers arrive as doubles
            request.spec_struct.update({"name": "structured", "algorithm": "fedavg", "rounds": 2,
                                        "cohort_size": 5, "population": "nobody", "retries": 0})
            structured = await admin.SubmitJob(request, metadata=md, timeout=5)
            assert structured.algorithm == "fedavg" and "rounds: 2" in structured.spec_yaml
            second = await s.submit(spec_yaml("second", population="nobody"))
            page = await admin.ListJobs(admin_pb2.ListJobsRequest(page_size=1), metadata=md, timeout=5)
            rest = await admin.ListJobs(
                admin_pb2.ListJobsRequest(page_size=1, page_token=page.next_page_token), metadata=md, timeout=5)
            assert [j.job_id for j in page.jobs] == [structured.job_id] and [j.job_id for j in rest.jobs] == [second]
            assert rest.next_page_token == ""

            watch = asyncio.create_task(s.until_done(structured.job_id))
            cancelled = await admin.CancelJob(
                admin_pb2.CancelJobRequest(job_id=structured.job_id, reason="test"), metadata=md, timeout=5)
            assert cancelled.state == CANCELLED and "test" in cancelled.message
            assert (await watch)[-1].state == CANCELLED  # the watch stream ends with the job
            for job_id, expected in ((structured.job_id, grpc.StatusCode.FAILED_PRECONDITION),
                                     ("nope", grpc.StatusCode.NOT_FOUND)):
                call = admin.CancelJob(admin_pb2.CancelJobRequest(job_id=job_id), metadata=md, timeout=5)
                assert (await status_of(call))[0] == expected
            active = [common_pb2.JOB_STATE_PENDING, common_pb2.JOB_STATE_RUNNING]
            running = await admin.ListJobs(admin_pb2.ListJobsRequest(states=active), metadata=md, timeout=5)
            assert [j.job_id for j in running.jobs] == [second]

    run(main())


def test_restarted_coordinator_resumes_at_the_next_round(tmp_path):
    options = FedAvgOptions(local_epochs=1)
    rounds = 3

    async def main():
        async with in_process().coordinator_with_fakes(tmp_path, aggregators=1) as s:
            devices = await s.devices(6)
            # The interrupted attempt's devices may not be seated again in round 2, not even by a
            # restarted coordinator: six spares with the same data take round 2 and then stop,
            # so every round still sums the same six contributions.
            spares = await s.devices(6, prefix="spare")
            job_id = await s.submit(spec_yaml("resume", rounds=rounds, cohort=6))
            release = asyncio.Event()
            held = []
            all_held = asyncio.Event()
            spare_done = {d.device_id: asyncio.Event() for d in spares}
            seated: dict[tuple[int, str], set[str]] = defaultdict(set)  # (round, attempt key) -> devices

            async def before(device, task):
                seated[task.round, task.task_id.split(".")[0]].add(device.device_id)
                if device.device_id in spare_done:
                    spare_done[device.device_id].set()  # its loop ends after this task
                elif task.round == 2 and not release.is_set():
                    held.append(device.device_id)
                    if len(held) == len(devices):
                        all_held.set()
                    await release.wait()

            done = asyncio.Event()
            loops = [asyncio.create_task(d.loop(fedavg_contribution(options), done, before)) for d in devices]
            await all_held.wait()  # round 1 committed; round 2's sessions open and waiting
            await s.restart()
            mid = s.service.store.job(job_id)
            loops += [
                asyncio.create_task(d.loop(fedavg_contribution(options), spare_done[d.device_id], before))
                for d in spares
            ]
            release.set()
            events = await s.until_done(job_id)
            done.set()
            await asyncio.gather(*loops)
            model, rows = committed_model(s.service.store, job_id)
            versions = [s.service.store.model_version(job_id, r) for r in range(rounds + 1)]
            closed = [sess.closed for sess in s.aggregators[0].sessions.values()]
        return mid, events, model, rows, versions, closed, seated

    mid, events, model, rows, versions, closed, seated = run(main())
    round_two = [devices for (round_, _), devices in seated.items() if round_ == 2]
    assert sorted(sorted(d) for d in round_two) == [
        [f"dev{i}" for i in range(6)], [f"spare{i}" for i in range(6)]
    ]
    assert mid.committed_round == 1 and mid.state == "RUNNING"
    assert events[-1].state == SUCCEEDED
    committed = [(r.round, r.attempt) for r in rows if r.state == "committed"]
    assert [r for r, _ in committed] == [1, 2, 3]  # none lost, none repeated
    interrupted = [r for r in rows if r.state == "failed"]
    assert [(r.round, r.message) for r in interrupted] == [(2, "interrupted: coordinator stopped")]
    assert all(v is not None and v.state_digest and v.onnx_digest for v in versions)
    assert sum(c is not None for c in closed) >= 1  # the interrupted session was closed
    trainers = [FixedTrainer(i, 40 + 10 * i) for i in range(6)]
    expected = reference_model(get_params(mlp(64, 10, 8)), trainers, rounds, options)
    error = max(float(np.abs(model[k].astype(np.float64) - expected[k]).max()) for k in expected)
    assert error <= fedavg_bound(trainers, options, rounds, 0.05), error


@pytest.mark.parametrize("failure", ["killed", "aborted"])
def test_failed_cohort_round_is_retried_and_the_job_goes_on(tmp_path, failure):
    options = FedAvgOptions(local_epochs=1)

    async def main():
        async with in_process().coordinator_with_fakes(tmp_path, aggregators=2) as s:
            # Twice the cohort: a retry never seats a device the failed attempt seated.
            devices = await s.devices(20)
            job_id = await s.submit(spec_yaml("failover", rounds=2))
            victim = s.aggregators[1]
            ready = asyncio.Event()

            async def fail():
                await victim.opened.wait()
                await s.aggregators[0].opened.wait()
                if failure == "killed":
                    await victim.stop()  # mid-round: its AwaitResult breaks, its health check fails
                else:
                    victim.aborts.append("too few survivors: 4 < 5")  # once; then it works again
                ready.set()

            async def before(device, task):
                await ready.wait()

            failer = asyncio.create_task(fail())
            events = await run_devices(devices, fedavg_contribution(options), s.until_done(job_id), before)
            await failer
            metrics = scrape_text(s.service.metrics_port)
            _, rows = committed_model(s.service.store, job_id)
        return events, rows, metrics

    events, rows, metrics = run(main())
    assert events[-1].state == SUCCEEDED
    failed = [r for r in rows if r.state == "failed"]
    assert len(failed) == 1 and failed[0].round == 1 and "aggregator agg1" in failed[0].message
    assert [r.round for r in rows if r.state == "committed"] == [1, 2]
    # The retry backed off before it began (issue 25: retries ran back to back, the budget spent in 5 s).
    [retry] = [r for r in rows if r.round == 1 and r.attempt == failed[0].attempt + 1]
    assert retry.started_at - failed[0].finished_at >= RETRY_BACKOFF_FIRST_S
    assert any(e.phase == common_pb2.ROUND_PHASE_FAILED and "agg1" in e.message for e in events)
    assert "tally_coordinator_rounds_retried_total 1.0" in metrics
    cohorts = [r.metrics["cohorts"] for r in rows if r.state == "committed"]
    if failure == "killed":
        assert cohorts == [1, 1] and "tally_coordinator_aggregators_up 1.0" in metrics  # all on agg0
    else:
        assert "session aborted: too few survivors: 4 < 5" in failed[0].message
        assert cohorts == [2, 2] and 'tally_coordinator_cohort_sums_total{outcome="aborted"} 1.0' in metrics


def test_exhausted_retries_fail_the_job_with_the_reason(tmp_path):
    async def main():
        async with in_process().coordinator_with_fakes(tmp_path, aggregators=2) as s:
            for fake in s.aggregators:
                fake.abort_reason = "too few survivors: 3 < 5"
            devices = await s.devices(20)  # the retry's cohort is other devices
            aborting = await s.submit(spec_yaml("aborts", extra="retries: 1\n"))
            events = await run_devices(devices, fedavg_contribution(FedAvgOptions()), s.until_done(aborting))
            extra = "retries: 1\ndeadlines: {checkin: 0.2}\n"
            lonely = await s.submit(spec_yaml("lonely", population="empty", extra=extra))
            lonely_events = await s.until_done(lonely)
            jobs = [await s.job(aborting), await s.job(lonely)]
            metrics = scrape_text(s.service.metrics_port)
        return events, lonely_events, jobs, metrics

    events, lonely_events, jobs, metrics = run(main())
    assert [j.state for j in jobs] == [FAILED, FAILED]
    assert "failed after 2 attempt(s) and 0 extension(s)" in jobs[0].message
    assert "too few survivors: 3 < 5" in jobs[0].message
    assert events[-1].state == FAILED and "too few survivors" in events[-1].message
    assert "only 0 of the 5 devices needed checked in" in jobs[1].message
    assert lonely_events[-1].state == FAILED
    assert "tally_coordinator_rounds_failed_total 2.0" in metrics
    assert 'tally_coordinator_cohort_sums_total{outcome="aborted"}' in metrics


def test_round_deadline_bounds_a_silent_aggregator(tmp_path):
    deadlines = ("deadlines: {download: 0.1, advertise_keys: 0.1, share_keys: 0.1, masked_input: 0.2, "
                 "consistency_check: 0.1, unmask: 0.1}\n")

    async def main():
        async with in_process().coordinator_with_fakes(tmp_path, aggregators=1) as s:
            s.aggregators[0].hang = True
            devices = await s.devices(5)
            job_id = await s.submit(spec_yaml("silent", cohort=5, extra="retries: 0\n" + deadlines))
            started = time.monotonic()
            events = await run_devices(devices, fedavg_contribution(FedAvgOptions()), s.until_done(job_id))
            elapsed = time.monotonic() - started
            closed = [sess.closed for sess in s.aggregators[0].sessions.values()]
        return events, elapsed, closed

    events, elapsed, closed = run(main())
    assert events[-1].state == FAILED
    assert "DEADLINE_EXCEEDED" in events[-1].message or "before the round deadline" in events[-1].message
    assert elapsed < 10 and closed and all(closed)


def test_tls_to_devices_and_mutual_tls_to_aggregators_from_tally_certs(tmp_path):
    """`tally coordinator --tls-dir <certs>/coordinator`: devices reach it over TLS, and it
    presents its own certificate to an aggregator that demands mutual TLS; without a client
    certificate (an explicit aggregator_tls of CA only) the aggregator refuses it."""
    pki = tmp_path / "pki"
    certs.write_deployment(pki)
    own = pki / "coordinator"
    parser = argparse.ArgumentParser(prog="tally")
    coordinator_cli.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["coordinator", "--state-dir", str(tmp_path / "state"), "--tls-dir", str(own)])
    tls = tls_config_from_args(args)
    assert tls.cert == own / "coordinator.pem" and tls.ca == own / "ca.pem"

    async def main():
        async with in_process() as services:
            fake = await services.fake_aggregator(
                "agg0", TicketVerifier(load_or_create_ticket_key(own).public_key()),
                TLSConfig.from_dir(pki / "aggregator-1", "aggregator", require_client_auth=True), host="localhost")
            service = await services.coordinator(tls, tmp_path / "state", [("agg0", fake.address)], secrets_dir=own)
            healthy = await service.jobs.pool.healthy()
            channel = grpc.aio.secure_channel(
                f"localhost:{service.port}", channel_credentials(TLSConfig.from_dir(pki / "device", None)),
                options=channel_options(),
            )
            async with channel:
                stub = coordinator_pb2_grpc.CoordinatorStub(channel)
                reply = await stub.Register(provisioned_request(service, "d", "p"), timeout=5)
                metadata = bearer_metadata(reply.token)
                answer = await stub.CheckIn(coordinator_pb2.CheckInRequest(), metadata=metadata, timeout=5)
            without_client_cert = await services.coordinator(tls, tmp_path / "other", [("agg0", fake.address)],
                                                             secrets_dir=own, aggregator_tls=TLSConfig(ca=tls.ca))
            refused = await without_client_cert.jobs.pool.healthy()
        return healthy, answer, refused

    healthy, answer, refused = run(main())
    assert healthy == ["agg0"] and refused == []  # mutual TLS: no client certificate, no aggregator
    assert answer.HasField("retry_after")


def test_cli_help_and_job_commands(tmp_path, capsys):
    parser = argparse.ArgumentParser(prog="tally")
    sub = parser.add_subparsers(dest="command", required=True)
    coordinator_cli.register(sub)
    for argv in (["coordinator"], ["job"], ["job", "submit"], ["job", "status"], ["job", "list"],
                 ["job", "cancel"], ["job", "watch"]):
        with pytest.raises(SystemExit) as exit_:
            parser.parse_args([*argv, "--help"])
        assert exit_.value.code == 0
    assert "--aggregator ID=HOST:PORT" in capsys.readouterr().out
    spec = tmp_path / "job.yaml"
    spec.write_text(spec_yaml("cli", population="nobody"))

    def cli(*argv: str) -> tuple[int, str]:
        args = parser.parse_args(argv)
        code = args.run(args)
        return code, capsys.readouterr().out  # stderr may hold other tests' log noise

    async def main():
        async with in_process().coordinator_with_fakes(tmp_path, aggregators=1) as s:
            common = ("--coordinator", f"127.0.0.1:{s.service.port}", "--state-dir", str(s.state_dir), "--insecure")
            code, out = await asyncio.to_thread(cli, "job", "submit", str(spec), *common)
            job_id = out.strip()
            results = [
                (code, out),
                await asyncio.to_thread(cli, "job", "status", job_id, *common),
                await asyncio.to_thread(cli, "job", "list", *common),
                await asyncio.to_thread(cli, "job", "cancel", job_id, "--reason", "done here", *common),
                await asyncio.to_thread(cli, "job", "watch", job_id, *common),
                await asyncio.to_thread(cli, "job", "status", "nope", *common),
            ]
        return job_id, results

    job_id, results = run(main())
    (submit_code, _), (status_code, status), (list_code, listing), (cancel_code, cancel) = results[:4]
    (watch_code, watch), (missing_code, _) = results[4:]
    assert submit_code == status_code == list_code == cancel_code == 0
    assert job_id.startswith("cli-") and job_id in status and job_id in listing
    assert "PENDING" in status or "RUNNING" in status
    assert "CANCELLED" in cancel and "done here" in cancel
    assert watch_code == 1 and "CANCELLED" in watch
    assert missing_code == 1


@pytest.mark.parametrize(("ledger", "named"), [
    *(({"latest_round": rounds}, "input_ledger: at most 16 jobs")
      for rounds in ({f"job-{i}": 1 for i in range(17)}, {"job": 0}, {"job": -3})),
    ({"ledger_id": "f" * 65}, "input_ledger.ledger_id: at most 64 characters"),
])
def test_a_check_in_with_a_malformed_input_ledger_is_refused_naming_it(tmp_path, ledger, named):
    async def main():
        async with in_process().coordinator_with_fakes(tmp_path, aggregators=1) as s:
            device = (await s.devices(1))[0]
            request = coordinator_pb2.CheckInRequest(input_ledger=coordinator_pb2.InputLedger(**ledger))
            return await status_of(device.stub.CheckIn(request, metadata=device.md, timeout=5))

    code, details = run(main())
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith(named), details


async def _check_in_until_refused(device: FakeDevice) -> tuple[grpc.StatusCode, str]:
    """Check in again after every come-back answer until a task or a refusal; its status."""
    while True:
        try:
            reply = await device.check_in_once(timeout=30)
        except grpc.aio.AioRpcError as exc:
            return exc.code(), exc.details()
        if reply.HasField("task"):
            return grpc.StatusCode.OK, f"task {reply.task.task_id}"
        await device._pause(reply.retry_after.seconds, None)


def test_a_device_revoked_while_its_check_in_is_held_gets_no_task_and_is_in_no_roster(tmp_path, monkeypatch):
    """Issue 38, problem 6: dev0 is seated and its check-in held while the selection fills; an
    operator revokes it. The held check-in used to get its task once the selection filled (and
    the device sent its input); the roster named it. Now the check-in ends at once with
    PERMISSION_DENIED, its place goes to another device, and no session's roster holds its key."""
    seated = asyncio.Event()
    real_offer = Selection.offer

    def offer(self, device_id: str, ledger_id: str = "") -> bool:
        taken = real_offer(self, device_id, ledger_id)
        if taken and device_id == "dev0":
            seated.set()
        return taken

    monkeypatch.setattr(Selection, "offer", offer)

    async def main():
        async with in_process().coordinator_with_fakes(tmp_path, aggregators=1) as s:
            devices = await s.devices(11)
            job_id = await s.submit(spec_yaml("revoked", extra="deadlines: {checkin: 30}\n"))
            held = asyncio.create_task(_check_in_until_refused(devices[0]))
            await seated.wait()
            await s.admin.RevokeDevice(admin_pb2.RevokeDeviceRequest(device_id="dev0"), metadata=s.admin_md,
                                       timeout=5)
            refused = await held
            key = s.service.store.devices.identities(["dev0"])["dev0"]
            await run_devices(devices[1:], fedavg_contribution(FedAvgOptions()), s.until_done(job_id))
            rosters = [session.config.identities for session in s.aggregators[0].sessions.values()]
            return refused, key, rosters, await s.job(job_id)

    (code, details), key, rosters, job = run(main())
    assert code == grpc.StatusCode.PERMISSION_DENIED and details == "device 'dev0' is revoked"
    assert job.state == SUCCEEDED
    assert rosters and all(len(roster) == 10 and key not in roster for roster in rosters)
