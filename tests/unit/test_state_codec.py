"""Every algorithm's server state survives the coordinator's checkpoint format exactly.

Each algorithm runs its server half for two rounds in-process on a small dataset that suits it,
so the state holds what a real job carries (moments, windows, histories), then goes through
``state_to_bytes`` / ``state_from_bytes`` against a fresh ``server.init`` template.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from tally import algorithms
from tally.coordinator.state.state_codec import UnsupportedState, state_from_bytes, state_to_bytes
from tally.sim.rounds import plain_sum, run_rounds
from tally.sim.scenarios import ScenarioArgs, build

# algorithm -> (dataset, extra options): the smallest setting that exercises its whole state.
CASES = {
    "fedavg": ("toy-regression", {}),
    "agnostic_fedavg": ("toy-regression", {"server_optimizer": "adam", "server_lr": 0.1}),
    "aaggff_d": ("heterogeneous-digits", {}),
    "aaggff_s": ("heterogeneous-digits", {"solver": "ons", "reveal": ["response"]}),
    "aaggff_s_separable": ("heterogeneous-digits", {"solver": "separable"}),
    "feddar_wa": ("domain-linear", {}),
    "feddar_sa": ("domain-linear", {}),
}


def assert_same(back: Any, state: Any, where: str) -> None:
    """Equal, of the same type, field by field (arrays by dtype, shape and bits; NaN == NaN)."""
    assert type(back) is type(state), where
    if dataclasses.is_dataclass(state):
        for f in dataclasses.fields(state):
            assert_same(getattr(back, f.name), getattr(state, f.name), f"{where}.{f.name}")
    elif isinstance(state, dict):
        assert list(back) == list(state), where
        for key in state:
            assert_same(back[key], state[key], f"{where}[{key!r}]")
    elif isinstance(state, (list, tuple)):
        assert len(back) == len(state), where
        for i, (b, s) in enumerate(zip(back, state)):
            assert_same(b, s, f"{where}[{i}]")
    elif isinstance(state, (np.ndarray, np.generic)):
        assert back.dtype == state.dtype and np.shape(back) == np.shape(state), where
        assert np.array_equal(back, state, equal_nan=back.dtype.kind in "fc"), where
    elif isinstance(state, float) and math.isnan(state):
        assert math.isnan(back), where
    else:
        assert back == state, where


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_algorithms_server_state_round_trips_exactly(case):
    dataset, extra = CASES[case]
    name = case.removesuffix("_separable")
    scenario = build(dataset, ScenarioArgs(clients=6, domains=3, samples=20, seed=1, algorithm=name))
    options = scenario.options(name, extra)
    server, client = algorithms.make(name, options)
    state, _ = run_rounds(server, client, scenario.devices, scenario.initial, rounds=2,
                          cohort_size=len(scenario.devices), sum_fn=plain_sum, seed=1,
                          reveal=options.get("reveal", ()))
    template = algorithms.make(name, options)[0].init(scenario.initial)
    data = state_to_bytes(state)
    assert b"pickle" not in data
    assert_same(state_from_bytes(data, template), state, type(state).__name__)
    # The round trip is not trivially the template: two rounds changed the state.
    with pytest.raises(AssertionError):
        assert_same(template, state, type(state).__name__)


@dataclass(frozen=True)
class Inner:
    moments: tuple[np.ndarray, ...]
    scale: np.float32


@dataclass(frozen=True)
class Outer:
    inner: Inner
    history: list[float]
    tables: dict[str, dict[str, np.ndarray]]
    best: float = float("nan")
    label: str | None = None


def test_nested_containers_numpy_scalars_and_refusals():
    state = Outer(
        Inner((np.arange(3, dtype=np.int16), np.eye(2), np.array(2.5)), np.float32(0.5)),
        [1.0, -math.inf, 2.5],
        {"a/b": {"w": np.ones((2, 1), dtype=np.float32)}, "c": {}},
        label="x",
    )
    template = Outer(Inner((), np.float32(0)), [], {})
    assert_same(state_from_bytes(state_to_bytes(state), template), state, "Outer")

    # The bytes cannot pick the type: a template without a dataclass where the blob has one.
    @dataclass(frozen=True)
    class Flat:
        inner: Any
        history: Any
        tables: Any
        best: Any
        label: Any

    with pytest.raises(ValueError, match="dataclass at Flat.inner"):
        state_from_bytes(state_to_bytes(state), Flat(None, None, None, None, None))
    with pytest.raises(ValueError, match="has fields"):
        state_from_bytes(state_to_bytes(state), Inner((), np.float32(0)))
    with pytest.raises(ValueError, match="format TALLYS2"):
        state_from_bytes(b"TALLYS1\n" + state_to_bytes(state)[8:], template)
    for bad, where in [
        (Outer(Inner(([1.0],), np.float32(0)), [], {}), r"Outer.inner.moments\[0\]"),
        (Outer(Inner((), np.float32(0)), [], {1: {}}), "keys that are not strings"),
        (Outer(Inner((np.array([object()]),), np.float32(0)), [], {}), "dtype object"),
    ]:
        with pytest.raises(UnsupportedState, match=where):
            state_to_bytes(bad)


def test_model_and_state_blobs_share_one_header_parser_and_are_told_apart():
    from tally import modelio

    model = modelio.serialize({"w": np.arange(3.0)})
    state = state_to_bytes(Inner((np.eye(2),), np.float32(1)))
    template = Inner((), np.float32(0))
    assert modelio.unpack_header(model, b"TALLYM1\n", "model") == (
        [{"name": "w", "dtype": "<f8", "shape": [3]}], len(model) - 24)
    with pytest.raises(ValueError, match="not a Tally state blob of format TALLYS2"):
        state_from_bytes(model, template)
    with pytest.raises(ValueError, match="not a Tally model blob of format TALLYM1"):
        modelio.deserialize(state)
    # The header's first byte (12: after the 8-byte magic and the u32 length) no longer JSON.
    with pytest.raises(ValueError, match="corrupt model header"):
        modelio.deserialize(model[:12] + b"!" + model[13:])
    with pytest.raises(ValueError, match="corrupt state header"):
        state_from_bytes(state[:12] + b"!" + state[13:], template)
