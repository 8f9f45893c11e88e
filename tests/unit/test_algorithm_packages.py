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


from tally.models import Model  # noqa: E402

TINY = Model("tiny", "1.2", tiny_model)
NO_VERSION = Model("no_version", "", tiny_model)
NO_BUILDER = Model("no_builder", "1", None)
FORK = Model("mlp", "9", tiny_model)
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
    assert catalogue.installed["good"].package == "acme-good" and catalogue.installed["good"].item.version == "2.1"
    assert not catalogue.refused
    algorithm = catalogue.installed["good"].item
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


def test_model_kinds_load_through_the_same_catalogue_and_bad_ones_are_refused_by_package_and_entry(module):
    """Tally's own model kinds are entries of ``tally.models`` loaded by the algorithms' catalogue;
    a package's kind is served with its version, and each bad entry is refused, named, while the
    rest are still served."""
    from tally import models

    own = [("tally", e) for e in packages.tally_entries(models.GROUP)]
    assert {e.name for _, e in own} == {"mlp", "cnn", "energy_mlp"}

    def model_entry(name: str, value: str) -> metadata.EntryPoint:
        return metadata.EntryPoint(name, value, models.GROUP)

    loaded = Catalogue(own + [
        ("acme-models", model_entry("tiny", f"{module}:TINY")),
        ("acme-broken", model_entry("broken", "no_such_module_anywhere:TINY")),
        ("acme-bare", model_entry("bare", f"{module}:tiny_model")),
        ("acme-unversioned", model_entry("no_version", f"{module}:NO_VERSION")),
        ("acme-nobuild", model_entry("no_builder", f"{module}:NO_BUILDER")),
        ("acme-misnamed", model_entry("small", f"{module}:TINY")),
        ("acme-fork", model_entry("mlp", f"{module}:FORK")),
    ], models.check, noun="model kind")
    assert list(loaded.installed) == ["mlp", "cnn", "energy_mlp", "tiny"]
    mlp = loaded.installed["mlp"]
    assert mlp.package == "tally" and mlp.item.version == packages.versions()["fedavg"]
    tiny = loaded.installed["tiny"]
    assert (tiny.package, tiny.item.version) == ("acme-models", "1.2")
    assert tiny.item.builder(4, 3, 8, 0).out_features == 3
    refused = {(r.package, r.entry): r.reason for r in loaded.refused}
    assert refused[("acme-broken", "broken")].startswith("cannot be loaded (no_such_module_anywhere:TINY)")
    assert refused[("acme-bare", "bare")] == "is a function, not a tally.models.Model"
    assert refused[("acme-unversioned", "no_version")] == "has no name or no version"
    assert refused[("acme-nobuild", "no_builder")].startswith("builder is a NoneType, not a callable")
    assert refused[("acme-misnamed", "small")] == "entry 'small' names model kind 'tiny'; they must be the same"
    assert refused[("acme-fork", "mlp")] == "model kind 'mlp' is claimed by packages ['acme-fork', 'tally']"
    assert len(refused) == 6


def test_declarations_count_present_devices_and_name_the_versions_they_have():
    from tally import models
    from tally.coordinator.rounds.declared_algorithms import PRESENT_S, DeclaredAlgorithms, Requirement, problem
    from tally.wire.v1.coordinator_pb2 import Capabilities, InstalledAlgorithm, InstalledModel

    def declaring(version: str, model: str = "1", capabilities: tuple[str, ...] = ()) -> Capabilities:
        return Capabilities(algorithms=[InstalledAlgorithm(name="fedavgm", version=version)],
                            models=[InstalledModel(name="tiny", version=model)], trainer_capabilities=capabilities)

    fedavgm = Requirement("fedavgm", "0.1.0", "tiny", "1", ())
    now = [0.0]
    declared = DeclaredAlgorithms(lambda: now[0])
    declared.record("a", "p", declaring("0.1.0"))
    declared.record("b", "p", declaring("0.2.0"))
    legacy = declared.record("c", "p", Capabilities())  # an older SDK: tally's own, at this coordinator's versions
    assert ("fedavg", packages.versions()["fedavg"]) in legacy.algorithms
    assert ("mlp", models.versions()["mlp"]) in legacy.models and legacy.capabilities == {"domain_statistics"}
    assert declared.count("p", fedavgm) == (1, 3)
    assert declared.none_can_run("p", fedavgm) is None
    now[0] = PRESENT_S / 2
    declared.record("b", "p", declaring("0.2.0"))
    now[0] = PRESENT_S + 1  # a and c are gone; b checked in since
    assert declared.count("p", fedavgm) == (0, 1)
    assert declared.none_can_run("p", fedavgm) == (
        "no device of population 'p' can run algorithm 'fedavgm' version '0.1.0': 1 device(s) checked in "
        "(version '0.2.0' on 1)")
    assert declared.none_can_run("elsewhere", fedavgm) is None  # nobody checked in: no verdict

    # The model kind at its version, and the trainer capabilities the algorithm needs, count too.
    declared.record("d", "q", declaring("0.1.0", model="2"))
    declared.record("e", "q", declaring("0.1.0", model="2", capabilities=("domain_statistics",)))
    assert declared.none_can_run("q", fedavgm) == (
        "no device of population 'q' can run model kind 'tiny' version '1': 2 device(s) checked in "
        "(version '2' on 2)")
    needing = Requirement("fedavgm", "0.1.0", "tiny", "2", ("domain_statistics", "gpu_hessians"))
    assert declared.count("q", needing) == (0, 2)
    assert declared.none_can_run("q", needing) == (
        "no device of population 'q' offers trainer capability 'gpu_hessians', which algorithm 'fedavgm' needs: "
        "2 device(s) checked in (none declares it)")
    assert declared.count("q", Requirement("fedavgm", "0.1.0", "tiny", "2", ("domain_statistics",))) == (1, 2)
    # A kind registered in the coordinator's process only has no version: nobody is asked for it.
    assert declared.count("q", Requirement("fedavgm", "0.1.0", "toy-scalar", "", ())) == (2, 2)

    assert problem(Capabilities(algorithms=[InstalledAlgorithm(name="", version="1")])) is not None
    assert "at most 64" in problem(Capabilities(algorithms=[InstalledAlgorithm(name=f"a{i}", version="1")
                                                            for i in range(65)]))
    assert problem(Capabilities(models=[InstalledModel(name="tiny", version="")])) == (
        "capabilities.models: 'tiny' version '' needs a name and a version of 1 to 64 characters")
    assert problem(Capabilities(trainer_capabilities=["x" * 65])) == (
        "capabilities.trainer_capabilities: each needs 1 to 64 characters")

def test_a_device_refuses_an_algorithm_whose_needs_its_trainer_does_not_offer():
    from tally.client.contribution import capability_missing
    from tally.wire.v1.coordinator_pb2 import TaskAssignment

    task = TaskAssignment(algorithm="agnostic_fedavg")
    assert capability_missing(task, ()) == (
        "algorithm 'agnostic_fedavg' needs trainer capability 'domain_statistics', which this device's trainer "
        "does not offer")
    assert capability_missing(task, ("domain_statistics",)) is None
    assert capability_missing(TaskAssignment(algorithm="fedavg"), ()) is None
