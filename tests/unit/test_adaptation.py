"""Local adaptation in the SDK (specs/local-adaptation.md): the loss oracles of 12.B, the gain/lose
count of 12.C, ONNX serving without torch, and the "who gains" report on pathological digits."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tally import algorithms
from tally.algorithms.base import flatten
from tally.client.adaptation import AdaptationOptions, adapt, distillation_loss, fisher_diagonal
from tally.datasets.personal import pathological_digits
from tally.models.mlp import mlp
from tally.models.onnx import export_onnx
from tally.models.params import get_params
from tally.sim.personalisation import local_only_accuracy, personal_fleet
from tally.sim.rounds import plain_sum, run_rounds
from tally.sim.who_gains import plot, share_worse, who_gains

FAST = {"local_epochs": 1, "local_lr": 0.05, "batch_size": 10}


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def device():
    """One device's digits (two classes) and a model that is not yet good on them."""
    d = pathological_digits(10, 2, seed=0).devices[0]
    return d.train[0], d.train[1], get_params(mlp(64, 10, seed=3))


def _distance(a, b) -> float:
    return float(np.linalg.norm(flatten(a) - flatten(b)))


def test_ewc_with_lambda_zero_is_finetuning_and_its_first_step_is_finetunings(device):
    """12.B.1: λ = 0 is FT step for step; the penalty's gradient is 0 at A = G^T, so one
    full-batch EWC step equals one FT step whatever λ."""
    X, y, start = device
    ft = adapt(mlp(64, 10), start, X, y, AdaptationOptions("finetune", epochs=3, batch_size=8))
    ewc0 = adapt(mlp(64, 10), start, X, y, AdaptationOptions("ewc", epochs=3, batch_size=8, ewc_lambda=0.0))
    np.testing.assert_array_equal(flatten(ft), flatten(ewc0))
    one = dict(epochs=1, batch_size=len(y))
    np.testing.assert_allclose(flatten(adapt(mlp(64, 10), start, X, y, AdaptationOptions("finetune", **one))),
                               flatten(adapt(mlp(64, 10), start, X, y,
                                             AdaptationOptions("ewc", ewc_lambda=50.0, **one))),
                               atol=1e-7)


def test_ewc_anchors_harder_as_lambda_grows_while_stable(device):
    """12.B.1: ||A − G^T|| shrinks as λ grows, within lr·λ·max F < 2 (explicit SGD stays stable)."""
    X, y, start = device
    fisher = fisher_diagonal(mlp(64, 10), start, X, y)
    assert all((v >= 0).all() for v in fisher.values())
    top = max(float(v.max()) for v in fisher.values())
    lr = 0.05
    lambdas = [0.0, 0.2 / (lr * top), 1.0 / (lr * top), 1.9 / (lr * top)]
    moved = [_distance(adapt(mlp(64, 10), start, X, y, AdaptationOptions("ewc", epochs=10, lr=lr, ewc_lambda=lam)),
                       start) for lam in lambdas]
    assert all(a > b for a, b in zip(moved, moved[1:])), moved


def test_fisher_is_the_mean_squared_per_example_gradient(device):
    X, y, start = device
    net = mlp(64, 10)
    fisher = fisher_diagonal(net, start, X[:5], y[:5])
    from tally.models.params import set_params

    set_params(net, start)
    squares = []
    for i in range(5):
        net.zero_grad()
        torch.nn.functional.cross_entropy(net(torch.as_tensor(X[i : i + 1])), torch.as_tensor(y[i : i + 1])).backward()
        squares.append({k: p.grad.numpy() ** 2 for k, p in net.named_parameters()})
    for k in fisher:
        np.testing.assert_allclose(fisher[k], np.mean([s[k] for s in squares], axis=0), rtol=1e-4, atol=1e-10)


def test_distillation_first_step_is_the_scaled_hard_step(device):
    """12.B.2: at A = G^T the KL term and its gradient are 0, so one full-batch KD step is the CE
    step scaled by the hard term's weight: (1 − α) (code form), α·K² (paper form); with hard
    weight 0 the student never moves."""
    X, y, start = device
    one = dict(epochs=1, batch_size=len(y))
    for form, alpha, weight in (("hinton", 0.7, 0.3), ("paper", 0.2, 0.2 * 36)):
        kd = adapt(mlp(64, 10), start, X, y, AdaptationOptions("distill", alpha=alpha, temperature=6.0, kd_form=form,
                                                              lr=0.01, **one))
        ft = adapt(mlp(64, 10), start, X, y, AdaptationOptions("finetune", lr=0.01 * weight, **one))
        np.testing.assert_allclose(flatten(kd), flatten(ft), atol=1e-6)
    still = adapt(mlp(64, 10), start, X, y, AdaptationOptions("distill", alpha=1.0, epochs=3))
    np.testing.assert_allclose(flatten(still), flatten(start), atol=1e-6)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.floats(-4, 4), min_size=5, max_size=5), st.lists(st.floats(-4, 4), min_size=5, max_size=5),
       st.floats(1.0, 10.0))
