"""The job spec's ``evaluation:`` section: what each round measures on the devices' held-out
examples, as secure sums (``tally.evaluation``). On by default with the metrics that fit the
algorithm: a personalised one adds the personal model's accuracy, a domain one per-domain loss
and accuracy. ``evaluation: {enabled: false}`` turns it off (a null key means the default, as
for every section).

Besides the training rounds' own evaluation (of the model each device receives, before it
trains), a job may ask for rounds that only evaluate: ``final`` scores the final model after the
last training round, ``separate`` scores the model just committed after every ``every``-th one
(Flower's ``fraction_evaluate``). Such a round is a round like any other for the coordinator
(its own selection, seats, ledgers, sum and commit, with the model unchanged), so it is numbered
in the job's sequence; ``RoundSchedule`` says which numbers train and which only evaluate.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tally import algorithms
from tally.algorithms import packages
from tally.algorithms.base import PersonalisedClient
from tally.algorithms.feddar import HEADS
from tally.coordinator.spec import catalogue
from tally.evaluation import BUILT_IN, DEFAULT_METRICS, CustomMetric, EvaluatedServer, EvaluationPlan

STRICT = ConfigDict(extra="forbid", strict=True, frozen=True)


class CustomMetricSpec(BaseModel):
    """A metric the devices' trainers report (``LocalTrainer.metrics``), declared so every device
    encodes it alike: its kind and bounds, like any payload field (values outside are clipped and
    counted)."""

    model_config = STRICT
    name: str = Field(pattern=r"^[A-Za-z][A-Za-z0-9_]{0,39}$", description="letters, digits and '_'")
    kind: Literal["mean", "count", "histogram"] = Field(
        "mean", description="mean (example-weighted over devices), count (summed) or histogram (devices per bin)")
    low: float = Field(0.0, description="lowest value (0 for a count)")
    high: float = Field(1.0, description="highest value")
    bins: int = Field(10, ge=2, le=100, description="bins of a histogram over [low, high]")


class EvaluationSpec(BaseModel):
    """Federated evaluation: each selected device scores the model it receives on its held-out
    examples before training and reports its training loss after; only sums leave it."""

    model_config = STRICT
    enabled: bool = Field(True, description="false: no evaluation (no metric fields in the sums)")
    metrics: tuple[Literal[BUILT_IN], ...] | None = Field(  # type: ignore[valid-type]
        None, strict=False, description="built-in metrics: " + ", ".join(BUILT_IN) + " (default: "
        + ", ".join(DEFAULT_METRICS) + ", with personal_accuracy for a personalised algorithm and "
        "domain for a domain one)")
    custom: tuple[CustomMetricSpec, ...] = Field((), strict=False, description="metrics the devices' trainers report")
    holdout: float = Field(0.1, ge=0, lt=1, description="share of each device's examples held out of training")
    every: int = Field(1, ge=1, description="evaluate every this many rounds (and always the last round)")
    bins: int = Field(10, ge=2, le=100, description="bins of the per-device accuracy histogram")
    loss_bound: float = Field(10.0, gt=0, description="a device's mean loss is clipped to [0, loss_bound]")
    example_cap: int = Field(1000, ge=1, description="held-out examples at which a device's weight stops growing")

    final: bool = Field(False, description="after the last training round, one more round in which a cohort of "
                        "devices only scores the final model on its held-out examples (no training)")
    separate: bool = Field(False, description="after every `every`-th training round (and the last), a round in "
                           "which a cohort of devices only scores the model just committed (Flower's "
                           "fraction_evaluate); implies final")
    cohort_size: int | None = Field(None, ge=2, description="devices of an evaluation-only round (default: the "
                                    "job's cohort_size; at least its min_cohort; under DP, equal to cohort_size)")

    def due(self, round_: int, rounds: int) -> bool:
        return round_ % self.every == 0 or round_ == rounds


@dataclass(frozen=True)
class RoundSchedule:
    """A job's rounds in order: ``training`` training rounds, and after some of them a round that
    only evaluates (numbered in the same sequence: ``evaluation_only``)."""

    training: int
    evaluation_only: frozenset[int] = frozenset()

    @property
    def total(self) -> int:
        return self.training + len(self.evaluation_only)

    def only_evaluates(self, round_: int) -> bool:
        return round_ in self.evaluation_only

    def training_round(self, round_: int) -> int:
        """The training rounds done by the end of ``round_`` (an evaluation-only round's is the
        round whose model it scores)."""
        return round_ - sum(1 for r in self.evaluation_only if r <= round_)

    def describe(self, round_: int) -> str:
        """``round_`` as the coordinator's events name it."""
        if self.only_evaluates(round_):
            return f"round {round_} of {self.total} (evaluation only: the model of training round " \
                   f"{self.training_round(round_)})"
        return f"round {round_} of {self.total}"


