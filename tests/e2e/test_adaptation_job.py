"""Local adaptation as a job option (issue 10; specs/local-adaptation.md): through the real
coordinator, two aggregators and an SDK fleet over TLS on 127.0.0.1, a job whose spec has an
``adaptation:`` block ends with every device that had a task of it holding an adapted ONNX model,
in its state directory and nowhere else, at least as accurate on its own test split as the
federated model; a job without the block leaves no adapted model; bad options are refused at
validate and at submit with the field named."""

from __future__ import annotations

import asyncio
import hashlib
import json
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from support.stack import PLAINTEXT, in_process, run, spec
from tally.algorithms.adaptation_options import METHODS, AdaptationOptions, JobAdaptation
from tally.client import Device, OnnxModel
from tally.client.adaptation import adapt_for_job
from tally.client.adapted_models import AdaptedModels
from tally.client.metrics import ClientMetrics
from tally.coordinator.spec import jobspec
from tally.datasets.personal import pathological_digits
from tally.models.mlp import mlp
from tally.models.params import get_params
from tally.training import TorchTrainer, held_out_indices, single_threaded
from tally.wire.v1 import admin_pb2, common_pb2

N, ROUNDS, HIDDEN = 10, 2, 16  # ten devices: two cohorts of five, one per aggregator
ADAPTATION = {"method": "finetune", "epochs": 10, "lr": 0.05, "batch_size": 16, "validation": 0.2,
              "local_only_epochs": 20}
BASE = {"name": "t", "algorithm": "fedavg", "rounds": 2, "cohort_size": 10, "min_cohort": 5}


def _factory() -> torch.nn.Module:
    return mlp(64, 10, hidden=HIDDEN, seed=0)  # the model the spec of test_full_stack names


def _devices() -> tuple[list[TorchTrainer], list[tuple[np.ndarray, np.ndarray]]]:
    """Each device trains on its training and validation examples (it holds out its own share);
    its test split stays with the test, to judge the models it ends with."""
    single_threaded()
    data = pathological_digits(N, 2, seed=0)
    trainers = [TorchTrainer(_factory, np.concatenate([d.train[0], d.validation[0]]),
                             np.concatenate([d.train[1], d.validation[1]]), seed=i)
                for i, d in enumerate(data.devices)]
    return trainers, [d.test for d in data.devices]


def _digests(root: Path) -> set[str]:
    return {hashlib.sha256(p.read_bytes()).hexdigest() for p in root.rglob("*") if p.is_file()}