def test_soft_term_gradient_and_its_large_temperature_limit(z, t, k):
    """12.B.2: ∂(K²·KL(softmax(t/K) ‖ softmax(z/K)))/∂z = K·(softmax(z/K) − softmax(t/K)); KL >= 0."""
    student = torch.tensor([z], dtype=torch.float64, requires_grad=True)
    teacher = torch.tensor([t], dtype=torch.float64)
    soft = distillation_loss(student, teacher, torch.tensor([0]), alpha=1.0, temperature=k)
    soft.backward()
    assert soft.item() >= -1e-12
    expected = k * (torch.softmax(student.detach() / k, 1) - torch.softmax(teacher / k, 1))
    np.testing.assert_allclose(student.grad.numpy(), expected.numpy(), atol=1e-9)


def test_large_temperature_soft_term_is_the_centred_logit_distance():
    z, t = np.array([1.0, -0.5, 2.0, 0.3]), np.array([0.2, 0.4, -1.0, 1.5])
    soft = distillation_loss(torch.tensor(z[None]), torch.tensor(t[None]), torch.tensor([0]), 1.0, 1000.0).item()
    assert soft == pytest.approx(np.sum(((z - z.mean()) - (t - t.mean())) ** 2) / (2 * 4), rel=1e-2)


@pytest.mark.filterwarnings("ignore:reduction. 'mean' divides")
def test_kl_mean_reduction_is_batchmean_over_classes():
    """12.B.4: the authors' KLDivLoss('mean') divides by the class count as well."""
    rng = np.random.default_rng(0)
    logp = torch.log_softmax(torch.tensor(rng.normal(size=(6, 10))), 1)
    q = torch.softmax(torch.tensor(rng.normal(size=(6, 10))), 1)
    mean = torch.nn.functional.kl_div(logp, q, reduction="mean")
    batchmean = torch.nn.functional.kl_div(logp, q, reduction="batchmean")
    assert mean.item() == pytest.approx(batchmean.item() / 10)


def test_freeze_base_moves_only_the_top_layer(device):
    """12.B.3: every frozen tensor is bit-identical to G^T; only the top layer's tensors differ."""
    X, y, start = device
    adapted = adapt(mlp(64, 10), start, X, y, AdaptationOptions("freeze_base", epochs=3))
    for k in ("0.weight", "0.bias"):
        np.testing.assert_array_equal(adapted[k], start[k])
    for k in ("2.weight", "2.bias"):
        assert not np.array_equal(adapted[k], start[k])
    chosen = adapt(mlp(64, 10), start, X, y, AdaptationOptions("freeze_base", epochs=1, trainable=("0.*",)))
    np.testing.assert_array_equal(chosen["2.weight"], start["2.weight"])
    with pytest.raises(ValueError, match="matches none"):
        adapt(mlp(64, 10), start, X, y, AdaptationOptions("freeze_base", trainable=("head.*",)))


def test_options_are_validated():
    from tally.cli.simulate import ADAPTATIONS
    from tally.client.adaptation import METHODS

    assert ADAPTATIONS == METHODS  # --adapt's choices, named without importing the SDK
    with pytest.raises(ValueError, match="method"):
        AdaptationOptions("retrain")
    with pytest.raises(ValueError, match="unknown adaptation options"):
        AdaptationOptions.from_dict({"lambda": 3})
    with pytest.raises(ValueError, match="alpha"):
        AdaptationOptions("distill", alpha=1.5)
    assert AdaptationOptions.from_dict({"method": "freeze_base", "trainable": "2.*"}).trainable == ("2.*",)


def test_gain_lose_count_is_strict():
    """12.C.1: a tie is not a loss."""
    assert share_worse(np.array([0.5, 0.9, 0.7]), np.array([0.5, 0.8, 0.9])) == pytest.approx(1 / 3)


