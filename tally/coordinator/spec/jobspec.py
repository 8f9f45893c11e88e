"""Job specifications: YAML in, a validated ``JobSpec`` out, or one error naming every problem.

A spec is checked completely before anything is stored, so a typo in round 1 never becomes a
failed job in round 40, and a wrongly typed option (``local_epochs: "5"``) never reaches a
device. The sections are pydantic models: strict types (a string is never read as a number, nor
``"yes"`` as true), unknown keys refused with the valid ones listed, and every field's problem
reported at once. Each algorithm's options are typed from its own options dataclass, so the spec
cannot drift from what the algorithm accepts. Relations between fields (``min_cohort`` against
``cohort_size``, the secure threshold, what may be revealed) are checked on the fields that are
individually valid, in the same pass. A key renamed in this release (``config:``, now ``options:``)
is still read under its old name, with a warning naming it, until the next release.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
import warnings
from collections.abc import Mapping
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, create_model

from tally import algorithms, models
from tally.algorithms import packages
from tally.algorithms.adaptation_options import (
    KD_FORMS,
    METHOD_OPTIONS,
    METHODS,
    AdaptationOptions,
    JobAdaptation,
    trainable_names,
)
from tally.algorithms.base import PersonalisedClient
from tally.algorithms.options import Option
from tally.coordinator.spec import catalogue
from tally.coordinator.spec.evaluation_spec import EvaluationSpec, evaluated_job_server, plan_for, schedule_of
from tally.models.layouts import layout
from tally.privacy import spec as privacy_spec
from tally.secagg import ThreatModel, UnsafeParameters, choose_params, smallest_secure_cohort

REVEALABLE = {"aaggff_s": ("response",)}
DEFAULT_DEADLINES = {
    "checkin": 30.0,
    "download": 60.0,
    "advertise_keys": 20.0,
    "share_keys": 20.0,
    "masked_input": 120.0,
    "consistency_check": 20.0,
    "unmask": 20.0,
}
DEFAULT_MIN_COHORT = 10
STRICT = ConfigDict(extra="forbid", strict=True, frozen=True)


class JobSpecError(ValueError):
    """Every problem of a spec, one per line, each naming its field."""


class ModelSpec(BaseModel):
    """The model a job starts from: a kind the coordinator knows (built in or plugged in by its
    operator) and its shape."""

    model_config = STRICT
    kind: str = Field(
        "mlp", description="model kind: built in (mlp, cnn; domain_mlp for FedDAR), from an installed "
        "model package (tally.models entry point) or plugged in with --model-plugin")
    inputs: int = Field(64, ge=1, description="input features")
    classes: int = Field(10, ge=1, description="output classes")
    hidden: int = Field(64, ge=1, description="hidden width (mlp, domain_mlp) or channels (cnn)")
    domains: int = Field(1, ge=1, description="heads of a per-domain model (domain_mlp, for FedDAR)")
    seed: int = Field(0, ge=0, description="seed of the initial weights")


class SecureSpec(BaseModel):
    """How cohort sums are computed.

    ``plain: true`` replaces the secure sum by a plain sum: every device's contribution is
    shown to the aggregator in the clear, which breaks the one rule of DESIGN.md section 1.
    It exists only to measure the cost of secure aggregation (bench/round.py); the
    coordinator logs a warning and counts every such job it accepts.
    """

    model_config = STRICT
    dropout_rate: float = Field(0.1, ge=0, lt=1, description="fraction of a cohort expected to drop out")
    corrupt_rate: float = Field(0.05, ge=0, lt=1, description="fraction that may collude with the server")
    malicious_server: bool = Field(True, description="defend against a server that lies about survivors")
    consistency_check: bool | None = Field(
        None, description="each device signs its survivor view and unmasks only once t neighbours "
        "signed views that count it as a survivor (default: on; off only with malicious_server: "
        "false, for a semi-honest deployment or a benchmark, and devices then need a semi-honest "
        "policy; a plain sum has none)")
    plain: bool = Field(False, description="benchmarks only: sums in the clear, no privacy")

    @property
    def checks_consistency(self) -> bool:
        """Whether sessions run the consistency check: unless plain or explicitly turned off."""
        return not self.plain if self.consistency_check is None else self.consistency_check

    def threat(self) -> ThreatModel:
        return ThreatModel(self.dropout_rate, self.corrupt_rate, self.malicious_server)


_TECHNIQUE = AdaptationOptions  # the defaults a device uses when the SDK's API is called without options
_JOB_OPTION = JobAdaptation.__dataclass_fields__


class AdaptationSpec(BaseModel):
    """Local adaptation after the last round (specs/local-adaptation.md 6): each device that had a
    task of the job fetches the final model, adapts it on its own data and keeps the adapted
    model on the device (as ONNX, in its state directory); nothing of it is ever sent. On the
    examples it holds out (`validation`) the device keeps whichever of the adapted and the
    federated model is more accurate."""

    model_config = STRICT
    method: Literal[METHODS] = Field(description="finetune (all weights), freeze_base (only `trainable`), "
                                     "ewc (anchored by the Fisher of the device's data) or distill (the "
                                     "federated model as teacher)")
    epochs: int = Field(_TECHNIQUE.epochs, ge=1, le=1000, description="passes over the device's data")
    lr: float = Field(_TECHNIQUE.lr, gt=0, le=10, description="SGD learning rate")
    batch_size: int = Field(_TECHNIQUE.batch_size, ge=1, le=65536, description="examples per SGD step")
    trainable: list[str] = Field(list(_TECHNIQUE.trainable), description="freeze_base only: patterns of the "
                                 "parameters trained (default: the model's last layer)")
    ewc_lambda: float = Field(_TECHNIQUE.ewc_lambda, ge=0, le=1e6, description="ewc only: weight of the Fisher anchor")
    alpha: float = Field(_TECHNIQUE.alpha, ge=0, le=1, description="distill only: weight of the teacher's soft term")
    temperature: float = Field(_TECHNIQUE.temperature, gt=0, le=100, description="distill only: softmax temperature")
    kd_form: Literal[KD_FORMS] = Field(_TECHNIQUE.kd_form, description="distill only: hinton (the authors' code) "
                                       "or paper (Eq. 6's swapped weights)")
    seed: int = Field(_TECHNIQUE.seed, ge=0, description="seed of the device's shuffling and held-out split")
    validation: float = Field(_JOB_OPTION["validation"].default, ge=0, le=0.5,
                              description="share of the device's examples held out to judge the adapted model")
    local_only_epochs: int = Field(_JOB_OPTION["local_only_epochs"].default, ge=0, le=1000,
                                   description="> 0: also train a local-only model for the device's who-gains "
                                   "record (kept on the device)")

    def option(self) -> JobAdaptation:
        return JobAdaptation.from_dict(self.model_dump())

    def to_dict(self) -> dict[str, Any]:
        """Without the options only another method uses (which the spec refuses)."""
        return {k: v for k, v in self.model_dump().items() if self.method in METHOD_OPTIONS.get(k, (self.method,))}


Seconds = Annotated[float, Field(gt=0, le=86400)]
Deadlines = create_model(  # one optional field per phase, so a mistyped phase lists the others
    "Deadlines", __config__=STRICT, __doc__="Seconds each phase of a round may take.",
    **{phase: (Seconds, Field(seconds, description=f"seconds for {phase}"))
       for phase, seconds in DEFAULT_DEADLINES.items()},
)
Name = Annotated[str, Field(min_length=1, max_length=100, pattern=r"^[A-Za-z0-9_-]+$")]


class JobSpec(BaseModel):
    """A federated training job: which algorithm, how many rounds over cohorts of how many devices,
    from which model, with which privacy settings."""

    model_config = STRICT
    name: Name = Field(description="letters, digits, '-' and '_' (1-100); job ids start with it")
    algorithm: str = Field(description="an algorithm the coordinator runs: " + ", ".join(algorithms.NAMES))
    rounds: int = Field(ge=1, description="rounds to train")
    cohort_size: int = Field(ge=2, description="devices whose contributions are summed each round")
    model: ModelSpec = Field(default_factory=ModelSpec, description="the model trained")
    options: dict[str, Any] = Field(
        default_factory=dict, description="the algorithm's options (until the next release also read as config:)",
    )
    population: str = Field("default", description="which enrolled devices may take part")
    over_selection: float = Field(1.3, ge=1, le=3, description="devices selected per cohort place")
    min_cohort: int = Field(
        DEFAULT_MIN_COHORT, ge=2,
        description="fewest devices in a cohort sum, per aggregator (the privacy floor); "
        f"default {DEFAULT_MIN_COHORT} or cohort_size if smaller",
    )
    max_cohort_per_aggregator: int = Field(1000, ge=2, description="most devices one aggregator sums")
    secure: SecureSpec = Field(default_factory=SecureSpec, description="secure-sum settings")
    deadlines: dict[str, float] = Field(
        default_factory=lambda: dict(DEFAULT_DEADLINES), description="seconds per phase of a round",
    )
    retries: int = Field(2, ge=0, description="how many times a round may try again: each attempt after the "
                         "first spends one, and so does each reopening of a selection window that closed with "
                         "fewer than min_cohort devices; the round fails when none is left")
    reveal: tuple[str, ...] = Field(
        (), strict=False, description="per-device values the job opts in to reveal (only aaggff_s: response)",
    )
    privacy: privacy_spec.PrivacySpec | None = Field(None, description="differential privacy of the released sums")
    adaptation: AdaptationSpec | None = Field(None, description="local adaptation of the final model on each device")
    evaluation: EvaluationSpec | None = Field(
        default_factory=EvaluationSpec, description="federated evaluation on the devices' held-out examples, as "
        "secure sums (enabled: false: none)")

    @property
    def selection_target(self) -> int:
        """Devices to accept at check-in: the cohort plus over-selection for stragglers."""
        return int(round(self.cohort_size * self.over_selection))

    def to_dict(self) -> dict[str, Any]:
        out = self.model_dump()
        out["reveal"] = list(self.reveal)
        if self.adaptation is not None:
            out["adaptation"] = self.adaptation.to_dict()
        if self.evaluation is not None:
            out["evaluation"] = self.evaluation.model_dump(mode="json", exclude_none=True)
        return out

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


SECTIONS: dict[str, type[BaseModel]] = {
    "model": ModelSpec, "secure": SecureSpec, "deadlines": Deadlines, "privacy": privacy_spec.PrivacySpec,
    "adaptation": AdaptationSpec, "evaluation": EvaluationSpec,
}
REQUIRED = tuple(name for name, info in JobSpec.model_fields.items() if info.is_required())


# -- algorithm options ---------------------------------------------------------------------------


def _strict_type(hint: Any) -> Any:
    """An options dataclass's annotation as the job spec accepts it: YAML has lists, not tuples."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        return list[_strict_type(args[0])]
    if origin is tuple and args and len(set(args)) == 1:  # a fixed-length tuple, e.g. (low, high)
        return Annotated[list[_strict_type(args[0])], Field(min_length=len(args), max_length=len(args))]
    if origin in (typing.Union, types.UnionType):
        return functools.reduce(lambda a, b: a | b, (_strict_type(a) for a in args))
    return hint