def test_a_job_with_an_adaptation_option_leaves_each_device_an_adapted_model_and_one_without_none(tmp_path):
    """Three jobs on one stack over TLS, the same ten devices with state directories: ``adapted``
    (finetune), whose fleet runs on until every device has adapted, so devices adapt at a check-in
    after the job ended, as a device that runs for good does; ``frozen`` (freeze_base), whose fleet
    stops as soon as the job is done, so devices adapt as they stop; ``plain``, without the option."""
    trainers, tests = _devices()
    adapted_spec = spec("adapted", ROUNDS, cohort=N) + f"adaptation: {json.dumps(ADAPTATION)}\n"
    frozen_spec = spec("frozen", 1, cohort=N) + "adaptation: {method: freeze_base, epochs: 10, validation: 0.0}\n"
    devices_dir = tmp_path / "devices"

    async def run_fleet(s, text: str, seed: int, stop_when_adapted: bool):
        job_id = await s.submit(text)
        fleet = s.fleet(trainers, seed=seed, state_dir=devices_dir)

        async def adapted(_stats) -> bool:
            return all(d.adaptation_record(job_id) is not None for d in fleet.devices)

        try:
            await fleet.run(until=adapted if stop_when_adapted else fleet.until_job_done(job_id, every_seconds=0.2))
        finally:
            fleet.close()
        return await s.job(job_id), fleet.devices

    async def main():
        async with in_process().whole_system(tmp_path, tls=True) as s:
            runs = [await run_fleet(s, adapted_spec, 1, True), await run_fleet(s, frozen_spec, 2, False),
                    await run_fleet(s, spec("plain", 1, cohort=N), 3, False)]
            store = s.coordinator.store
            federated = store.read_blob(store.model_version(runs[0][0].job_id).onnx_digest)
            return runs, federated

    runs, federated_onnx = run(main())
    for job, _ in runs:
        assert job.state == common_pb2.JOB_STATE_SUCCEEDED, job.message
    (adapted_job, devices), (frozen_job, frozen_devices), (plain_job, plain_devices) = runs
    with_option, frozen, without = adapted_job.job_id, frozen_job.job_id, plain_job.job_id
    assert adapted_job.committed_round == ROUNDS
    assert all(with_option in d.stats.jobs for d in devices)  # cohort_size N of N: every device took part

    federated = OnnxModel.from_bytes(federated_onnx)
    fed_acc, adapted_acc = [], []
    for device, (X, y) in zip(devices, tests):
        model = device.adapted_model(with_option)
        assert model is not None, device.device_id
        fed_acc.append(federated.evaluate(X, y)[1])
        adapted_acc.append(model.evaluate(X, y)[1])
        record = device.adaptation_record(with_option)
        assert record["method"] == "finetune" and record["kept"] in ("adapted", "federated")
        assert record["held_out"] > 0 and set(record["accuracy"]) == {"federated", "adapted", "local_only"}
        assert record["model_version"] == f"{with_option}/v{ROUNDS}"
    print("per device test accuracy, federated:", np.round(fed_acc, 3), "adapted:", np.round(adapted_acc, 3))
    # The spec's metric (5): each device's accuracy on its own test split, never seen in adaptation.
    assert all(a >= f for a, f in zip(adapted_acc, fed_acc)), (fed_acc, adapted_acc)
    assert np.mean(adapted_acc) > np.mean(fed_acc) + 0.1  # adaptation did something, not just kept G^T
    # Counted in the devices' registries: one finetune adaptation each, by the model kept, and its gain.
    registries = {id(d.metrics): d.metrics.registry for d in devices}.values()
    kept_adapted = sum(d.adaptation_record(with_option)["kept"] == "adapted" for d in devices)
    assert [sum(r.get_sample_value(name, labels) or 0.0 for r in registries) for name, labels in [
        ("tally_client_adaptations_total", {"method": "finetune", "outcome": "adapted"}),
        ("tally_client_adaptations_total", {"method": "finetune", "outcome": "kept_federated"}),
        ("tally_client_adaptation_accuracy_gain_ratio_count", {"method": "finetune"})]] == [kept_adapted,
                                                                                           N - kept_adapted, N]

    # Adapted as the devices stopped: freeze_base changed only the last layer, nothing held out.
    for device in frozen_devices:
        record = device.adaptation_record(frozen)
        assert record["method"] == "freeze_base" and record["held_out"] == 0 and record["kept"] == "adapted"
        assert device.adapted_model(frozen) is not None

    # Kept on the device only: in its state directory, in none of the servers' files, and a
    # device restarted on that directory serves the same model.
    kept = {hashlib.sha256((devices_dir / d.device_id / f"{with_option}.adapted.onnx").read_bytes()).hexdigest()
            for d in devices}
    assert len(kept) == N and not kept & _digests(tmp_path / "state")
    restarted = Device("127.0.0.1:1", PLAINTEXT, "restarted", trainers[0], state_dir=devices_dir / devices[0].device_id)
    X, _ = tests[0]
    np.testing.assert_array_equal(restarted.adapted_model(with_option).logits(X),
                                  devices[0].adapted_model(with_option).logits(X))

    # The job without the option: every device had tasks of it, and none has an adapted model.
    assert all(without in d.stats.jobs for d in plain_devices)
    assert all(d.adapted_model(without) is None and d.adaptation_record(without) is None for d in plain_devices)
    assert len(list(devices_dir.rglob("*.adapted.onnx"))) == 2 * N
    assert not list(devices_dir.rglob("*.adaptation-pending"))


