"""The algorithm contract of ``tally.algorithms.base``: the one options parser every algorithm uses,
the step flags and protocols the runners rely on, and the recipe's example algorithm
(``examples/evaluated_average.py``) registered and run end to end through the real secure sum."""

from __future__ import annotations

import importlib.util
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from support.devices import QuadraticDevice
from tally import algorithms
from tally.algorithms import aaggff, fedavg, lg_fedavg, superfed
from tally.algorithms.base import Options, PersonalBroadcast, PersonalisedClient
from tally.coordinator.spec import catalogue
from tally.secagg import ThreatModel
from tally.sim.rounds import SecureSum, run_rounds

REPO = Path(__file__).resolve().parents[2]


def _example():
    """examples/evaluated_average.py as a module (examples/ is not a package)."""
    name = "evaluated_average_example"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, REPO / "examples" / "evaluated_average.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses and the options parser resolve annotations through it
        spec.loader.exec_module(module)
    return sys.modules[name]


# -- the one options parser ------------------------------------------------------------------------


@dataclass(frozen=True)
class _Toy(Options):
    options_of: ClassVar[str] = "toy"

    names: tuple[str, ...] = ()
    span: tuple[float, float] | None = None
    rounds: int = 1


@pytest.mark.parametrize("name", algorithms.NAMES)
def test_every_algorithm_parses_its_options_with_the_one_parser_naming_itself(name):
    options_class = algorithms.options_type(name)
    assert issubclass(options_class, Options) and "from_dict" not in vars(options_class)
    assert options_class.options_of == name
    with pytest.raises(ValueError, match=rf"^unknown {name} options \['no_such_option'\]$"):
        options_class.from_dict({"no_such_option": 1})


@settings(max_examples=60, deadline=None)
@given(names=st.one_of(st.text(max_size=5), st.lists(st.text(max_size=5), max_size=4)),
       span=st.one_of(st.none(), st.lists(st.integers(-5, 5), min_size=2, max_size=2)),
       rounds=st.integers(0, 9))
def test_tuple_options_take_a_list_or_one_string_and_the_rest_pass_through(names, span, rounds):
    parsed = _Toy.from_dict({"names": names, "span": span, "rounds": rounds})
    assert parsed.names == ((names,) if isinstance(names, str) else tuple(names))
    assert parsed.span is None if span is None else parsed.span == tuple(float(v) for v in span)
    assert parsed.span is None or all(type(v) is float for v in parsed.span)
    assert parsed.rounds == rounds
    assert _Toy.from_dict(None) == _Toy() == _Toy.from_dict({})


def test_a_tuple_option_given_a_scalar_is_refused_by_name():
    with pytest.raises(ValueError, match="^toy option names takes a list, got 3$"):
        _Toy.from_dict({"names": 3})
    with pytest.raises(ValueError, match=r"^unknown toy options \['options_of'\]$"):  # a ClassVar is no option
        _Toy.from_dict({"options_of": "other"})


# -- step flags and the protocols runners rely on ---------------------------------------------------


def test_the_one_algorithm_with_flagged_steps_declares_what_runners_call():
    options = aaggff.AAggFFSOptions(num_clients=3, reveal=("response",))
    server = aaggff.AAggFFSServer(options)
    flags = {s.name: (s.reveal, s.personal) for s in server.steps(server.init({"w": np.zeros(2)}))}
    assert flags == {aaggff.LOSS: ((), False), aaggff.RESPONSE: (("response",), False), aaggff.UPDATE: ((), True)}
    assert isinstance(server, PersonalBroadcast)
    plain = fedavg.FedAvgServer()  # an algorithm that keeps the one rule sets no flag
    assert [(s.reveal, s.personal) for s in plain.steps(plain.init({"w": np.zeros(2)}))] == [((), False)]
    assert not isinstance(plain, PersonalBroadcast)


def test_personalised_client_halves_are_the_personalised_algorithms():
    assert isinstance(lg_fedavg.LGFedAvgClient(), PersonalisedClient)
    assert isinstance(superfed.SuPerFedClient(), PersonalisedClient)
    assert not isinstance(fedavg.FedAvgClient(), PersonalisedClient)


def test_no_module_reads_a_step_flag_or_a_protocol_method_by_name():
    by_name = re.compile(r"\b(?:getattr|hasattr)\([^,()]+, \"(?:reveal|personal|personal_model|broadcast_to)\"")
    found = [f"{path.relative_to(REPO)}:{n}" for top in ("tally", "tests")
             for path in (REPO / top).rglob("*.py")
             for n, line in enumerate(path.read_text().splitlines(), 1) if by_name.search(line)]
    assert not found, found