@functools.cache
def options_model(algorithm: str) -> type[BaseModel] | None:
    """The typed options of an installed algorithm (built in or a package's), from its options
    dataclass; ``None`` for one registered at run time (its factory checks its own options)."""
    if algorithm not in algorithms.NAMES:
        return None
    entry = packages.get(algorithm)
    options_class = entry.options
    hints = typing.get_type_hints(options_class)
    fields = {
        f.name: (_strict_type(hints[f.name]), _option_field(entry.meaning(f.name), f.default))
        for f in dataclasses.fields(options_class) if f.init and f.name != "reveal"  # reveal: top level
    }
    return create_model(f"{algorithm}_options", __config__=STRICT, __doc__=options_class.__doc__, **fields)


def _option_field(option: Option, default: Any) -> Any:
    """The option's default, meaning and range (``tally.algorithms.options`` or its package's own)."""
    return Field(default, description=option.meaning, **option.bounds())


def option_type_errors(algorithm: str, options: Mapping[str, Any], where: str = "options") -> list[str]:
    """Options of the wrong type or unknown to ``algorithm``, one line each naming
    ``<where>.<option>`` (what the algorithm refuses of well-typed values is its own check)."""
    errors: list[str] = []
    typed = options_model(algorithm)
    if typed is not None:
        _check(typed, dict(options), where, errors, _Keys.of(algorithm, where))
    return errors


