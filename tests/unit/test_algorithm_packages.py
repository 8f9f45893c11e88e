"""The algorithm catalogue fed by entry points (tally.algorithms.packages): tally's own entries load
through it, and each kind of bad package is refused at load, named, while the rest is served."""

from __future__ import annotations

import json
import textwrap
from importlib import metadata

import pytest

from tally.algorithms import builtin, packages
from tally.algorithms.packages import GROUP, Catalogue

PACKAGE = '''
from dataclasses import dataclass
from typing import ClassVar

from tally.algorithms.base import Options
from tally.algorithms.fedavg import FedAvgClient, FedAvgServer
from tally.algorithms.options import Option
from tally.algorithms.packages import Algorithm


@dataclass(frozen=True)
class GoodOptions(Options):
    options_of: ClassVar[str] = "good"
    local_lr: float = 0.1
    smoothing: float = 0.5
    local_epochs: int = 1
    batch_size: int = 32
    server_lr: float = 1.0
    delta_clip: float = 10.0
    frac_bits: int = 16
    example_cap: int = 1000


@dataclass(frozen=True)
class UnrangedOptions(GoodOptions):
    options_of: ClassVar[str] = "unranged"
    sharpness: float = 2.0


FIELDS = ("weighted_delta", "weight", "examples")
ROLES = {"weighted_delta": "clipped", "weight": "clipped", "examples": "withheld"}
MEANINGS = {"smoothing": Option("how much of last round's update is kept", ge=0, lt=1)}
GOOD = Algorithm("good", "2.1", GoodOptions, FedAvgServer, FedAvgClient, FIELDS, ROLES, options_meanings=MEANINGS)
UNRANGED = Algorithm("unranged", "1", UnrangedOptions, FedAvgServer, FedAvgClient, FIELDS, ROLES,
                     options_meanings={**MEANINGS, "sharpness": Option("how sharp")})
NO_ROLE = Algorithm("no_role", "1", GoodOptions, FedAvgServer, FedAvgClient, FIELDS,
                    {"weighted_delta": "clipped", "examples": "withheld"}, options_meanings=MEANINGS)
FEDAVG = Algorithm("fedavg", "9", GoodOptions, FedAvgServer, FedAvgClient, FIELDS, ROLES, options_meanings=MEANINGS)
NOT_AN_ALGORITHM = object()


def tiny_model(inputs, classes, hidden, seed):
    import torch

    return torch.nn.Linear(inputs, classes)
'''


@pytest.fixture
def module(tmp_path, monkeypatch):
    (tmp_path / "fake_algorithms.py").write_text(textwrap.dedent(PACKAGE))
    monkeypatch.syspath_prepend(str(tmp_path))
    return "fake_algorithms"


def entry(name: str, value: str) -> metadata.EntryPoint:
    return metadata.EntryPoint(name, value, GROUP)


def test_tally_declares_its_own_algorithms_as_entry_points_of_the_same_group():
    entries = packages.tally_entries()
    assert {e.name for e in entries} == set(packages.names())
    assert all(e.load() is getattr(builtin, e.value.split(":")[1]) for e in entries)
    assert all(packages.catalogue().installed[e.name].package == "tally" for e in entries)
    assert not packages.problems()


def test_a_good_package_is_served_with_its_version_and_its_own_options(module):
    own = [("tally", e) for e in packages.tally_entries()]
    catalogue = Catalogue([*own, ("acme-good", entry("good", f"{module}:GOOD"))])
    assert catalogue.installed["good"].package == "acme-good" and catalogue.installed["good"].algorithm.version == "2.1"
    assert not catalogue.refused
    algorithm = catalogue.installed["good"].algorithm
    assert algorithm.meaning("smoothing").bounds() == {"ge": 0, "lt": 1}
    assert algorithm.meaning("local_lr").meaning == "the device's learning rate"  # the shared table


@pytest.mark.parametrize(("value", "reason"), [
    ("no_such_module_anywhere:GOOD", "cannot be loaded (no_such_module_anywhere:GOOD): ModuleNotFoundError"),
    ("{module}:NOT_AN_ALGORITHM", "is a object, not a tally.algorithms.packages.Algorithm"),
    ("{module}:UNRANGED", "options class UnrangedOptions declares no meaning and range for: sharpness (no range)"),
    ("{module}:NO_ROLE", "privacy declaration names no role for payload field(s) ['weight']"),
])
def test_a_bad_entry_is_refused_by_package_and_entry_and_the_rest_is_served(module, value, reason):
    bad = entry("bad_one", value.format(module=module))
    catalogue = Catalogue([("acme-bad", bad), ("acme-good", entry("good", f"{module}:GOOD"))])
    assert list(catalogue.installed) == ["good"]
    [refused] = catalogue.refused
    assert (refused.package, refused.entry) == ("acme-bad", "bad_one")
    assert str(refused).startswith("package 'acme-bad' entry 'bad_one': " + reason), str(refused)


