"""Simulation scenarios: a dataset's devices, its starting model, and the metrics a report shows.

``tally simulate`` and the README's reproduction commands build every run through
``build``, so a dataset's conventions (its default algorithm options, how its domains
are counted, which metrics make sense) live in one place.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tally.algorithms.base import Arrays
from tally.datasets.digits import digits
from tally.models.mlp import mlp
from tally.models.params import get_params
from tally.sim import fairness
from tally.training import TorchTrainer


@dataclass(frozen=True)
class ScenarioArgs:
    clients: int = 50
    cohort: int | None = None
    domains: int = 4
    alpha: float = 0.5
    samples: int = 100
    noise: float | None = None
    partition: str | None = None
    seed: int = 0
    algorithm: str = "fedavg"
    classes_per_device: int = 2


@dataclass
class Scenario:
    devices: list[Any]
    initial: Arrays
    evaluate: Callable[[Arrays], tuple[float, float | None]]
    final: Callable[[Arrays], dict[str, Any]]
    num_domains: int = 0
    # Options a dataset needs whatever the user asks (e.g. the domain count it generated).
    injected: dict[str, dict[str, Any]] = field(default_factory=dict)
    # Options that suit the dataset's scale, overridable by --option.
    defaults: dict[str, dict[str, Any]] = field(default_factory=dict)
    # Devices with their own validation and test splits (a ``PersonalFleet``): set, the run also
    # judges each device's personal model on its own test split.
    fleet: Any = None

    def options(self, algorithm: str, given: dict[str, Any]) -> dict[str, Any]:
        merged = {**self.defaults.get(algorithm, {}), **given}
        for key, value in self.injected.get(algorithm, {}).items():
            if key in given and given[key] != value:
                raise ValueError(f"option {key}={given[key]!r} contradicts the dataset ({value!r})")
            merged[key] = value
        return merged


def _device_fairness(per_device: np.ndarray) -> dict[str, Any]:
    return {"per_device_accuracy": per_device.tolist(), **fairness.summary(per_device)}


def _population_options(args: ScenarioArgs) -> dict[str, dict[str, Any]]:
    return {
        "aaggff_d": {"num_clients": args.clients, "cohort_size": args.cohort or args.clients},
        "aaggff_s": {"num_clients": args.clients},
    }


def digits_scenario(args: ScenarioArgs) -> Scenario:
    fed = digits(args.clients, alpha=args.alpha, seed=args.seed)
    factory = lambda: mlp(fed.num_features, fed.num_classes, seed=args.seed)  # noqa: E731
    devices = [TorchTrainer(factory, X, y, seed=args.seed + i) for i, (X, y) in enumerate(fed.clients)]
    test = TorchTrainer(factory, *fed.test)

    def final(model: Arrays) -> dict[str, Any]:
        loss, accuracy = test.evaluate(model)
        per_device = np.array([d.evaluate(model)[1] for d in devices])
        return {"test_loss": loss, "test_accuracy": accuracy, **_device_fairness(per_device)}

    return Scenario(devices, get_params(factory()), test.evaluate, final, injected=_population_options(args))


def toy_regression_scenario(args: ScenarioArgs) -> Scenario:
    from tally.datasets.toy_regression import toy_regression

    toy = toy_regression(
        clients=args.clients, domains=args.domains, samples_per_client=args.samples,
        noise=10.0 if args.noise is None else args.noise, partition=args.partition or "client",
        alpha=None if args.partition != "data" else args.alpha, seed=args.seed,
    )
    # Updates reach ~7 and per-device loss sums ~4e4 here: the default clips would saturate.
    defaults = {
        "agnostic_fedavg": {"domain_lr": 0.005, "local_lr": 0.1, "batch_size": 10, "loss_clip": 1e6,
                            "loss_frac_bits": 4, "delta_clip": 16},
        "fedavg": {"local_epochs": 1, "batch_size": 10, "delta_clip": 16},
    }
    injected = {"agnostic_fedavg": {"domains": toy.num_domains}, **_population_options(args)}
    return Scenario(
        toy.devices(args.seed), {"w": np.array([5.0])},
        lambda model: (toy.domain_metrics(model)["mean_loss"], None),
        toy.domain_metrics, toy.num_domains, injected, defaults,
    )


def domain_digits_scenario(args: ScenarioArgs) -> Scenario:
    from tally.datasets.domain_digits import domain_digits
    from tally.training.domain_weighted import TorchDomainTrainer

    fed = domain_digits(
        clients=args.clients, domains=args.domains, alpha=args.alpha, samples_per_client=args.samples,
        noise=0.3 if args.noise is None else args.noise, seed=args.seed, partition=args.partition or "data",
    )
    factory = lambda: mlp(fed.num_features, fed.num_classes, seed=args.seed)  # noqa: E731
    devices = [TorchDomainTrainer(factory, X, y, d, seed=args.seed + i) for i, (X, y, d) in enumerate(fed.clients)]
    test = TorchDomainTrainer(factory, *fed.test)

    def final(model: Arrays) -> dict[str, Any]:
        loss, accuracy = test.evaluate(model)
        per_device = np.array([d.evaluate(model)[1] for d in devices])
        return {"test_loss": loss, "test_accuracy": accuracy, **test.domain_metrics(model, fed.num_domains),
                **_device_fairness(per_device)}

    injected = {"agnostic_fedavg": {"domains": fed.num_domains}, **_population_options(args)}
    # A fast-moving λ needs an adaptive server step here: with plain SGD the domain-weighted
    # updates stay too small to train the MLP in 40 rounds.
    defaults = {"agnostic_fedavg": {"batch_size": 16, "domain_lr": 0.1, "local_lr": 0.5,
                                    "server_optimizer": "adam", "server_lr": 0.01}}
    return Scenario(devices, get_params(factory()), test.evaluate, final, fed.num_domains, injected, defaults)


def heterogeneous_digits_scenario(args: ScenarioArgs) -> Scenario:
    from tally.datasets.heterogeneous import heterogeneous_devices, heterogeneous_digits

    data = heterogeneous_digits(args.clients, alpha=args.alpha, seed=args.seed)
    fl = heterogeneous_devices(data, hidden=32, seed=args.seed)

    def final(model: Arrays) -> dict[str, Any]:
        loss, accuracy = fl.test.evaluate(model)
        return {"test_loss": loss, "test_accuracy": accuracy, **_device_fairness(fl.per_device_accuracy(model))}

    # The AAggFF comparisons use one local epoch of batch 20 for every algorithm.
    defaults = {"fedavg": {"local_epochs": 1, "batch_size": 20}}
    return Scenario(fl.devices, fl.initial, fl.test.evaluate, final, injected=_population_options(args),
                    defaults=defaults)


def domain_linear_scenario(args: ScenarioArgs) -> Scenario:
    """FedDAR's linear domain mixture; FedDAR gets one head per domain, others one shared head."""
    from tally.datasets.domain_linear import domain_linear, federation

    noise = {} if args.noise is None else {"noise": args.noise}
    data_ = domain_linear(clients=args.clients, domains=args.domains, alpha=args.alpha, samples=args.samples,
                          seed=args.seed, **noise)
    fed = federation(data_, heads=data_.domains if args.algorithm.startswith("feddar") else 1, seed=args.seed)
    # The paper's Algorithm 1 defaults converge slowly here; Newton heads from scratch and
    # full-batch encoder steps are the spec's reproduction protocol.
    feddar = {"head_solver": "newton", "head_start": "zero", "encoder_epochs": 5, "encoder_lr": 0.5, "batch_size": 1000}
    defaults = {"feddar_wa": feddar, "feddar_sa": feddar,
                "fedavg": {"local_epochs": 5, "local_lr": 0.5, "batch_size": 1000}}
    return Scenario(fed.devices, fed.initial, lambda model: (fed.evaluate(model)[0], None), fed.final_metrics,
                data_.domains, _population_options(args), defaults)