def option_fields(algorithm: str) -> dict[str, Any]:
    """Option name -> accepted type of ``algorithm`` (empty for a run-time registered one)."""
    model = options_model(algorithm)
    return {} if model is None else {name: info.annotation for name, info in model.model_fields.items()}


# -- validation ----------------------------------------------------------------------------------

_TYPE_NAMES = {
    "float_type": "a number", "float_parsing": "a number", "int_type": "an integer",
    "int_from_float": "an integer", "bool_type": "true or false", "string_type": "a string",
    "list_type": "a list", "tuple_type": "a list", "dict_type": "a mapping", "model_type": "a mapping",
    "model_attributes_type": "a mapping", "finite_number": "a finite number",
}
_BOUNDS = {"greater_than_equal": ">=", "greater_than": ">", "less_than_equal": "<=", "less_than": "<"}


def _got(value: Any) -> str:
    return f"got {value!r} ({type(value).__name__})"


@dataclasses.dataclass(frozen=True)
class _Keys:
    """The valid keys at each place of a spec, for errors that name an unknown one."""

    algorithm: Any
    at: Mapping[str, list[str]]
    options_at: str = "options"

    @classmethod
    def of(cls, algorithm: Any, options_at: str = "options") -> _Keys:
        options = list(option_fields(algorithm)) if isinstance(algorithm, str) else []
        sections = {name: list(model.model_fields) for name, model in SECTIONS.items()}
        return cls(algorithm, {"": list(JobSpec.model_fields), **sections, options_at: options}, options_at)

    def unknown(self, where: str, names: list[str]) -> str:
        """One line for the unknown keys at ``where``, listing the valid ones."""
        if where == self.options_at:
            return f"{where}: unknown {self.algorithm} options {sorted(names)}; its options: {self.at[where]}"
        return f"{where + ': ' if where else ''}unknown keys {sorted(names)}; valid keys: {self.at[where]}"


