"""Algorithms as installable packages: one registry, fed by Python entry points.

A distribution declares each of its algorithms as an entry point of the group ``tally.algorithms``
whose object is an :class:`Algorithm`: name and version, the options class, the two halves, the
privacy role of every payload field, and what a device needs to run it. Tally's own algorithms are
entries of the same group in its ``pyproject.toml`` (``tally.algorithms.builtin``), loaded and checked
by the same code, so a package's algorithm is in every respect what a built-in one is: the
coordinator runs it, a device with it installed declares it and runs its client half, and the job
spec validates and documents its options.

An entry is checked when the catalogue is loaded, and a bad one is refused with its package and
entry named while the rest of the catalogue is still served: an entry point that fails to import or
is not an ``Algorithm``, a name two packages claim, an option without a meaning and range, a payload
field without a privacy role. ``problems()`` lists the refusals (``tally algorithms list`` prints
them); nothing is retried, since installed packages change only when a process restarts.

Tally's own entries come from its installed metadata or, in a source checkout (whose installed
metadata may be another checkout's), from the ``pyproject.toml`` beside the package: the same
declaration either way, never a second list in code.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import tomllib
import typing
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from tally.algorithms.base import ClientAlgorithm, Options, ServerAlgorithm
from tally.algorithms.options import OPTIONS, Option

log = logging.getLogger(__name__)

GROUP = "tally.algorithms"
TALLY = "tally"  # the distribution whose entries are the built-in algorithms

# A payload field's privacy role: one of tally.privacy.sensitivity.Role's values ("clipped",
# "bounded", "withheld", "counted"), or the L2 bound of a bounded field; or a function of the
# job's options giving either, for a role that depends on them (FedAvg's weight is counted when
# every device weighs 1).
RoleValue = str | float
PrivacyRole = RoleValue | Callable[[Any], RoleValue]
ROLES = ("clipped", "bounded", "withheld", "counted")
# What an algorithm may need of a device's trainer (``Algorithm.needs``): examples labelled with
# domains and per-domain statistics (AgnosticFedAvg, FedDAR); a job's evaluation then reports per
# domain too.
DOMAIN_STATISTICS = "domain_statistics"
# Every capability tally's own trainers offer: what a device that declares no algorithm (an SDK
# older than algorithm packages) is taken to have.
TRAINER_CAPABILITIES = (DOMAIN_STATISTICS,)


def trainer_capabilities(trainer: object) -> tuple[str, ...]:
    """What ``trainer`` offers algorithms' client halves, which its device declares at check-in:
    its ``capabilities`` attribute (``tally.training.domain.DomainTrainer`` says it answers domain
    statistics); none without one, so a trainer is never seated for what it cannot answer."""
    return tuple(getattr(trainer, "capabilities", ()))


@dataclass(frozen=True)
class Algorithm:
    """One installable algorithm: what a coordinator and a device both build it from.

    ``fields`` names every payload field any of its steps sends and ``privacy`` gives each its role,
    so that a job with a ``privacy:`` section knows how to bound each before it runs. ``options_meanings``
    adds the meaning and range of options the shared table (``tally.algorithms.options``) lacks:
    every option of ``options`` must be in one or the other. ``needs`` names the trainer
    capabilities a device must offer (``"domain_statistics"``), so a job is never seated on a
    device whose trainer cannot answer the client half."""

    name: str
    version: str
    options: type[Options]
    server: Callable[[Any], ServerAlgorithm]
    client: Callable[[Any], ClientAlgorithm]
    fields: tuple[str, ...]
    privacy: Mapping[str, PrivacyRole]
    needs: tuple[str, ...] = ()
    options_meanings: Mapping[str, Option] = field(default_factory=dict)
    summary: str = ""

    def make(self, options: Mapping[str, Any] | None = None) -> tuple[ServerAlgorithm, ClientAlgorithm]:
        parsed = self.options.from_dict(options)
        return self.server(parsed), self.client(parsed)

    def meaning(self, option: str) -> Option:
        return self.options_meanings.get(option) or OPTIONS[option]

    def roles(self, options: Any) -> dict[str, RoleValue]:
        """Each payload field's role under the job's parsed ``options``."""
        return {name: role(options) if callable(role) else role for name, role in self.privacy.items()}


def check(algorithm: object) -> str | None:
    """Why ``algorithm`` cannot be served, or ``None``."""
    if not isinstance(algorithm, Algorithm):
        return f"is a {type(algorithm).__name__}, not a tally.algorithms.packages.Algorithm"
    if not algorithm.name or not algorithm.version:
        return "has no name or no version"
    if not (isinstance(algorithm.options, type) and issubclass(algorithm.options, Options)
            and dataclasses.is_dataclass(algorithm.options)):
        return "options is not a dataclass subclass of tally.algorithms.base.Options"
    hints = typing.get_type_hints(algorithm.options)
    unranged = []
    for option in dataclasses.fields(algorithm.options):
        if not option.init or option.name == "reveal":
            continue
        own = algorithm.options_meanings.get(option.name)
        if own is None and option.name not in OPTIONS:
            unranged.append(f"{option.name} (no meaning)")
        elif own is not None and hints[option.name] in (int, float) and not own.bounds():
            unranged.append(f"{option.name} (no range)")
    if unranged:
        return f"options class {algorithm.options.__name__} declares no meaning and range for: " + ", ".join(unranged)
    if not algorithm.fields:
        return "declares no payload field"
    undeclared = [name for name in algorithm.fields if name not in algorithm.privacy]
    if undeclared:
        return f"privacy declaration names no role for payload field(s) {undeclared}"
    unknown = sorted(set(algorithm.privacy) - set(algorithm.fields))
    if unknown:
        return f"privacy declaration names {unknown}, which are not among its payload fields {list(algorithm.fields)}"
    bad = [name for name, role in algorithm.privacy.items()
           if not callable(role) and not isinstance(role, float) and role not in ROLES]
    if bad:
        return f"privacy roles of {bad} are not one of {list(ROLES)} or an L2 bound"
    return None


T = typing.TypeVar("T")


@dataclass(frozen=True)
class Installed(typing.Generic[T]):
    """An accepted entry's object (an ``Algorithm``, a ``tally.models.Model``) and the distribution
    it came from."""

    item: T
    package: str
    entry: str


@dataclass(frozen=True)
class Refused:
    """An entry refused at load, and why (its package and entry named)."""

    package: str
    entry: str
    reason: str

    def __str__(self) -> str:
        return f"package {self.package!r} entry {self.entry!r}: {self.reason}"


class Catalogue(typing.Generic[T]):
    """The accepted entries of one group by name, and the refusals: algorithms here, model kinds in
    ``tally.models`` (``noun`` names which in a refusal). ``checker`` says why an entry's object cannot
    be served (None: it can); an accepted object's ``name`` must be its entry's."""

    def __init__(self, entries: Iterable[tuple[str, metadata.EntryPoint]],
                 checker: Callable[[object], str | None] = check, noun: str = "algorithm") -> None:
        self.installed: dict[str, Installed[T]] = {}
        self.refused: list[Refused] = []
        self._check = checker
        self._noun = noun
        claims: dict[str, list[Installed[T]]] = {}
        for package, entry in entries:
            item = self._load(package, entry)
            if item is not None:
                claims.setdefault(entry.name, []).append(Installed(item, package, entry.name))
        for name, claimed in claims.items():
            own = [c for c in claimed if c.package == TALLY]
            if len(claimed) == 1 or len(own) == 1:
                # A built-in name stays tally's; otherwise neither claimant is served, so what a
                # job runs never depends on the order in which packages happen to be found.
                keep = own[0] if own else claimed[0]
                self.installed[name] = keep
                claimed = [c for c in claimed if c is not keep]
            packages = sorted({c.package for c in (*claimed, *own)})
            for c in claimed:
                self._refuse(c.package, c.entry, f"{noun} {name!r} is claimed by packages {packages}")

    def _load(self, package: str, entry: metadata.EntryPoint) -> T | None:
        try:
            item = entry.load()
        except Exception as exc:  # noqa: BLE001 - no package's import error may take the catalogue down
            self._refuse(package, entry.name, f"cannot be loaded ({entry.value}): {type(exc).__name__}: {exc}")
            return None
        reason = self._check(item)
        if reason is None and item.name != entry.name:
            reason = f"entry {entry.name!r} names {self._noun} {item.name!r}; they must be the same"
        if reason is not None:
            self._refuse(package, entry.name, reason)
            return None
        return typing.cast(T, item)

    def _refuse(self, package: str, entry: str, reason: str) -> None:
        refused = Refused(package, entry, reason)
        log.error("package entry refused", extra={"group": self._noun, "package": package, "entry": entry,
                                                  "reason": reason})
        self.refused.append(refused)


def tally_entries(group: str = GROUP) -> list[metadata.EntryPoint]:
    """Tally's own entries of ``group``: from the ``pyproject.toml`` beside this package when it
    runs from a source checkout, else from the installed distribution's metadata."""
    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    if pyproject.is_file():
        declared = tomllib.loads(pyproject.read_text()).get("project", {}).get("entry-points", {}).get(group, {})
        if declared:
            return [metadata.EntryPoint(name, value, group) for name, value in declared.items()]
    try:
        return list(metadata.distribution(TALLY).entry_points.select(group=group))
    except metadata.PackageNotFoundError:
        return []


