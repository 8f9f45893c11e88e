"""The whole system on 127.0.0.1: the real coordinator, two real aggregators and real SDK
devices over gRPC, against the in-process reference, with dropouts, a killed aggregator,
a restarted coordinator, and a record of everything the servers received."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from scipy import stats

from support.jobs import job_text, reference_halves
from support.stack import HIDDEN, in_process, run, scrape_text, spec, trainers
from tally import modelio, models
from tally.aggregator import session as aggregator_session
from tally.algorithms.fedavg import FedAvgClient, FedAvgOptions, FedAvgServer
from tally.client import OnnxModel
from tally.codec import unpack
from tally.datasets.digits import digits
from tally.evaluation import EvaluatedClient, EvaluatedServer, EvaluationPlan, is_quality
from tally.loadtest import DropoutPlan
from tally.models.mlp import mlp
from tally.models.params import get_params, set_params
from tally.secagg import DevicePolicy, SecAggServer
from tally.secagg.messages import MaskedInputResponse
from tally.sim.rounds import plain_sum, run_rounds
from tally.training import TorchTrainer, single_threaded
from tally.wire.v1 import common_pb2, coordinator_pb2


def test_fedavg_through_the_services_equals_the_in_process_result(tmp_path):
    """The model and every model-quality figure the devices' metric sums give (tally/evaluation)
    equal the in-process run of the same devices: counts exactly, means to fixed point."""
    n, rounds = 12, 2
    devices, _ = trainers(n)

    async def main():
        async with in_process().whole_system(tmp_path) as s:
            job_id, fleet_stats = await s.run_job(spec("fidelity", rounds, cohort=n), devices)
            return await s.job(job_id), s.model(job_id), fleet_stats, await s.round_metrics(job_id)

    job, model, fleet_stats, figures = run(main())
    assert job.state == common_pb2.JOB_STATE_SUCCEEDED and job.committed_round == rounds
    assert fleet_stats.sessions_completed == n * rounds  # every device in every round, both aggregators
    # The reference: the same devices (fresh, same seeds), exact float sums, in process, with the
    # job's default evaluation (each device holds out 10 % of its examples and never trains on them).
    options = FedAvgOptions(local_epochs=1, local_lr=0.1, batch_size=16)
    reference_devices, _ = trainers(n)
    reference = EvaluatedServer(FedAvgServer(options), EvaluationPlan())
    expected: list[dict[str, float]] = []
    state, _ = run_rounds(reference, EvaluatedClient(FedAvgClient(options)), reference_devices,
                          get_params(mlp(64, 10, hidden=HIDDEN, seed=0)), rounds, n, plain_sum,
                          on_round=lambda log: expected.append(dict(reference.round_quality)))
    error = max(float(np.max(np.abs(model[k] - state.params[k]))) for k in model)
    moved = max(float(np.max(np.abs(model[k] - get_params(mlp(64, 10, hidden=HIDDEN, seed=0))[k]))) for k in model)
    # Each round: Σ w·Δ and Σ w are off by < n·2^-20 (two cohorts decoded apart); float32 model storage.
    assert error < 1e-4 < moved
    for r, want in enumerate(expected, start=1):
        got = {k: v for k, v in figures[r].items() if is_quality(k)}
        assert set(got) == set(want) and want["eval.devices"] == n
        for key, value in want.items():
            exact = key.startswith(("eval.accuracy_hist.", "eval.devices", "eval.examples", "eval.clipped"))
            assert got[key] == value if exact else abs(got[key] - value) < 1e-3, key
    assert expected[-1]["eval.loss"] < expected[0]["eval.loss"]  # the figures show it learning


def test_dropouts_a_killed_aggregator_and_a_restarted_coordinator(tmp_path, monkeypatch):
    """Devices drop in random phases; aggregator 2 dies after round 1; the coordinator is
    restarted after round 2; the job still commits every round exactly once. Twice the
    selection's devices: a failed attempt's devices may not serve the round's retry (issue 12),
    so a retry needs spares."""
    n, rounds = 48, 4
    devices, (test_x, test_y) = trainers(n, seed=3)
    received = []  # everything the aggregators were sent by devices
    real_submit = aggregator_session.Session.submit

    async def record(self, index, message):
        received.append((message, self.config))
        return await real_submit(self, index, message)

    monkeypatch.setattr(aggregator_session.Session, "submit", record)
    revealed = []
    real_unmask = SecAggServer.receive

    def watch_reveals(self, message):
        out = real_unmask(self, message)
        for sum_id in self.revealed_seeds:
            revealed.append((self.revealed_seeds[sum_id], self.revealed_keys[sum_id]))
        return out

    monkeypatch.setattr(SecAggServer, "receive", watch_reveals)

    async def main():
        async with in_process().whole_system(tmp_path) as s:
            job_id = await s.submit(spec("resilience", rounds, cohort=18, over_selection=1.3))
            fleet = s.fleet(devices, dropout=DropoutPlan(0.2, seed=5), seed=2)
            running = asyncio.create_task(fleet.run(until=fleet.until_job_done(job_id, every_seconds=0.2)))
            await s.committed(job_id, 1)
            await s.aggregators[1].stop(grace=0)
            await s.committed(job_id, 2)
            await s.restart_coordinator()
            fleet_stats = await running
            fleet.close()
            rows = s.coordinator.store.rounds(job_id)
            return await s.job(job_id), rows, fleet_stats, s.model(job_id)

    job, rows, fleet_stats, model = run(main())
    assert job.state == common_pb2.JOB_STATE_SUCCEEDED, job.message
    committed = sorted(r.round for r in rows if r.state == "committed")
    assert committed == list(range(1, rounds + 1)), "a committed round was lost or repeated"
    assert fleet_stats.dropouts > 0 and fleet_stats.sessions_completed > 0
    # The model still learned: its held-out loss fell from the initial model's.
    judge = TorchTrainer(lambda: mlp(64, 10, hidden=HIDDEN, seed=0), test_x, test_y)
    assert judge.evaluate(model)[0] < judge.evaluate(get_params(mlp(64, 10, hidden=HIDDEN, seed=0)))[0] - 0.05

    # The privacy rule, on what was actually received: masked inputs look uniform, and for
    # no device were both its self-mask seed and its mask key reconstructed.
    masked = [(m, config) for m, config in received if isinstance(m, MaskedInputResponse)]
    assert masked
    for m, config in masked:
        sum_spec = config.sum_spec(m.sum_id)
        values = unpack(m.data, sum_spec.wire_bits, sum_spec.dim).astype(np.int64)
        counts = np.bincount(values >> (sum_spec.bits - 5), minlength=32)
        assert stats.chisquare(counts).pvalue > 1e-9, "a masked input is not uniform"
    assert revealed and all(not (seeds & keys) for seeds, keys in revealed)


def test_devices_that_cannot_train_report_why_and_keep_running(tmp_path):
    """Issue 9, item 2: a device whose model does not fit the job's used to raise out of
    Device.run (one bad option crashed a whole fleet) while the coordinator logged only that
    devices did not answer. Now two of twenty devices hold a model of another shape: they
    refuse with the reason, report it at their next check-in, and keep checking in; the job
    commits from the other eighteen, and its status and metrics count the reason."""
    n, bad = 20, (0, 9)
    devices, _ = trainers(n)
    other = lambda: mlp(64, 10, hidden=HIDDEN // 2, seed=0)  # noqa: E731
    for i in bad:
        devices[i] = TorchTrainer(other, devices[i].features.cpu().numpy(), devices[i].labels.cpu().numpy())
    # Cohorts of 10: both misfits in one of them is 20 % dropouts, within the 25 % planned for.
    text = (spec("mismatch", 1, cohort=n).replace("dropout_rate: 0.1", "dropout_rate: 0.25")
            .replace("min_cohort: 5", "min_cohort: 8"))

    async def main():
        async with in_process().whole_system(tmp_path) as s:
            job_id, fleet_stats = await s.run_job(text, devices)
            return await s.job(job_id), fleet_stats, scrape_text(s.coordinator.metrics_port)

    job, fleet_stats, metrics = run(main())
    assert job.state == common_pb2.JOB_STATE_SUCCEEDED, job.message
    assert fleet_stats.sessions_completed == n - len(bad)
    assert fleet_stats.sessions_aborted == len(bad)
    counts = {(c.outcome, c.reason): c.count for c in job.task_reports}
    assert counts[("aborted", "model_mismatch")] == len(bad)
    assert ('tally_coordinator_task_reports_total{outcome="aborted",reason="model_mismatch"} 2.0'
            in metrics)


def test_a_failure_no_retry_can_fix_fails_the_job_at_once_and_says_why(tmp_path):
    """Issue 25, item 2: every device holds a model of another shape. The job used to spend its
    whole retry budget and then say only that too few devices answered, while `job status`
    showed the committed round's (no) reports. Now it stops at the first attempt whose round
    has a cohort's worth of model mismatches and no success, the message names the reason with
    a count and one device's own words, and the status shows the failed round's reports."""
    n = 10
    devices, _ = trainers(n)
    other = lambda: mlp(64, 10, hidden=HIDDEN // 2, seed=0)  # noqa: E731
    devices = [TorchTrainer(other, d.features.cpu().numpy(), d.labels.cpu().numpy()) for d in devices]
    text = spec("hopeless", 2, cohort=n).replace("retries: 3", "retries: 6")

    async def main():
        async with in_process().whole_system(tmp_path) as s:
            job_id, _ = await s.run_job(text, devices)
            return await s.job(job_id), [r for r in s.coordinator.store.rounds(job_id) if r.round == 1]

    job, attempts = run(main())
    assert job.state == common_pb2.JOB_STATE_FAILED
    assert "devices report model_mismatch x" in job.message and "no retry can fix that" in job.message, job.message
    assert len(attempts) < 7  # the budget was 1 + 6 attempts
    assert job.round == 1 and job.committed_round == 0
    [report] = [r for r in job.task_reports if r.reason == "model_mismatch"]
    assert report.count >= 5 and report.outcome == "aborted" and report.example


def test_a_cnn_job_trains_through_the_services_and_exports_to_onnx(tmp_path):
    """Issue 9, item 9: a model other than the built-in mlp through the services (it used to be
    'model.kind: cnn is not one of [mlp]'); the committed model's ONNX export computes what torch
    does, and the held-out loss fell."""
    n, rounds, channels = 10, 2, 8
    fed = digits(n, alpha=0.5, seed=4)
    cnn = lambda: models.build("cnn", 64, 10, channels, 0)  # noqa: E731
    single_threaded()
    devices = [TorchTrainer(cnn, X, y, seed=i) for i, (X, y) in enumerate(fed.clients)]
    text = (spec("cnn", rounds, cohort=n).replace(f"hidden: {HIDDEN}", f"kind: cnn, hidden: {channels}")
            .replace("local_epochs: 1", "local_epochs: 4"))

    async def main():
        async with in_process().whole_system(tmp_path) as s:
            job_id, _ = await s.run_job(text, devices)
            version = s.coordinator.store.model_version(job_id)
            return (await s.job(job_id), s.model(job_id),
                    s.coordinator.store.read_blob(version.onnx_digest))

    job, model, onnx = run(main())
    assert job.state == common_pb2.JOB_STATE_SUCCEEDED and job.committed_round == rounds, job.message
    test_x, test_y = fed.test
    judge = TorchTrainer(cnn, test_x, test_y)
    assert judge.evaluate(model)[0] < judge.evaluate(get_params(cnn()))[0] - 0.05
    net = cnn()
    set_params(net, model)
    with torch.no_grad():
        expected = net(torch.as_tensor(test_x[:20], dtype=torch.float32)).numpy()
    got = OnnxModel.from_bytes(onnx).logits(test_x[:20].astype(np.float32))
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)


def test_the_coordinator_api_cannot_carry_a_device_contribution():
    """Structural half of the privacy rule: nothing a device sends the coordinator has room for
    data (no tensors, no free bytes); contributions only travel to aggregators, masked. The one
    documented exception is ``Reveal``, refused unless the job opted in (DESIGN.md section 1;
    tests/e2e/test_full_stack_algorithms.py checks the refusal and the count)."""
    # Register's fixed-size credentials, refused unless they verify (identity key 32 bytes,
    # signature 64, credential matching the enrolment key): no room for a contribution.
    allowed_bytes = {f"RegisterRequest.{f}" for f in ("identity_public", "enrolment_credential", "signature")}
    allowed_tensors = {"RevealRequest.values"}
    service = coordinator_pb2.DESCRIPTOR.services_by_name["Coordinator"]
    seen = set()

    def walk(message_type, path):
        if message_type.full_name in seen:
            return
        seen.add(message_type.full_name)
        for f in message_type.fields:
            where = f"{path}.{f.name}"
            if f.message_type is not None and f.message_type.name == "Tensor":
                assert where in allowed_tensors, f"{where} could carry a tensor"
                continue
            if f.type == f.TYPE_BYTES:
                assert where in allowed_bytes, f"{where} is free bytes"
            if f.message_type is not None:
                walk(f.message_type, where)

    for method in service.methods:
        walk(method.input_type, method.input_type.name)
    assert {m.name for m in service.methods} >= {"Register", "CheckIn", "DownloadModel", "GetStep", "RoundStatus"}


def test_oversized_messages_get_resource_exhausted_and_the_services_keep_serving(tmp_path):
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from tally.wire.v1 import coordinator_pb2_grpc, secagg_pb2, secagg_pb2_grpc

    async def main():
        async with in_process().whole_system(tmp_path) as s:
            huge = "x" * (65 << 20)  # above the aggregator's explicit 64 MiB limit
            codes = []
            async with grpc.aio.insecure_channel(
                s.target, options=[("grpc.max_send_message_length", 128 << 20)]
            ) as channel:
                # The coordinator takes no request above 1 MiB: an unauthenticated Register of
                # 2 MiB is refused by gRPC before the service sees it.
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await coordinator_pb2_grpc.CoordinatorStub(channel).Register(
                        coordinator_pb2.RegisterRequest(device_id="d", attestation="x" * (2 << 20)), timeout=30)
                codes.append(refused.value.code())
            async with grpc.aio.insecure_channel(
                s.aggregators[0].address, options=[("grpc.max_send_message_length", 128 << 20)]
            ) as channel:
                call = secagg_pb2_grpc.SecureAggregationStub(channel).Session(timeout=30)
                await call.write(secagg_pb2.DeviceToAggregator(
                    masked_input_response=secagg_pb2.MaskedInputResponse(data=huge.encode())))
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await call.read()
                codes.append(refused.value.code())
            healthy = []
            for target in (s.target, s.aggregators[0].address):
                async with grpc.aio.insecure_channel(target) as channel:
                    reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
                    healthy.append(reply.status == health_pb2.HealthCheckResponse.SERVING)
            return codes, healthy

    codes, healthy = run(main())
    # The aggregator never reads a message of a stream without a Join in its metadata: 65 MiB
    # sent on one are refused as unauthenticated, unread.
    assert codes == [grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAUTHENTICATED]
    assert healthy == [True, True]


def received_types(monkeypatch) -> list[str]:
    """The type names of the messages the aggregators receive from devices, as they arrive."""
    received: list[str] = []
    real_submit = aggregator_session.Session.submit

    async def record(self, index, message):
        received.append(type(message).__name__)
        return await real_submit(self, index, message)

    monkeypatch.setattr(aggregator_session.Session, "submit", record)
    return received


def plain_spec(rounds: int, n: int) -> str:
    return spec("plain", rounds, cohort=n).replace("corrupt_rate: 0.05}", "corrupt_rate: 0.05, plain: true}")


def test_plain_sum_job_runs_through_the_services_without_any_key_exchange(tmp_path, monkeypatch):
    """The benchmark baseline: ``secure: {plain: true}`` gives the same model as the in-process
    reference, and the aggregators only ever receive plain inputs."""
    n, rounds = 12, 2
    devices, _ = trainers(n)
    received = received_types(monkeypatch)
    text = plain_spec(rounds, n)

    async def main():
        async with in_process().whole_system(tmp_path) as s:
            job_id, fleet_stats = await s.run_job(text, devices, device_policy=DevicePolicy(allow_plain=True))
            phases = {
                sample.labels["phase"]
                for a in s.aggregators
                for metric in a.metrics.registry.collect()
                if metric.name == "tally_aggregator_phase_duration_seconds"
                for sample in metric.samples
            }
            counted = "tally_coordinator_plain_jobs_total 1.0" in scrape_text(s.coordinator.metrics_port)
            return await s.job(job_id), s.model(job_id), fleet_stats, phases, counted

    job, model, fleet_stats, phases, counted = run(main())
    assert counted, "a plain job must be counted"
    assert job.state == common_pb2.JOB_STATE_SUCCEEDED and job.committed_round == rounds
    assert fleet_stats.sessions_completed == n * rounds
    assert set(received) == {"MaskedInputResponse"}
    assert phases == {"join", "masked_input"}
    reference_devices, _ = trainers(n)
    state, _ = run_rounds(*reference_halves("fedavg", {"local_epochs": 1, "local_lr": 0.1, "batch_size": 16}),
                          reference_devices, get_params(mlp(64, 10, hidden=HIDDEN, seed=0)), rounds, n, plain_sum)
    assert max(float(np.max(np.abs(model[k] - state.params[k]))) for k in model) < 1e-4


def test_devices_refuse_a_plain_job_they_did_not_opt_into(tmp_path, monkeypatch):
    """A coordinator (or whoever forged its config) that asks for a plain sum gets nothing: the
    SDK refuses plain sessions unless the device itself opted in for benchmarking."""
    n = 6
    devices, _ = trainers(n)
    received = received_types(monkeypatch)
    text = plain_spec(1, n)

    async def main():
        async with in_process().whole_system(tmp_path) as s:
            await s.submit(text)
            fleet = s.fleet(devices, seed=1)
            fleet_stats = await fleet.run(max_tasks_per_device=1)
            fleet.close()
            return fleet_stats

    fleet_stats = run(main())
    assert fleet_stats.sessions_aborted == n and fleet_stats.sessions_completed == 0
    assert received == []


def test_agnostic_fedavg_through_the_services_with_a_coordinator_restart(tmp_path):
    """AgnosticFedAvg (four sums per device and round: β·Δ, β, per-domain losses and counts) on
    the toy regression through the real services equals the in-process run, model and λ, with the
    coordinator restarted after round 1: the resumed job must continue from the checkpointed λ,
    window and optimizer state, not from ``server.init(model)``."""
    from tally import algorithms
    from tally.coordinator.spec import catalogue
    from tally.coordinator.state.state_codec import state_from_bytes
    from tally.datasets.toy_regression import toy_regression

    rounds, initial = 3, {"w": np.array([5.0])}
    toy = toy_regression(clients=10, domains=3, samples_per_client=20, seed=0)
    n = len(toy.client_points)
    # tally.sim.scenarios' toy-regression options, with one full batch per epoch so that a device's
    # update does not depend on how often it was asked to train (an attempt interrupted by the
    # restart may have trained it once more).
    options = {"domains": toy.num_domains, "domain_lr": 0.005, "local_lr": 0.1, "batch_size": 20,
               "loss_clip": 1000000.0, "loss_frac_bits": 4, "delta_clip": 16}
    text = job_text("agnostic", "agnostic_fedavg", rounds, n, "toy-scalar", options)
    catalogue.register_model("toy-scalar", lambda _spec: initial)

    async def main():
        async with in_process().whole_system(tmp_path) as s:
            job_id = await s.submit(text)
            fleet = s.fleet(toy.devices(0), seed=1)
            running = asyncio.create_task(fleet.run(until=fleet.until_job_done(job_id, every_seconds=0.2)))
            await s.committed(job_id, 1)
            await s.restart_coordinator()
            fleet_stats = await running
            fleet.close()
            store = s.coordinator.store
            version = store.model_version(job_id)
            model = modelio.deserialize(store.read_blob(version.model_digest))
            template = algorithms.make("agnostic_fedavg", options)[0].init(model)
            state = state_from_bytes(store.read_blob(version.state_digest), template)
            return await s.job(job_id), state, fleet_stats

    try:
        job, state, fleet_stats = run(main())
    finally:
        catalogue.unregister_model("toy-scalar")
    assert job.state == common_pb2.JOB_STATE_SUCCEEDED and job.committed_round == rounds, job.message
    assert fleet_stats.rounds[job.job_id] == list(range(1, rounds + 1))
    server, client = reference_halves("agnostic_fedavg", options, initial)
    reference, _ = run_rounds(server, client, toy.devices(0), initial, rounds, n, plain_sum)
    # Quantisation bound: each round's per-domain loss sums are off by < n·2^-4 (loss_frac_bits 4)
    # over >= 40 examples a domain, so L̄ by < 10/16/40 and log λ by < domain_lr·that = 8e-5 a
    # round; β·Δ and β by < n·2^-20. Three rounds stay far below 1e-3; λ moves by ~0.1.
    assert state.round == reference.round == rounds
    np.testing.assert_allclose(state.weights, reference.weights, atol=1e-3)
    np.testing.assert_allclose(state.params["w"], reference.params["w"], atol=1e-3)
    np.testing.assert_array_equal(state.window, reference.window)  # counts are exact
    assert np.max(np.abs(reference.weights - 1 / 3)) > 0.01  # λ moved: the comparison is not vacuous