def _describe(error: Mapping[str, Any], where: str) -> str:
    kind, value = error["type"], error.get("input")
    if kind == "missing":
        return f"{where}: required"
    if kind in _TYPE_NAMES:
        return f"{where}: must be {_TYPE_NAMES[kind]}, {_got(value)}"
    if kind in _BOUNDS:
        bound = next(iter(error["ctx"].values()))
        return f"{where}: must be {_BOUNDS[kind]} {bound:g}, got {value!r}"
    if kind == "string_pattern_mismatch" and where == "name":
        return f"name: letters, digits, '-' and '_' only (1-100), got {value!r}"
    return f"{where}: {error['msg'][0].lower()}{error['msg'][1:]}, {_got(value)}"


def _check(adapter: TypeAdapter | type[BaseModel], value: Any, where: str, errors: list[str],
           keys: _Keys) -> Any:
    """``value`` validated, or ``None`` with its problems appended to ``errors``."""
    try:
        if isinstance(adapter, TypeAdapter):
            return adapter.validate_python(value)
        return adapter.model_validate(value)
    except ValidationError as exc:
        unknown = [str(e["loc"][-1]) for e in exc.errors() if e["type"] == "extra_forbidden"]
        if unknown:
            errors.append(keys.unknown(where, unknown))
        for error in exc.errors():
            if error["type"] != "extra_forbidden":
                loc = ".".join(str(part) for part in (where, *error["loc"]) if part != "")
                errors.append(_describe(error, loc))
        return None


@functools.cache
def _field_adapter(name: str) -> TypeAdapter:
    info = JobSpec.model_fields[name]
    if name in SECTIONS:
        return TypeAdapter(SECTIONS[name])
    annotated = Annotated[info.annotation, *info.metadata] if info.metadata else info.annotation
    return TypeAdapter(annotated, config=ConfigDict(strict=True))