# -- the recipe's example, registered and run through the secure sum --------------------------------


class Recorder:
    """Wraps a server half and a sum: what each device contributed, who counted, what apply got."""

    def __init__(self, server, sum_fn) -> None:
        self.server, self.sum_fn = server, sum_fn
        self.contributions, self.contributors, self.applied = {}, {}, []

    def __getattr__(self, name):  # init, steps, broadcast, model: the server's own
        return getattr(self.server, name)

    def apply(self, state, step, total):
        after = self.server.apply(state, step, total)
        self.applied.append((state.round, step, dict(total), after))
        return after

    def __call__(self, round_, step, contributions):
        total, contributors = self.sum_fn(round_, step, contributions)
        self.contributions[(round_, step.name)] = dict(contributions)
        self.contributors[(round_, step.name)] = contributors
        return total, contributors


@pytest.fixture(scope="module")
def example():
    module = _example()
    catalogue.register_algorithm("evaluated_average", module.make_server)
    yield module
    catalogue.unregister_algorithm("evaluated_average")


@settings(max_examples=8, deadline=None)
@given(targets=st.lists(st.lists(st.floats(-2, 2), min_size=3, max_size=3), min_size=5, max_size=8),
       rounds=st.integers(1, 3), server_lr=st.sampled_from([0.5, 1.0]), dropout=st.sampled_from([0.0, 0.2]),
       seed=st.integers(0, 100))
def test_the_example_algorithm_runs_end_to_end_and_its_server_sees_exactly_the_sums(
        example, targets, rounds, server_lr, dropout, seed):
    options = {"local_epochs": 2, "local_lr": 0.3, "server_lr": server_lr}
    assert "evaluated_average" in catalogue.algorithm_names()
    server = catalogue.make_server("evaluated_average", options)
    client = example.EvaluatedAverageClient(example.EvaluatedAverageOptions.from_dict(options))
    devices = [QuadraticDevice(np.array(t)) for t in targets]
    secure = SecureSum(ThreatModel(dropout_rate=0.2, corrupt_rate=0.0, malicious_server=False), dropout, seed)
    recorder = Recorder(server, secure)
    local: dict[int, int] = {}
    initial = {"w": np.zeros(3)}
    state, _ = run_rounds(recorder, client, devices, initial, rounds, len(devices), recorder, seed=seed,
                             local_states=local)

    # Every total apply() got is the sum of what the devices that counted contributed, and nothing else.
    assert [a[:2] for a in recorder.applied] == [(r, s) for r in range(rounds) for s in ("update", "evaluate")]
    schemas = {s.name: s.schema for s in server.steps(state)}
    w = initial["w"]
    for round_, step, total, after in recorder.applied:
        counted = recorder.contributors[(round_, step)]
        sent = recorder.contributions[(round_, step)]
        assert len(counted) >= len(devices) - int(dropout * len(devices))
        assert int(total["count"]) == len(counted)  # counts are exact
        field = "delta" if step == "update" else "loss"
        plain = sum(np.asarray(sent[d][field], dtype=np.float64) for d in counted)
        assert np.abs(np.asarray(total[field]) - plain).max() <= schemas[step].quantisation_bound(len(counted))[field]
        if step == "update":  # the reference model, from the devices' own updates
            w = w + server_lr * np.mean([devices[d].train({"w": w}, 2, 0.3, 16)[0]["w"] - w for d in counted], axis=0)
        else:  # the round's mean loss is of the model just made, over the devices that counted
            assert np.isclose(after.mean_loss, np.mean([devices[d].evaluate({"w": w})[0] for d in counted]), atol=1e-4)
    np.testing.assert_allclose(server.model(state)["w"], w, atol=1e-4)
    assert state.round == rounds
    # A device's local state (its rounds taken part in) advanced only where its update counted.
    for d in range(len(devices)):
        taken_part = sum(d in recorder.contributors[(r, "update")] for r in range(rounds))
        assert (local.get(d) or 0) == taken_part  # None: never counted


def test_the_example_refuses_a_round_no_device_counted_in(example):
    server = catalogue.make_server("evaluated_average", None)
    state = server.init({"w": np.zeros(2)})
    with pytest.raises(ValueError, match="no device contributed to the 'update' sum"):
        server.apply(state, "update", {"delta": np.zeros(2), "count": np.int64(0)})
    with pytest.raises(ValueError, match=r"unknown evaluated_average options \['lr'\]"):
        catalogue.make_server("evaluated_average", {"lr": 0.1})
