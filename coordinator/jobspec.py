"""Job specifications: YAML in, a validated ``JobSpec`` out, or one error naming every problem.

A spec is checked completely before anything is stored, so a typo in round 1 never
becomes a failed job in round 40.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import yaml

from coordinator import registry
from tally.secagg import ThreatModel, UnsafeParameters, choose_params

PHASE_DEADLINES = (
    "checkin", "download", "advertise_keys", "share_keys", "masked_input", "consistency_check",
    "unmask",
)
REVEALABLE = {"aaggff_s": ("response",)}


class JobSpecError(ValueError):
    """Every problem of a spec, one per line, each naming its field."""


@dataclass(frozen=True)
class ModelSpec:
    kind: str = "mlp"
    inputs: int = 64
    classes: int = 10
    hidden: int = 64
    seed: int = 0


@dataclass(frozen=True)
class SecureSpec:
    """How cohort sums are computed.

    ``plain: true`` replaces the secure sum by a plain sum: every device's contribution is
    shown to the aggregator in the clear, which breaks the one rule of DESIGN.md section 1.
    It exists only to measure the cost of secure aggregation (bench/round.py); the
    coordinator logs a warning and counts every such job it accepts.
    """

    dropout_rate: float = 0.1
    corrupt_rate: float = 0.05
    malicious_server: bool = True
    consistency_check: bool = False
    plain: bool = False

    def threat(self) -> ThreatModel:
        return ThreatModel(self.dropout_rate, self.corrupt_rate, self.malicious_server)


@dataclass(frozen=True)
class JobSpec:
    name: str
    algorithm: str
    rounds: int
    cohort_size: int
    model: ModelSpec = field(default_factory=ModelSpec)
    config: Mapping[str, Any] = field(default_factory=dict)
    population: str = "default"
    over_selection: float = 1.3
    min_cohort: int = 10
    max_cohort_per_aggregator: int = 1000
    secure: SecureSpec = field(default_factory=SecureSpec)
    deadlines: Mapping[str, float] = field(default_factory=lambda: dict(DEFAULT_DEADLINES))
    retries: int = 2
    reveal: tuple[str, ...] = ()

    @property
    def selection_target(self) -> int:
        """Devices to accept at check-in: the cohort plus over-selection for stragglers."""
        return int(round(self.cohort_size * self.over_selection))

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["reveal"] = list(self.reveal)
        out["config"] = dict(self.config)
        out["deadlines"] = dict(self.deadlines)
        return out

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


DEFAULT_DEADLINES = {
    "checkin": 30.0,
    "download": 60.0,
    "advertise_keys": 20.0,
    "share_keys": 20.0,
    "masked_input": 120.0,
    "consistency_check": 20.0,
    "unmask": 20.0,
}


def _section(raw: Any, cls: type, where: str, errors: list[str]) -> Any:
    if raw is None:
        return cls()
    if not isinstance(raw, Mapping):
        errors.append(f"{where}: must be a mapping, got {type(raw).__name__}")
        return cls()
    unknown = set(raw) - set(cls.__dataclass_fields__)
    if unknown:
        errors.append(f"{where}: unknown keys {sorted(unknown)}")
    try:
        return cls(**{k: v for k, v in raw.items() if k in cls.__dataclass_fields__})
    except TypeError as exc:
        errors.append(f"{where}: {exc}")
        return cls()


def parse(text: str) -> JobSpec:
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise JobSpecError(f"not valid YAML: {exc}") from None
    if not isinstance(raw, Mapping):
        raise JobSpecError("a job spec is a YAML mapping")
    return from_dict(raw)


def from_dict(raw: Mapping[str, Any]) -> JobSpec:
    errors: list[str] = []
    known = set(JobSpec.__dataclass_fields__)
    unknown = set(raw) - known
    if unknown:
        errors.append(f"unknown keys {sorted(unknown)}; known: {sorted(known)}")
    for required in ("name", "algorithm", "rounds", "cohort_size"):
        if required not in raw:
            errors.append(f"{required}: required")
    if errors and any("required" in e for e in errors):
        raise JobSpecError("\n".join(errors))

    def integer(key: str, low: int, default: int | None = None) -> int:
        value = raw.get(key, default)
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            errors.append(f"{key}: must be an integer >= {low}, got {value!r}")
            return low
        return value

    name = raw["name"]
    if not isinstance(name, str) or not name or len(name) > 100 or not name.replace("-", "").replace("_", "").isalnum():
        errors.append(f"name: letters, digits, '-' and '_' only (1-100), got {name!r}")
    algorithm = raw["algorithm"]
    config = raw.get("config")
    if config is not None and not isinstance(config, Mapping):
        errors.append(f"config: must be a mapping of the algorithm's options, got {type(config).__name__}")
        config = None
    # The opt-in to reveal per-device values is the job's, at the top level (DESIGN.md section 1);
    # the algorithm sees it as its `reveal` option, never set on its own.
    reveal = tuple(raw.get("reveal") or ())
    if config is not None and "reveal" in config and tuple(config["reveal"] or ()) != reveal:
        errors.append("config.reveal: the opt-in belongs at the top level of the job spec (reveal: [...])")
    if reveal:
        config = {**(config or {}), "reveal": list(reveal)}
    if algorithm not in registry.algorithm_names():
        errors.append(f"algorithm: {algorithm!r} is not one of {list(registry.algorithm_names())}")
    else:
        try:
            registry.make_server(algorithm, config)
        except (TypeError, ValueError) as exc:
            errors.append(f"config: {exc}")
    rounds = integer("rounds", 1)
    cohort = integer("cohort_size", 2)
    min_cohort = integer("min_cohort", 2, default=min(10, cohort))
    per_aggregator = integer("max_cohort_per_aggregator", 2, default=1000)
    retries = integer("retries", 0, default=2)
    if min_cohort > cohort:
        errors.append(f"min_cohort: {min_cohort} exceeds cohort_size {cohort}")
    if per_aggregator < min_cohort:
        errors.append(f"max_cohort_per_aggregator: {per_aggregator} is below min_cohort {min_cohort}")
    over = raw.get("over_selection", 1.3)
    if not isinstance(over, (int, float)) or not 1.0 <= over <= 3.0:
        errors.append(f"over_selection: must be a number in [1, 3], got {over!r}")
    model = _section(raw.get("model"), ModelSpec, "model", errors)
    if model.kind not in registry.model_kinds():
        errors.append(f"model.kind: {model.kind!r} is not one of {list(registry.model_kinds())}")
    for key in ("inputs", "classes", "hidden", "seed"):
        value = getattr(model, key)
        if not isinstance(value, int) or isinstance(value, bool) or value < (0 if key == "seed" else 1):
            errors.append(f"model.{key}: must be an integer >= {0 if key == 'seed' else 1}, got {value!r}")
    secure = _section(raw.get("secure"), SecureSpec, "secure", errors)
    try:
        threat = secure.threat()
    except (UnsafeParameters, ValueError) as exc:
        errors.append(f"secure: {exc}")
    if not isinstance(secure.plain, bool):
        errors.append(f"secure.plain: must be true or false, got {secure.plain!r}")
    elif secure.plain and secure.consistency_check:
        errors.append("secure.plain: a plain sum has no survivor sets to check; drop consistency_check")
    else:
        # The smallest cohort the coordinator may form must admit a secure threshold.
        if not any(e.startswith("min_cohort") for e in errors):
            try:
                choose_params(min_cohort, threat)
            except UnsafeParameters as exc:
                errors.append(f"min_cohort: {min_cohort} is too small for the secure settings: {exc}")
    deadlines = dict(DEFAULT_DEADLINES)
    given = raw.get("deadlines") or {}
    if not isinstance(given, Mapping):
        errors.append("deadlines: must be a mapping of phase to seconds")
        given = {}
    for phase, seconds in given.items():
        if phase not in PHASE_DEADLINES:
            errors.append(f"deadlines.{phase}: unknown phase; phases: {list(PHASE_DEADLINES)}")
        elif not isinstance(seconds, (int, float)) or not 0 < seconds <= 86400:
            errors.append(f"deadlines.{phase}: seconds in (0, 86400], got {seconds!r}")
        else:
            deadlines[phase] = float(seconds)
    allowed = REVEALABLE.get(algorithm, ())
    for item in reveal:
        if item not in allowed:
            errors.append(
                f"reveal: {item!r} is not revealable for {algorithm!r}"
                + (f" (only {list(allowed)})" if allowed else "; nothing is: the server sees only sums")
            )
    if errors:
        raise JobSpecError("\n".join(errors))
    return JobSpec(
        name=name, algorithm=algorithm, rounds=rounds, cohort_size=cohort, model=model,
        config=dict(config or {}), population=str(raw.get("population", "default")),
        over_selection=float(over), min_cohort=min_cohort, max_cohort_per_aggregator=per_aggregator,
        secure=secure, deadlines=deadlines, retries=retries, reveal=reveal,
    )