@pytest.mark.parametrize(
    ("adaptation", "needle"),
    [
        ({"method": "retrain"}, "adaptation.method: input should be 'finetune', 'freeze_base', 'ewc' or 'distill'"),
        ({"epochs": 5}, "adaptation.method: required"),
        ({"method": "finetune", "epochs": 0}, "adaptation.epochs: must be >= 1, got 0"),
        ({"method": "finetune", "lr": "0.1"}, "adaptation.lr: must be a number, got '0.1' (str)"),
        ({"method": "finetune", "validation": 0.9}, "adaptation.validation: must be <= 0.5, got 0.9"),
        ({"method": "distill", "alpha": 1.5}, "adaptation.alpha: must be <= 1, got 1.5"),
        ({"method": "finetune", "alpha": 0.9}, "adaptation.alpha: only used by method distill, not finetune"),
        ({"method": "ewc", "trainable": ["2.*"]}, "adaptation.trainable: only used by method freeze_base, not ewc"),
        ({"method": "freeze_base", "trainable": ["head.*"]},
         "adaptation.trainable: freeze_base: trainable ['head.*'] matches none of ['0.weight', '0.bias', "
         "'2.weight', '2.bias']"),
        ({"method": "ewc", "lambda": 3}, "adaptation: unknown keys ['lambda']; valid keys: ['method', 'epochs'"),
        ("finetune", "adaptation: must be a mapping, got 'finetune' (str)"),
    ],
)
def test_bad_adaptation_options_are_refused_naming_the_field(adaptation, needle):
    with pytest.raises(jobspec.JobSpecError) as err:
        jobspec.parse(yaml.safe_dump({**BASE, "adaptation": adaptation}))
    assert any(line.startswith(needle) for line in str(err.value).splitlines()), str(err.value)


def test_a_model_without_a_torch_module_cannot_be_adapted():
    """FedDAR's domain_mlp is plain arrays at the coordinator: no module to adapt or export."""
    raw = {**BASE, "algorithm": "feddar_wa", "model": {"kind": "domain_mlp", "domains": 2},
           "adaptation": {"method": "finetune"}}
    with pytest.raises(jobspec.JobSpecError, match=r"^adaptation: the domain_mlp model has no torch module"):
        jobspec.from_dict(raw)


def test_the_coordinator_refuses_a_bad_adaptation_option_at_submit(tmp_path):
    """Over TLS: SubmitJob answers INVALID_ARGUMENT naming the field; no job is created."""

    async def main():
        async with in_process().whole_system(tmp_path, tls=True) as s:
            bad = spec("bad", 1, cohort=N) + "adaptation: {method: ewc, ewc_lambda: -1}\n"
            with pytest.raises(grpc.RpcError) as err:
                await s.submit(bad)
            stub, md = s.admin()
            return err.value, await asyncio.to_thread(stub.ListJobs, admin_pb2.ListJobsRequest(), metadata=md,
                                                      timeout=10)

    error, listed = run(main())
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "adaptation.ewc_lambda: must be >= 0, got -1" in error.details()
    assert not listed.jobs