def yaml_problem(exc: yaml.YAMLError) -> str:
    """One line: where the YAML breaks and why (PyYAML's own message spans several lines and
    names ``<unicode string>`` rather than the file)."""
    def at(mark: yaml.Mark | None) -> str:
        return f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""

    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    context = getattr(exc, "context", None)
    where = f" ({context}{at(getattr(exc, 'context_mark', None))})" if context else ""
    return f"not valid YAML{at(getattr(exc, 'problem_mark', None))}: {problem}{where}"


def parse(text: str, notes: list[str] | None = None) -> JobSpec:
    """``from_dict`` of the YAML ``text``."""
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise JobSpecError(yaml_problem(exc)) from None
    if not isinstance(raw, Mapping):
        raise JobSpecError("a job spec is a YAML mapping")
    return from_dict(raw, notes)


def from_dict(raw: Mapping[str, Any], notes: list[str] | None = None) -> JobSpec:
    """The validated spec, or ``JobSpecError`` listing every problem, each naming its field.

    A key read under its old name raises a ``DeprecationWarning`` and, where the caller reports
    warnings to a person (``tally job validate``, a submission), appends the same line to ``notes``."""
    errors: list[str] = []
    # `key: null` (or an empty YAML key) means the default, as if the key were absent.
    raw = {k: v for k, v in raw.items() if v is not None or k in REQUIRED}
    raw = _renamed_keys(raw, errors, notes)
    keys = _Keys.of(raw.get("algorithm"))
    unknown = [str(key) for key in raw if key not in JobSpec.model_fields]
    if unknown:
        errors.append(keys.unknown("", unknown))
    valid: dict[str, Any] = {}
    for name in JobSpec.model_fields:
        if name not in raw:
            if name in REQUIRED:
                errors.append(f"{name}: required")
            continue
        checked = _check(_field_adapter(name), raw[name], name, errors, keys)
        if checked is not None:
            valid[name] = checked
    _check_relations(raw, valid, errors)
    if errors:
        raise JobSpecError("\n".join(errors))
    valid.setdefault("min_cohort", min(DEFAULT_MIN_COHORT, valid["cohort_size"]))
    valid["deadlines"] = {**DEFAULT_DEADLINES, **valid.get("deadlines", Deadlines()).model_dump(exclude_unset=True)}
    if valid.get("reveal"):
        valid["options"] = {**valid.get("options", {}), "reveal": list(valid["reveal"])}
    return JobSpec.model_validate(valid, strict=False)


# Keys renamed in this release, old name -> new: the old one is read, with a warning, until the next.
RENAMED = {"config": "options"}


def _renamed_keys(raw: dict[str, Any], errors: list[str], notes: list[str] | None) -> dict[str, Any]:
    """``raw`` with each key given by its old name moved to its new one; both names at once is an
    error naming them, since which one was meant cannot be known."""
    out = dict(raw)
    for old, new in RENAMED.items():
        if old not in out:
            continue
        if new in out:
            errors.append(f"{new}: given twice, as {new}: and as its deprecated name {old}:; keep {new}: only")
            del out[old]
            continue
        note = f"{old}: deprecated, renamed {new}: (read as {new}: until the next release)"
        warnings.warn(note, DeprecationWarning, stacklevel=3)
        if notes is not None:
            notes.append(note)
        out[new] = out.pop(old)
    return out


