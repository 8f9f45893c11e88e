"""What each device says it can run: the algorithms (name, version) installed on it, declared at
every check-in. The coordinator seats a device only in jobs whose algorithm it has at the version the
coordinator runs, tells operators how many devices of a population can run a job, and fails a job
that none of them can run instead of retrying it. Devices never download code: a device runs what
its operator installed, so a job can only wait for a device that has its algorithm."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable

from tally.algorithms import packages
from tally.wire.v1 import coordinator_pb2

Installed = frozenset[tuple[str, str]]

# The most algorithms one check-in may declare, and the longest name or version: bounded input.
MAX_DECLARED = 64
MAX_NAME_CHARS = 64
# A device counts as present for a population's counts while its last check-in is this recent: a
# device gone for good must not keep a job alive that no present device can run.
PRESENT_S = 600.0


def problem(declared: Iterable[coordinator_pb2.InstalledAlgorithm]) -> str | None:
    """Why a check-in's declaration is refused (too many, an empty or overlong name), or None."""
    declared = list(declared)
    if len(declared) > MAX_DECLARED:
        return f"capabilities.algorithms: {len(declared)} declared, at most {MAX_DECLARED}"
    for a in declared:
        if not a.name or not a.version or len(a.name) > MAX_NAME_CHARS or len(a.version) > MAX_NAME_CHARS:
            return (f"capabilities.algorithms: {a.name!r} version {a.version!r} needs a name and a version "
                    f"of 1 to {MAX_NAME_CHARS} characters")
    return None


def required_version(algorithm: str) -> str:
    """The version of ``algorithm`` this coordinator runs; "" for one registered in this process
    only (``tally.coordinator.spec.catalogue.register_algorithm``), which no device declares."""
    return packages.versions().get(algorithm, "")


def can_run(installed: Installed, algorithm: str, version: str) -> bool:
    return not version or (algorithm, version) in installed


class DeclaredAlgorithms:
    """Each device's latest declaration, with its population and when it checked in. Declarations
    are few distinct sets (a fleet runs a handful of images), so each set is kept once and devices
    share it. Counts cover the devices present: checked in within ``PRESENT_S``."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._by_device: dict[str, tuple[str, Installed, float]] = {}
        self._sets: dict[Installed, Installed] = {}

    def record(self, device_id: str, population: str,
               declared: Iterable[coordinator_pb2.InstalledAlgorithm]) -> Installed:
        """The device's installed algorithms: what it declared, or, declaring none (an SDK older than
        algorithm packages), tally's own at this coordinator's versions."""
        installed = frozenset((a.name, a.version) for a in declared) or _tally_own()
        installed = self._sets.setdefault(installed, installed)
        self._by_device[device_id] = (population, installed, self.clock())
        return installed

    def _present(self, population: str) -> list[Installed]:
        since = self.clock() - PRESENT_S
        return [installed for p, installed, seen in self._by_device.values() if p == population and seen >= since]

    def count(self, population: str, algorithm: str, version: str) -> tuple[int, int]:
        """(present devices of ``population`` that can run ``algorithm`` at ``version``, present
        devices of it)."""
        sets = self._present(population)
        return sum(1 for installed in sets if can_run(installed, algorithm, version)), len(sets)

    def versions_seen(self, population: str, algorithm: str) -> Counter[str]:
        """How many present devices of ``population`` have each version of ``algorithm``."""
        return Counter(v for installed in self._present(population) for name, v in installed if name == algorithm)

    def none_can_run(self, population: str, algorithm: str, version: str) -> str | None:
        """Why no device of ``population`` can run the job, when devices of it checked in and
        none has ``algorithm`` at ``version``; None while one can (or none checked in yet)."""
        able, declared = self.count(population, algorithm, version)
        if able or not declared:
            return None
        seen = self.versions_seen(population, algorithm)
        others = (", ".join(f"version {v!r} on {n}" for v, n in sorted(seen.items())) if seen
                  else "none has it installed")
        return (f"no device of population {population!r} can run algorithm {algorithm!r} version {version!r}: "
                f"{declared} device(s) checked in ({others})")


def _tally_own() -> Installed:
    return frozenset((name, found.algorithm.version) for name, found in packages.catalogue().installed.items()
                     if found.package == packages.TALLY)