def personal_digits_scenario(args: ScenarioArgs, domains: int = 1) -> Scenario:
    """Digits with ``classes_per_device`` classes per device (pathological non-IID), each device's
    own train / validation / test split; ``domains`` > 1 turns device i's images by 90° x (i mod
    domains). The global model is tested on the union of the devices' test splits."""
    from tally.datasets.personal import pathological_digits
    from tally.sim.personalisation import personal_fleet

    data = pathological_digits(args.clients, args.classes_per_device, domains, seed=args.seed)
    factory = lambda: mlp(data.num_features, data.num_classes, seed=args.seed)  # noqa: E731
    fleet = personal_fleet(data, factory, seed=args.seed)
    pooled = TorchTrainer(factory, np.concatenate([d.test[0] for d in data.devices]),
                          np.concatenate([d.test[1] for d in data.devices]))

    def final(model: Arrays) -> dict[str, Any]:
        loss, accuracy = pooled.evaluate(model)
        per_device = np.array([t.evaluate(model)[1] for t in fleet.test])
        return {"test_loss": loss, "test_accuracy": accuracy, **_device_fairness(per_device)}

    # The LG-FedAvg paper's MNIST settings: one local epoch, batch 10, lr 0.05.
    paper = {"local_epochs": 1, "batch_size": 10, "local_lr": 0.05}
    defaults = {"fedavg": paper, "lg_fedavg": paper, "superfed": paper}
    return Scenario(fleet.devices, fleet.initial, pooled.evaluate, final, domains, _population_options(args), defaults,
                fleet=fleet)


def rotated_digits_scenario(args: ScenarioArgs) -> Scenario:
    return personal_digits_scenario(args, args.domains)


BUILDERS: dict[str, Callable[[ScenarioArgs], Scenario]] = {
    "digits": digits_scenario,
    "toy-regression": toy_regression_scenario,
    "domain-digits": domain_digits_scenario,
    "heterogeneous-digits": heterogeneous_digits_scenario,
    "domain-linear": domain_linear_scenario,
    "pathological-digits": personal_digits_scenario,
    "rotated-digits": rotated_digits_scenario,
}


def build(name: str, args: ScenarioArgs) -> Scenario:
    try:
        return BUILDERS[name](args)
    except KeyError:
        raise ValueError(f"unknown dataset {name!r}; available: {', '.join(BUILDERS)}") from None