def _check_relations(raw: Mapping[str, Any], valid: dict[str, Any], errors: list[str]) -> None:
    """What no single field shows, checked only where the fields involved are valid."""
    cohort = valid.get("cohort_size")
    min_cohort = valid.get("min_cohort", None if cohort is None else min(DEFAULT_MIN_COHORT, cohort))
    if min_cohort is not None and cohort is not None and min_cohort > cohort:
        errors.append(f"min_cohort: {min_cohort} exceeds cohort_size {cohort}")
        min_cohort = None
    per_aggregator = valid.get("max_cohort_per_aggregator", 1000)
    if min_cohort is not None and "max_cohort_per_aggregator" in raw and per_aggregator < min_cohort:
        errors.append(f"max_cohort_per_aggregator: {per_aggregator} is below min_cohort {min_cohort}")
    model = valid.get("model", ModelSpec() if "model" not in raw else None)
    if model is not None and model.kind not in catalogue.model_kinds():
        errors.append(f"model.kind: {model.kind!r} is not one of {list(catalogue.model_kinds())}")
        model = None
    secure = valid.get("secure", SecureSpec() if "secure" not in raw else None)
    if secure is not None:
        _check_secure(secure, min_cohort, errors)
    algorithm = valid.get("algorithm")
    if algorithm is not None and algorithm not in catalogue.algorithm_names():
        errors.append(f"algorithm: {algorithm!r} is not one of {list(catalogue.algorithm_names())}")
        algorithm = None
    reveal = valid.get("reveal", () if "reveal" not in raw else None)
    if algorithm is not None and reveal is not None:
        allowed = REVEALABLE.get(algorithm, ())
        for item in reveal:
            if item not in allowed:
                errors.append(
                    f"reveal: {item!r} is not revealable for {algorithm!r}"
                    + (f" (only {list(allowed)})" if allowed else "; nothing is: the server sees only sums")
                )
    options = valid.get("options", {} if "options" not in raw else None)
    if algorithm is not None and options is not None and reveal is not None:
        _check_options(algorithm, options, tuple(reveal), model, errors)
    adaptation = valid.get("adaptation")
    if adaptation is not None:
        _check_adaptation(raw["adaptation"], adaptation, model, errors)
    evaluation = valid.get("evaluation")
    if evaluation is not None and None not in (algorithm, options, model):
        _check_evaluation(algorithm, options, model, evaluation, errors)
    if evaluation is not None:
        _check_evaluation_rounds(evaluation, cohort, min_cohort, "privacy" in raw and raw["privacy"] is not None,
                                 errors)
    privacy = valid.get("privacy")
    if privacy is not None and None not in (algorithm, options, model, secure, min_cohort) and "rounds" in valid:
        job = _Evaluated(algorithm, options, model, evaluation, valid["rounds"])
        errors += privacy_spec.job_problems(
            privacy, algorithm=algorithm,
            make_server=lambda: evaluated_job_server(catalogue.make_server(
                algorithm, {**options, "reveal": list(reveal)} if reveal else options), job),
            initial=lambda: catalogue.model_layout(model), secure=secure, rounds=_all_rounds(job),
            cohort_size=cohort, min_cohort=min_cohort,
        )


@dataclasses.dataclass(frozen=True)
class _Evaluated:
    """The parts of a spec its evaluation plan reads, before the whole spec is valid."""

    algorithm: str
    options: Mapping[str, Any]
    model: ModelSpec
    evaluation: EvaluationSpec | None
    rounds: int = 0


def _all_rounds(job: _Evaluated) -> int:
    """The releases a private job makes: its training rounds and those that only evaluate, as the
    runner calibrates it (``private_job_server``). An evaluation plan that cannot be built is the
    evaluation check's to report; its rounds are then the training ones."""
    try:
        return schedule_of(job).total
    except ValueError:
        return job.rounds


def _check_evaluation(algorithm: str, options: Mapping[str, Any], model: ModelSpec, evaluation: EvaluationSpec,
                      errors: list[str]) -> None:
    try:
        plan = plan_for(_Evaluated(algorithm, options, model, evaluation))
    except ValueError as exc:
        errors.append(f"evaluation: {exc}")
        return
    if plan is None and evaluation.enabled and (evaluation.final or evaluation.separate):
        errors.append(f"evaluation.{'final' if evaluation.final else 'separate'}: {algorithm} measures no metric by "
                      "default, so an evaluation-only round would sum nothing (name its metrics or custom ones)")
    if plan is not None and "personal_accuracy" in plan.metrics and algorithm in algorithms.NAMES:
        _, client = algorithms.make(algorithm, options)
        if not isinstance(client, PersonalisedClient):
            errors.append(f"evaluation.metrics: personal_accuracy needs a personalised algorithm (lg_fedavg, "
                          f"superfed); {algorithm} keeps no personal model")