def schedule_of(spec: Any) -> RoundSchedule:
    """The job's rounds: its ``rounds`` training rounds and the evaluation-only rounds its
    ``evaluation`` section asks for (none when it evaluates nothing)."""
    e = spec.evaluation
    if e is None or not (e.final or e.separate) or plan_for(spec) is None:
        return RoundSchedule(spec.rounds)
    after = [t for t in range(1, spec.rounds + 1) if t == spec.rounds or (e.separate and t % e.every == 0)]
    return RoundSchedule(spec.rounds, frozenset(t + k + 1 for k, t in enumerate(after)))


# Algorithms whose model is no classifier to score (FedEvg's is a synthetic dataset): no metric by default.
UNSCORED_ALGORITHMS = ("fedevg",)


def _metrics(spec: Any) -> tuple[str, ...]:
    chosen = spec.evaluation.metrics
    if chosen is not None:
        return tuple(chosen)
    if spec.algorithm in UNSCORED_ALGORITHMS:
        return ()
    extra = []
    _, client = algorithms.make(spec.algorithm, spec.options) if spec.algorithm in algorithms.NAMES else (None, None)
    if isinstance(client, PersonalisedClient):
        extra.append("personal_accuracy")
    # Devices of an algorithm that needs domain statistics label their examples with domains, so
    # their trainers evaluate per domain too.
    if spec.algorithm in algorithms.NAMES and packages.DOMAIN_STATISTICS in packages.get(spec.algorithm).needs:
        extra.append("domain")
    return (*DEFAULT_METRICS, *extra)


def domains_of(spec: Any) -> int:
    """How many domains the job's devices label their examples with: the algorithm's ``domains``
    option (AgnosticFedAvg), else the initial model's per-domain heads (FedDAR)."""
    given = int(spec.options.get("domains", 0) or 0)
    if given:
        return given
    heads = catalogue.model_layout(spec.model).get(HEADS)  # shapes only: no torch for a built-in kind
    return int(heads.shape[0]) if heads is not None else int(spec.model.domains)


def plan_for(spec: Any) -> EvaluationPlan | None:
    """The job's evaluation plan (None when it is off); ``ValueError`` when it cannot be."""
    e = spec.evaluation
    if e is None or not e.enabled:
        return None
    metrics = _metrics(spec)
    if not metrics and not e.custom:
        return None
    return EvaluationPlan(
        metrics=metrics, custom=tuple(CustomMetric(**c.model_dump()) for c in e.custom), holdout=e.holdout,
        bins=e.bins, loss_bound=e.loss_bound, example_cap=e.example_cap,
        domains=domains_of(spec) if "domain" in metrics else 0,
        device_weighted=getattr(spec, "privacy", None) is not None,
    )


def evaluated_job_server(server: Any, spec: Any) -> Any:
    """A job's server half, wrapped with its evaluation when it has one."""
    plan = plan_for(spec)
    return server if plan is None else EvaluatedServer(server, plan)
