"""Model kinds (issue 9, item 9): the built-in cnn beside the mlp, and plug-ins an operator names on
the coordinator's command line, never a job spec."""

from __future__ import annotations

import argparse
import textwrap

import numpy as np
import pytest
import torch

from tally import models
from tally.algorithms.base import ModelMismatch
from tally.cli import coordinator as coordinator_cli
from tally.client.onnx_model import OnnxModel
from tally.coordinator.rounds.onnx_export import export_model
from tally.coordinator.spec import jobspec
from tally.coordinator.spec.catalogue import initial_model
from tally.coordinator.spec.jobspec import ModelSpec
from tally.models.params import get_params, set_params

SPEC = """name: m
algorithm: fedavg
rounds: 1
cohort_size: 10
min_cohort: 5
model: {{kind: {kind}, inputs: 64, classes: 10, hidden: 8}}
"""


@pytest.fixture
def plugins(tmp_path, monkeypatch):
    """A fresh model catalogue and an importable directory for plug-in modules."""
    monkeypatch.setattr(models, "_catalogue", None)
    monkeypatch.syspath_prepend(str(tmp_path))

    def write(name: str, body: str) -> str:
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(body))
        return name

    return write


def test_the_cnn_reads_the_mlps_64_features_and_exports_to_onnx():
    spec = ModelSpec(kind="cnn", inputs=64, classes=10, hidden=8, seed=3)
    params = initial_model(spec)
    assert set(params) == {"conv1.weight", "conv1.bias", "conv2.weight", "conv2.bias", "head.weight", "head.bias"}
    net = models.build("cnn", 64, 10, 8, 3)
    set_params(net, params)
    x = np.random.default_rng(0).normal(size=(5, 64)).astype(np.float32)
    with torch.no_grad():
        expected = net(torch.as_tensor(x)).numpy()
    onnx = OnnxModel.from_bytes(export_model(params, spec))
    np.testing.assert_allclose(onnx.logits(x), expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="square images"):
        models.build("cnn", 60, 10, 8, 0)


def test_parameters_of_another_model_are_refused_by_name():
    mlp_params = initial_model(ModelSpec(kind="mlp", hidden=8))
    with pytest.raises(ModelMismatch, match="conv1.weight missing"):
        set_params(models.build("cnn", 64, 10, 8, 0), mlp_params)
    wide = get_params(models.build("cnn", 64, 10, 16, 0))
    with pytest.raises(ModelMismatch, match=r"conv1.weight is \(16, 1, 3, 3\), the device's model \(8, 1, 3, 3\)"):
        set_params(models.build("cnn", 64, 10, 8, 0), wide)


def test_a_plug_in_model_is_available_only_once_the_operator_loads_it(plugins):
    name = plugins("tiny_models", """
        from torch import nn

        def tiny(inputs, classes, hidden, seed):
            return nn.Linear(inputs, classes)

        TALLY_MODELS = {"tiny": tiny}
    """)
    built_in = models.kinds()
    assert "tiny" not in built_in
    with pytest.raises(jobspec.JobSpecError) as refused:
        jobspec.parse(SPEC.format(kind="tiny"))
    assert str(refused.value).startswith("model.kind: 'tiny' is not one of [")
    assert all(repr(kind) in str(refused.value) for kind in built_in)
    assert models.load_plugins([name]) == ["tiny"]
    # Served by the same catalogue as packages' kinds, so a device declares it at check-in.
    assert models.versions()["tiny"] == models.UNVERSIONED
    assert models.catalogue().installed["tiny"].package == f"plug-in {name}"
    spec = jobspec.parse(SPEC.format(kind="tiny"))
    params = initial_model(spec.model)
    assert {k: v.shape for k, v in params.items()} == {"weight": (10, 64), "bias": (10,)}
    assert OnnxModel.from_bytes(export_model(params, spec.model)).logits(np.zeros((2, 64), np.float32)).shape == (2, 10)