def _check_evaluation_rounds(evaluation: EvaluationSpec, cohort: int | None, min_cohort: int | None,
                             private: bool, errors: list[str]) -> None:
    """The evaluation-only rounds' settings against the job's: a round that evaluates nothing, a
    cohort it never selects, or one the job's secure or DP settings were not planned for."""
    rounds = evaluation.final or evaluation.separate
    if rounds and not evaluation.enabled:
        which = "final" if evaluation.final else "separate"
        errors.append(f"evaluation.{which}: evaluation-only rounds need evaluation enabled (enabled: false)")
    size = evaluation.cohort_size
    if size is None:
        return
    if not rounds:
        errors.append("evaluation.cohort_size: sizes the evaluation-only rounds, and neither final nor separate "
                      "asks for any")
    if min_cohort is not None and size < min_cohort:
        errors.append(f"evaluation.cohort_size: {size} is below min_cohort {min_cohort}")
    if private and cohort is not None and size != cohort:
        errors.append(f"evaluation.cohort_size: {size} differs from cohort_size {cohort}; a private job's noise is "
                      "planned over cohort_size devices, so its evaluation-only rounds select as many")


def _check_adaptation(raw: Mapping[str, Any], adaptation: AdaptationSpec, model: ModelSpec | None,
                      errors: list[str]) -> None:
    for name in raw:
        users = METHOD_OPTIONS.get(name, (adaptation.method,))
        if adaptation.method not in users:
            errors.append(f"adaptation.{name}: only used by method {' or '.join(users)}, not {adaptation.method}")
    if model is None:
        return
    if model.kind not in models.kinds():
        errors.append(f"adaptation: the {model.kind} model has no torch module for devices to adapt and serve "
                      f"as ONNX; adaptation needs one of {list(models.kinds())}")
        return
    known = layout(model.kind, model.inputs, model.classes, model.hidden, model.domains)
    names = (list(known.trainable) if known is not None else  # a plug-in's model: only its module knows
             [name for name, _ in models.build(model.kind, model.inputs, model.classes, model.hidden,
                                               model.seed).named_parameters()])
    try:
        trainable_names(names, adaptation.option().options)
    except ValueError as exc:
        errors.append(f"adaptation.trainable: {exc}")


def _check_secure(secure: SecureSpec, min_cohort: int | None, errors: list[str]) -> None:
    try:
        threat = secure.threat()
    except UnsafeParameters as exc:
        errors.append(f"secure: {exc}")
        return
    if secure.plain:
        if secure.consistency_check:
            errors.append("secure.plain: a plain sum has no survivor sets to check; drop consistency_check")
        return
    if secure.consistency_check is False and secure.malicious_server:
        errors.append(
            "secure.consistency_check: false leaves a malicious server free to show each device its "
            "own survivor set and read one device's input; keep it on, or declare the server "
            "semi-honest with secure.malicious_server: false (devices must then accept a "
            "semi-honest policy too)")
    if min_cohort is not None:  # the smallest cohort the coordinator may form must admit a threshold
        try:
            choose_params(min_cohort, threat)
        except UnsafeParameters as exc:
            smallest = smallest_secure_cohort(min_cohort, threat)
            hint = (f"; the smallest that is: min_cohort: {smallest}" if smallest is not None
                    else "; no cohort size is: lower secure.dropout_rate or secure.corrupt_rate")
            errors.append(f"min_cohort: {min_cohort} is too small for the secure settings: {exc}{hint}")



def _check_options(
    algorithm: str, options: dict[str, Any], reveal: tuple[str, ...], model: ModelSpec | None, errors: list[str]
) -> None:
    # The opt-in to reveal per-device values is the job's, at the top level (DESIGN.md section 1);
    # the algorithm sees it as its `reveal` option, never set on its own.
    if "reveal" in options:
        if tuple(options["reveal"] or ()) != reveal:
            errors.append("options.reveal: the opt-in belongs at the top level of the job spec (reveal: [...])")
        options = {k: v for k, v in options.items() if k != "reveal"}
    typed_errors = option_type_errors(algorithm, options)
    errors += typed_errors
    if typed_errors:
        return
    try:
        server = catalogue.make_server(algorithm, {**options, "reveal": list(reveal)} if reveal else options)
    except (TypeError, ValueError) as exc:
        errors.append(f"options: {exc}")
        return
    if model is None:
        return
    try:  # what the first round does: options that do not fit the model fail here, not at start
        server.steps(server.init(catalogue.model_layout(model)))
    except (TypeError, ValueError, KeyError) as exc:
        errors.append(f"model: the {model.kind} model does not fit {algorithm}'s options: {exc}")