def test_the_job_cli_validates_the_adaptation_example(capsys):
    from tally.cli import main as tally

    example = Path(__file__).resolve().parents[2] / "examples" / "fedavg_adapted.yaml"
    assert tally(["job", "validate", str(example), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["spec"]["adaptation"]["method"] == "ewc"


VALID = st.fixed_dictionaries({
    "method": st.sampled_from(METHODS),
    "epochs": st.integers(1, 1000),
    "lr": st.floats(1e-6, 10),
    "batch_size": st.integers(1, 65536),
    "seed": st.integers(0, 2**31),
    "validation": st.floats(0, 0.5),
    "local_only_epochs": st.integers(0, 1000),
})


@settings(max_examples=60, deadline=None)
@given(VALID)
def test_what_the_spec_accepts_reaches_the_device_unchanged(raw):
    """The coordinator's checked block, as JSON in the task, is the option the device runs."""
    block = jobspec.AdaptationSpec.model_validate(raw)
    option = JobAdaptation.from_json(block.option().to_json())
    assert option == block.option()
    assert option.options.method == raw["method"] and option.options.epochs == raw["epochs"]
    assert option.validation == raw["validation"] and option.local_only_epochs == raw["local_only_epochs"]
    assert jobspec.parse(jobspec.from_dict({**BASE, "adaptation": raw}).to_yaml()).adaptation == block


def test_the_spec_defaults_are_the_sdks():
    defaults = jobspec.AdaptationSpec(method="finetune").option()
    assert defaults == JobAdaptation(AdaptationOptions("finetune"))


@settings(max_examples=20, deadline=None)
@given(st.integers(2, 500), st.floats(0, 0.99), st.integers(0, 100))
def test_the_held_out_split_is_a_partition_leaving_something_to_train_on(n, share, seed):
    train, held = held_out_indices(n, share, seed)
    assert sorted([*train, *held]) == list(range(n)) and len(train) >= 1
    assert abs(len(held) - n * share) <= 1 or len(train) == 1


def test_a_device_keeps_the_federated_model_when_adaptation_makes_it_worse_on_held_out_examples():
    """An absurd learning rate wrecks the model: judged on the held-out examples, the device keeps
    G^T itself (spec 11 #5: choose on validation, never on test data)."""
    single_threaded()
    d = pathological_digits(N, 2, seed=0).devices[0]
    X, y = d.train
    trained = TorchTrainer(_factory, X, y).train(get_params(_factory()), 20, 0.1, 16)[0]
    wreck = JobAdaptation(AdaptationOptions("finetune", epochs=20, lr=10.0, batch_size=4), validation=0.3,
                          local_only_epochs=5)
    result = adapt_for_job(_factory(), trained, X, y, wreck)
    assert result.record["kept"] == "federated", result.record
    assert result.record["accuracy"]["adapted"] < result.record["accuracy"]["federated"]
    assert set(result.record["worse_off_than_local"]) == {"federated", "after_adaptation"}
    net = _factory()
    net.load_state_dict({k: torch.as_tensor(v) for k, v in trained.items()})
    with torch.no_grad():
        expected = net(torch.as_tensor(d.test[0], dtype=torch.float32)).numpy()
    np.testing.assert_allclose(OnnxModel.from_bytes(result.onnx).logits(d.test[0]), expected, atol=1e-4)


def test_owed_adaptations_survive_a_restart_and_an_unreadable_one_is_dropped(tmp_path):
    option = JobAdaptation(AdaptationOptions("distill", alpha=0.95), validation=0.1)
    AdaptedModels(tmp_path).expect("job/1", option)
    again = AdaptedModels(tmp_path)
    assert again.pending() == {"job/1": option}
    again.keep("job/1", b"onnx bytes", {"kept": "adapted"})
    assert AdaptedModels(tmp_path).pending() == {} and AdaptedModels(tmp_path).model("job/1") == b"onnx bytes"
    AdaptedModels(tmp_path).expect("job/1", option)  # already adapted: nothing owed again
    assert AdaptedModels(tmp_path).pending() == {}
    (tmp_path / "job2.adaptation-pending").write_text("{not json")
    assert AdaptedModels(tmp_path).pending() == {}
    assert not (tmp_path / "job2.adaptation-pending").exists()
    assert {p.stat().st_mode & 0o777 for p in tmp_path.iterdir()} == {0o600}
    memory = AdaptedModels(None)
    memory.expect("j", option)
    assert memory.pending() == {"j": option} and memory.model("j") is None


def test_a_failed_adaptation_is_counted_and_nothing_stays_owed():
    metrics = ClientMetrics()
    models = AdaptedModels(None, metrics)
    models.expect("j", JobAdaptation(AdaptationOptions("ewc")))
    models.failed("j", "ewc")
    assert models.pending() == {}
    assert metrics.registry.get_sample_value("tally_client_adaptations_total",
                                             {"method": "ewc", "outcome": "failed"}) == 1