def test_algorithms_list_shows_model_kinds_with_versions_a_plug_in_included(plugins, capsys):
    """What a device with ``--model-plugin`` declares at check-in is what ``tally algorithms list
    --model-plugin`` shows: tally's own kinds and the plug-in's, each with its version and source."""
    import json

    from tally.cli import main

    name = plugins("versioned_models", """
        from torch import nn
        from tally.models import Model

        def tiny(inputs, classes, hidden, seed):
            return nn.Linear(inputs, classes)

        TALLY_MODELS = {"tiny": Model("tiny", "2.0", tiny, summary="one linear layer")}
    """)
    assert main(["algorithms", "list", "--json", "--model-plugin", name]) == 0
    rows = {row["kind"]: row for row in json.loads(capsys.readouterr().out)["models"]}
    assert (rows["tiny"]["version"], rows["tiny"]["package"]) == ("2.0", f"plug-in {name}")
    assert (rows["mlp"]["version"], rows["mlp"]["package"]) == (models.versions()["mlp"], "tally")
    assert main(["algorithms", "list", "--model-plugin", "no_such_module"]) == 2
    assert "model plug-in 'no_such_module' cannot be imported" in capsys.readouterr().err


def test_bad_plug_ins_are_refused_with_the_reason(plugins):
    before = models.kinds()
    with pytest.raises(models.PluginError, match="'no_such_module' cannot be imported"):
        models.load_plugins(["no_such_module"])
    empty = plugins("empty_models", "X = 1\n")
    with pytest.raises(models.PluginError, match="defines no TALLY_MODELS"):
        models.load_plugins([empty])
    clash = plugins("clash_models", """
        from torch import nn
        TALLY_MODELS = {"mlp": lambda inputs, classes, hidden, seed: nn.Linear(inputs, classes)}
    """)
    with pytest.raises(models.PluginError, match="model kind 'mlp' is already taken"):
        models.load_plugins([clash])
    assert models.kinds() == before


def test_the_coordinator_command_names_a_plug_in_it_cannot_load(tmp_path, capsys):
    parser = argparse.ArgumentParser(prog="tally")
    coordinator_cli.register(parser.add_subparsers())
    args = parser.parse_args(["coordinator", "--state-dir", str(tmp_path / "state"), "--insecure",
                              "--listen", "127.0.0.1:0", "--model-plugin", "no_such_module"])
    assert args.run(args) == 2
    assert "model plug-in 'no_such_module' cannot be imported" in capsys.readouterr().err
    assert not (tmp_path / "state").exists()


@pytest.mark.parametrize("kind", ["mlp", "cnn", "energy_mlp", "domain_mlp"])
def test_each_built_in_layout_is_the_built_models_own(kind):
    """tally.models.layouts answers a job spec's check without torch; it must say what the module is."""
    from tally.coordinator.spec import catalogue
    from tally.models.layouts import layout

    for inputs, classes, hidden, domains in ((64, 10, 8, 3), (16, 3, 5, 1)):
        spec = type("Spec", (), {"kind": kind, "inputs": inputs, "classes": classes, "hidden": hidden,
                                 "domains": domains, "seed": 0})
        found = layout(kind, inputs, classes, hidden, domains)
        built = catalogue.initial_model(spec)
        assert {n: (v.shape, v.dtype.str) for n, v in built.items()} == {
            n: (tuple(shape), dtype) for n, (shape, dtype) in found.state.items()}
        assert list(built) == list(found.state)  # the order algorithms flatten them in
        if kind != "domain_mlp":
            net = models.build(kind, inputs, classes, hidden, 0)
            assert [n for n, _ in net.named_parameters()] == list(found.trainable)
    assert layout("no_such_kind", 64, 10, 8) is None


def test_the_cnn_layout_refuses_what_the_cnn_refuses():
    from tally.models.layouts import layout

    with pytest.raises(ValueError, match="square images"):
        layout("cnn", 60, 10, 8)


@pytest.mark.parametrize("kind", ["mlp", "cnn", "energy_mlp", "domain_mlp"])
def test_a_bundled_device_reads_the_jobs_model_off_its_parameters(kind):
    """`tally client`/`tally fleet` learn the job's model from what they download, flags only
    overriding it (tally.training.bundled)."""
    from tally.coordinator.spec import catalogue
    from tally.training.bundled import ModelShape, model_shape

    shape = ModelShape(kind, 64, 10, 12, 3 if kind == "domain_mlp" else 1)
    params = catalogue.initial_model(type("Spec", (), {**shape.__dict__, "seed": 0}))
    assert model_shape(params, 64) == shape
    assert model_shape({"model/" + k: v for k, v in params.items()} | {"alpha": np.ones(3)}, 64) == shape
    assert model_shape(params, 16) is None  # a model for other data
    assert model_shape({"w": np.zeros(3)}, 64) is None