def test_two_packages_claiming_one_name_are_both_refused_and_a_built_in_name_stays_tallys(module):
    good = entry("good", f"{module}:GOOD")
    catalogue = Catalogue([("acme-one", good), ("acme-two", good)])
    assert not catalogue.installed
    assert sorted((r.package, r.entry) for r in catalogue.refused) == [("acme-one", "good"), ("acme-two", "good")]
    assert all("claimed by packages ['acme-one', 'acme-two']" in r.reason for r in catalogue.refused)

    own = next(e for e in packages.tally_entries() if e.name == "fedavg")
    catalogue = Catalogue([("acme-fork", entry("fedavg", f"{module}:FEDAVG")), ("tally", own)])
    assert catalogue.installed["fedavg"].package == "tally"
    assert [(r.package, r.entry) for r in catalogue.refused] == [("acme-fork", "fedavg")]


def test_an_in_process_algorithm_is_checked_like_an_entry_and_removed_after(module):
    import fake_algorithms

    with pytest.raises(ValueError, match="entry 'no_role': privacy declaration names no role for payload field"):
        with packages.installed(fake_algorithms.NO_ROLE):
            pass
    with packages.installed(fake_algorithms.GOOD, package="acme-good"):
        assert packages.versions()["good"] == "2.1"
    assert "good" not in packages.names()


def test_algorithms_list_shows_versions_packages_and_refusals(capsys):
    from tally.cli import main

    assert main(["algorithms", "list", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert {row["name"]: row["package"] for row in listed["algorithms"]}["fedavg"] == "tally"
    assert listed["refused"] == []


def test_model_kinds_from_packages_are_served_and_bad_ones_refused_by_package_and_entry(module):
    from tally import models

    loaded = models.ModelPackages([
        ("acme-models", "1.2", entry("tiny", f"{module}:tiny_model")),
        ("acme-broken", "1", entry("broken", "no_such_module_anywhere:tiny_model")),
        ("acme-odd", "1", entry("odd", f"{module}:NOT_AN_ALGORITHM")),
        ("acme-fork", "1", entry("mlp", f"{module}:tiny_model")),
        ("acme-one", "1", entry("twice", f"{module}:tiny_model")),
        ("acme-two", "1", entry("twice", f"{module}:tiny_model")),
    ])
    package, version, make = loaded.installed["tiny"]
    assert list(loaded.installed) == ["tiny"] and (package, version) == ("acme-models", "1.2")
    assert make(4, 3, 8, 0).out_features == 3
    refused = {(r.package, r.entry): r.reason for r in loaded.refused}
    assert refused[("acme-broken", "broken")].startswith("cannot be loaded (no_such_module_anywhere:tiny_model)")
    assert refused[("acme-odd", "odd")] == "is a object, not a model builder"
    assert refused[("acme-fork", "mlp")] == "model kind 'mlp' is built in"
    assert refused[("acme-one", "twice")] == refused[("acme-two", "twice")] == (
        "model kind 'twice' is claimed by packages ['acme-one', 'acme-two']")


def test_declarations_count_present_devices_and_name_the_versions_they_have():
    from tally.coordinator.rounds.declared_algorithms import PRESENT_S, DeclaredAlgorithms, problem
    from tally.wire.v1.coordinator_pb2 import InstalledAlgorithm

    now = [0.0]
    declared = DeclaredAlgorithms(lambda: now[0])
    declared.record("a", "p", [InstalledAlgorithm(name="fedavgm", version="0.1.0")])
    declared.record("b", "p", [InstalledAlgorithm(name="fedavgm", version="0.2.0")])
    legacy = declared.record("c", "p", [])  # an older SDK: tally's own, at this coordinator's versions
    assert ("fedavg", packages.versions()["fedavg"]) in legacy
    assert declared.count("p", "fedavgm", "0.1.0") == (1, 3)
    assert declared.none_can_run("p", "fedavgm", "0.1.0") is None
    now[0] = PRESENT_S / 2
    declared.record("b", "p", [InstalledAlgorithm(name="fedavgm", version="0.2.0")])
    now[0] = PRESENT_S + 1  # a and c are gone; b checked in since
    assert declared.count("p", "fedavgm", "0.1.0") == (0, 1)
    assert declared.none_can_run("p", "fedavgm", "0.1.0") == (
        "no device of population 'p' can run algorithm 'fedavgm' version '0.1.0': 1 device(s) checked in "
        "(version '0.2.0' on 1)")
    assert declared.none_can_run("elsewhere", "fedavgm", "0.1.0") is None  # nobody checked in: no verdict
    assert problem([InstalledAlgorithm(name="", version="1")]) is not None
    assert "at most 64" in problem([InstalledAlgorithm(name=f"a{i}", version="1") for i in range(65)])
