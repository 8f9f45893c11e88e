"""What each device says it can run, declared at every check-in: the algorithms and model kinds
(name, version) installed on it and its trainer's capabilities. The coordinator seats a device only
in jobs whose algorithm and model kind it has at the versions the coordinator runs and whose
algorithm's ``needs`` its trainer offers, tells operators how many devices of a population can run a
job, and fails a job that none of them can run instead of retrying it, naming what they lack.
Devices never download code: a device runs what its operator installed, so a job can only wait for
a device that has what it needs."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from tally import models
from tally.algorithms import packages
from tally.wire.v1 import coordinator_pb2

Versions = frozenset[tuple[str, str]]

# The most algorithms, model kinds or capabilities one check-in may declare, and the longest name
# or version: bounded input.
MAX_DECLARED = 64
MAX_NAME_CHARS = 64
# A device counts as present for a population's counts while its last check-in is this recent: a
# device gone for good must not keep a job alive that no present device can run.
PRESENT_S = 600.0


@dataclass(frozen=True)
class Installed:
    """One device's declaration."""

    algorithms: Versions
    models: Versions
    capabilities: frozenset[str]


@dataclass(frozen=True)
class Requirement:
    """What a device must have to be seated in a job. An empty version: a kind registered in the
    coordinator's process only, which no device declares and none is asked for."""

    algorithm: str
    algorithm_version: str
    model: str
    model_version: str
    needs: tuple[str, ...]

    def lacking(self, installed: Installed) -> list[str]:
        """What of this requirement ``installed`` lacks, each as one of ``parts()``."""
        parts = self.parts()
        return [parts[i] for i, met in enumerate(self._met(installed)) if not met]

    def met_by(self, installed: Installed) -> bool:
        return all(self._met(installed))

    def parts(self) -> list[str]:
        return [f"algorithm {self.algorithm!r} version {self.algorithm_version!r}",
                f"model kind {self.model!r} version {self.model_version!r}",
                *(f"trainer capability {need!r}" for need in self.needs)]

    def _met(self, installed: Installed) -> list[bool]:
        return [not self.algorithm_version or (self.algorithm, self.algorithm_version) in installed.algorithms,
                not self.model_version or (self.model, self.model_version) in installed.models,
                *(need in installed.capabilities for need in self.needs)]


def required(algorithm: str, model: str) -> Requirement:
    """What this coordinator requires of a device for a job of ``algorithm`` on model ``model``: the
    versions it runs (``""`` for a kind registered in this process only,
    ``tally.coordinator.spec.catalogue``, which no device declares) and the algorithm's ``needs``."""
    found = packages.catalogue().installed.get(algorithm)
    return Requirement(algorithm, found.item.version if found is not None else "",
                       model, models.versions().get(model, ""), found.item.needs if found is not None else ())


def problem(capabilities: coordinator_pb2.Capabilities) -> str | None:
    """Why a check-in's declaration is refused (too many, an empty or overlong name), or None."""
    for field, declared in (("algorithms", capabilities.algorithms), ("models", capabilities.models)):
        if len(declared) > MAX_DECLARED:
            return f"capabilities.{field}: {len(declared)} declared, at most {MAX_DECLARED}"
        for a in declared:
            if not a.name or not a.version or len(a.name) > MAX_NAME_CHARS or len(a.version) > MAX_NAME_CHARS:
                return (f"capabilities.{field}: {a.name!r} version {a.version!r} needs a name and a version "
                        f"of 1 to {MAX_NAME_CHARS} characters")
    offered = capabilities.trainer_capabilities
    if len(offered) > MAX_DECLARED:
        return f"capabilities.trainer_capabilities: {len(offered)} declared, at most {MAX_DECLARED}"
    if any(not name or len(name) > MAX_NAME_CHARS for name in offered):
        return f"capabilities.trainer_capabilities: each needs 1 to {MAX_NAME_CHARS} characters"
    return None


class DeclaredAlgorithms:
    """Each device's latest declaration, with its population and when it checked in. Declarations
    are few distinct sets (a fleet runs a handful of images), so each set is kept once and devices
    share it. Counts cover the devices present: checked in within ``PRESENT_S``."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._by_device: dict[str, tuple[str, Installed, float]] = {}
        self._sets: dict[Installed, Installed] = {}

    def record(self, device_id: str, population: str, capabilities: coordinator_pb2.Capabilities) -> Installed:
        """The device's declaration; declaring no algorithm (an SDK older than algorithm packages),
        tally's own algorithms and model kinds at this coordinator's versions and every capability
        tally's bundled trainers offer (what such a device was seated for before)."""
        if capabilities.algorithms:
            installed = Installed(_versions(capabilities.algorithms), _versions(capabilities.models),
                                  frozenset(capabilities.trainer_capabilities))
        else:
            installed = _legacy()
        installed = self._sets.setdefault(installed, installed)
        self._by_device[device_id] = (population, installed, self.clock())
        return installed

    def _present(self, population: str) -> list[Installed]:
        since = self.clock() - PRESENT_S
        return [installed for p, installed, seen in self._by_device.values() if p == population and seen >= since]

    def count(self, population: str, requirement: Requirement) -> tuple[int, int]:
        """(present devices of ``population`` that meet ``requirement``, present devices of it)."""
        sets = self._present(population)
        return sum(1 for installed in sets if requirement.met_by(installed)), len(sets)

    def none_can_run(self, population: str, requirement: Requirement) -> str | None:
        """Why no device of ``population`` can run the job, when devices of it checked in and none
        meets ``requirement``: the first part of it no device has, with the versions they have
        instead; None while one can (or none checked in yet)."""
        sets = self._present(population)
        if not sets or any(requirement.met_by(installed) for installed in sets):
            return None
        lacking = Counter(part for installed in sets for part in requirement.lacking(installed))
        start = f"no device of population {population!r}"
        checked = f"{len(sets)} device(s) checked in"
        r = requirement
        if lacking[r.parts()[0]] == len(sets):
            return f"{start} can run {r.parts()[0]}: {checked} ({_seen(sets, r.algorithm, 'algorithms')})"
        if lacking[r.parts()[1]] == len(sets):
            return f"{start} can run {r.parts()[1]}: {checked} ({_seen(sets, r.model, 'models')})"
        for part in r.parts()[2:]:
            if lacking[part] == len(sets):
                return (f"{start} offers {part}, which algorithm {r.algorithm!r} needs: {checked} "
                        "(none declares it)")
        return (f"{start} has all that the job needs ({', '.join(r.parts())}): {checked}, each lacking some: "
                + ", ".join(f"{part} on {n}" for part, n in sorted(lacking.items())))


def _seen(sets: Sequence[Installed], name: str, field: str) -> str:
    """How many devices have each version of ``name`` among their ``field`` (algorithms, models)."""
    seen = Counter(v for installed in sets for n, v in getattr(installed, field) if n == name)
    return ", ".join(f"version {v!r} on {n}" for v, n in sorted(seen.items())) if seen else "none has it installed"


def _versions(declared: Iterable[coordinator_pb2.InstalledAlgorithm | coordinator_pb2.InstalledModel]) -> Versions:
    return frozenset((d.name, d.version) for d in declared)


def _legacy() -> Installed:
    own = frozenset((name, found.item.version) for name, found in packages.catalogue().installed.items()
                    if found.package == packages.TALLY)
    own_models = frozenset((kind, found.item.version) for kind, found in models.catalogue().installed.items()
                           if found.package == packages.TALLY)
    return Installed(own, own_models, frozenset(packages.TRAINER_CAPABILITIES))