def test_adapted_model_is_served_by_onnx_runtime_without_torch(tmp_path, device):
    """The adapted model's ONNX export, run by tally.client.OnnxModel in a process where torch
    cannot be imported, gives torch's logits."""
    X, y, start = device
    net = mlp(64, 10)
    adapted = adapt(net, start, X, y, AdaptationOptions("finetune", epochs=2))
    (tmp_path / "model.onnx").write_bytes(export_onnx(net, adapted, 64))
    np.save(tmp_path / "x.npy", X[:7])
    script = (
        "import sys\n"
        "class NoTorch:\n"  # any import of torch now fails
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'torch': raise ImportError('torch is blocked')\n"
        "sys.meta_path.insert(0, NoTorch())\n"
        "import numpy as np\n"
        "from tally.client.onnx_model import OnnxModel\n"
        f"m = OnnxModel.from_path({str(tmp_path / 'model.onnx')!r})\n"
        f"np.save({str(tmp_path / 'logits.npy')!r}, m.logits(np.load({str(tmp_path / 'x.npy')!r})))\n"
        "assert 'torch' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=60)
    from tally.models.params import set_params

    set_params(net, adapted)
    with torch.no_grad():
        expected = net(torch.as_tensor(X[:7])).numpy()
    np.testing.assert_allclose(np.load(tmp_path / "logits.npy"), expected, atol=1e-5)


def test_who_gains_adaptation_cuts_the_share_worse_off_than_local_only(tmp_path):
    """The paper's central figure on pathological digits: FedAvg's global model loses to most
    devices' local models; adapted on each device (technique chosen on its validation split), far
    fewer. JSON-ready report and plot."""
    data = pathological_digits(20, 2, seed=0)
    factory = lambda: mlp(64, 10, seed=0)  # noqa: E731
    fleet = personal_fleet(data, factory)
    server, client = algorithms.make("fedavg", FAST)
    state, _ = run_rounds(server, client, fleet.devices, fleet.initial, 20, 10, plain_sum)
    local_only, _ = local_only_accuracy(personal_fleet(data, factory), 30, 0.05, 10)
    methods = [AdaptationOptions(m, epochs=10, lr=0.05, batch_size=10)
               for m in ("finetune", "freeze_base", "ewc", "distill")]
    report = who_gains(fleet, [server.model(state)] * 20, local_only, methods)
    shares = report["share_worse_than_local"]
    print(f"who gains: mean {report['mean']}, share worse than local-only {shares}")
    assert shares["federated"] >= 0.5
    assert shares["adapted"] <= shares["federated"] - 0.4
    assert report["mean"]["adapted"] > report["mean"]["federated"]
    assert set(report["adapted_method"]) <= {"finetune", "freeze_base", "ewc", "distill"}
    json.dumps(report)
    path = plot(report, tmp_path / "who_gains.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_simulate_reports_personal_accuracy_uploads_and_who_gains(tmp_path, capsys):
    """``tally simulate`` on a personal dataset: each device's personal model on its own test split,
    the values uploaded, and with --adapt the who-gains JSON and plot; --adapt elsewhere is refused."""
    from tally.cli import main

    base = ["simulate", "--dataset", "pathological-digits", "--clients", "10", "--rounds", "4", "--plain"]
    assert main([*base, "--algorithm", "lg_fedavg", "--option", "warmup_rounds=2",
                 "--json", str(tmp_path / "lg.json")]) == 0
    assert main([*base, "--adapt", "finetune", "--adapt", "ewc", "--adapt-epochs", "3",
                 "--json", str(tmp_path / "fedavg.json")]) == 0
    lg, fedavg = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("lg", "fedavg"))
    assert len(lg["personal"]["per_device_accuracy"]) == 10
    assert lg["uploaded_values"] == 10 * (2 * 4_812 + 2 * 652) and fedavg["uploaded_values"] == 10 * 4 * 4_812
    who = fedavg["who_gains"]
    assert set(who["per_method_test_accuracy"]) == {"finetune", "ewc"} and who["devices"] == 10
    assert (tmp_path / "who-gains-fedavg.png").read_bytes()[:4] == b"\x89PNG"
    assert "worse off than local-only" in capsys.readouterr().out
    assert main(["simulate", "--adapt", "finetune", "--clients", "10", "--rounds", "1",
                 "--json", str(tmp_path / "x.json")]) == 2
    assert "--adapt" in capsys.readouterr().err


def test_adapt_then_average_is_one_full_participation_fedavg_round():
    """12.E: fine-tuning every device k epochs from G^T and averaging (example-weighted) is one
    FedAvg round with every device, E = k, from G^T, given the same shuffling streams."""
    data = pathological_digits(6, 2, seed=1)
    factory = lambda: mlp(64, 10, seed=0)  # noqa: E731
    fleet = personal_fleet(data, factory)
    start = fleet.initial
    server, client = algorithms.make("fedavg", {"local_epochs": 3, "local_lr": 0.01, "batch_size": 10})
    state, _ = run_rounds(server, client, fleet.devices, start, 1, 6, plain_sum)
    fresh = personal_fleet(data, factory)
    adapted = [adapt(factory(), start, d.features.cpu().numpy(), d.labels.cpu().numpy(),
                     AdaptationOptions("finetune", epochs=3, lr=0.01, batch_size=10, seed=i))
               for i, d in enumerate(fresh.devices)]
    sizes = np.array([d.num_examples for d in fresh.devices], dtype=np.float64)
    average = sum(n * flatten(a) for n, a in zip(sizes, adapted)) / sizes.sum()
    np.testing.assert_allclose(flatten(server.model(state)), average, atol=1e-6)
    assert np.max(np.abs(average - flatten(start))) > 1e-3