def discover(group: str = GROUP) -> list[tuple[str, metadata.EntryPoint]]:
    """(package, entry) of every installed entry of ``group``, tally's own first."""
    found = [(TALLY, entry) for entry in tally_entries(group)]
    for entry in metadata.entry_points(group=group):
        package = entry.dist.name if entry.dist is not None else "?"
        if package != TALLY:
            found.append((package, entry))
    return found


_catalogue: Catalogue[Algorithm] | None = None


def catalogue() -> Catalogue[Algorithm]:
    """The process's catalogue, loaded on first use."""
    global _catalogue
    if _catalogue is None:
        _catalogue = Catalogue(discover())
    return _catalogue


def reload() -> Catalogue[Algorithm]:
    """Load the catalogue again (a package installed into this process's environment since)."""
    global _catalogue
    _catalogue = None
    return catalogue()


def names() -> tuple[str, ...]:
    return tuple(catalogue().installed)


def names_of(package: str) -> tuple[str, ...]:
    """The algorithms installed from distribution ``package``."""
    return tuple(name for name, found in catalogue().installed.items() if found.package == package)


def get(name: str) -> Algorithm:
    """Algorithm ``name``; ``ValueError`` naming what is installed (and why a refused one is not)."""
    found = catalogue().installed.get(name)
    if found is not None:
        return found.item
    refused = [str(r) for r in catalogue().refused if r.entry == name]
    why = f" ({'; '.join(refused)})" if refused else ""
    raise ValueError(f"unknown algorithm {name!r}{why}; available: {', '.join(names())}")


def versions() -> dict[str, str]:
    """name -> version of every installed algorithm: what a device declares at check-in."""
    return {name: found.item.version for name, found in catalogue().installed.items()}


def problems() -> list[Refused]:
    return list(catalogue().refused)


@contextlib.contextmanager
def installed(algorithm: Algorithm, package: str = "in-process") -> Iterator[Algorithm]:
    """Serve ``algorithm`` in this process while the block runs, checked as an entry point's object
    is: for tests of an algorithm not yet installed as a package (``tally.testing``)."""
    reason = check(algorithm)
    served = catalogue().installed
    if reason is None and algorithm.name in served:
        reason = f"algorithm {algorithm.name!r} is already claimed by package {served[algorithm.name].package!r}"
    if reason is not None:
        raise ValueError(str(Refused(package, algorithm.name, reason)))
    served[algorithm.name] = Installed(algorithm, package, algorithm.name)
    try:
        yield algorithm
    finally:
        del served[algorithm.name]
