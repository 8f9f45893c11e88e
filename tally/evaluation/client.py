"""A device's half of federated evaluation: any client half, made to report model quality.

When a round's plan arrives (with the first broadcast) the device evaluates the model it received
on its held-out examples *before* training, then trains as the algorithm says on the rest (it never
trains on held-out examples, in any round of the job), records the training loss the trainer
reports, and adds the metric fields to the payload of the plan's step. Values outside their
declared bounds are clipped and counted in ``metric.clipped``, which the round reports.

The wrapper keeps one round's evaluation per trainer (``id(device)``), so one client half serves a
simulated population as well as the SDK's single device.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from tally.algorithms.base import Arrays, ClientAlgorithm, LocalTrainer, PersonalisedClient
from tally.evaluation.plan import PLAN, PREFIX, EvaluationError, EvaluationPlan


def held_out_views(trainer: LocalTrainer, share: float, seed: int) -> tuple[LocalTrainer, LocalTrainer]:
    """(what the device trains on, what it evaluates on). A trainer offers the split with
    ``held_out(share, seed)`` (every built-in one does); one that does not is evaluated by its
    own ``evaluate``, which should then use examples it does not train on (docs/evaluation.md)."""
    split = getattr(trainer, "held_out", None)
    if share <= 0 or split is None:
        return trainer, trainer
    return split(share, seed)


class _RecordsTrainLoss:
    """The training view, recording the mean loss each ``train`` call reports."""

    def __init__(self, trainer: LocalTrainer) -> None:
        self._trainer = trainer
        self.losses: list[float] = []

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._trainer, attr)

    @property
    def num_examples(self) -> int:
        return self._trainer.num_examples

    def train(self, params: Mapping[str, np.ndarray], epochs: int, lr: float, batch_size: int) -> tuple[Arrays, float]:
        trained, loss = self._trainer.train(params, epochs, lr, batch_size)
        self.losses.append(float(loss))
        return trained, loss


class _Clipper:
    """Clips values to their bounds and counts every value it moved."""

    def __init__(self) -> None:
        self.clipped = 0

    def __call__(self, value: np.ndarray | float, low: float, high: float) -> np.ndarray:
        value = np.nan_to_num(np.asarray(value, dtype=np.float64), nan=high, posinf=high, neginf=low)
        out = np.clip(value, low, high)
        self.clipped += int(np.count_nonzero(out != value))
        return out

    def bin(self, value: float, low: float, high: float, bins: int) -> np.ndarray:
        """A one-hot count of the bin ``value`` falls in (the top bin includes ``high``)."""
        v = float(self(value, low, high))
        one_hot = np.zeros(bins, dtype=np.int64)
        one_hot[min(int((v - low) / (high - low) * bins), bins - 1)] = 1
        return one_hot


def domain_sums(trainer: LocalTrainer, params: Mapping[str, np.ndarray], domains: int
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-domain (example counts, loss sums, correct predictions) from either kind of domain
    trainer (AgnosticFedAvg's takes the number of domains; FedDAR's knows its own)."""
    evaluate = getattr(trainer, "evaluate_domains", None)
    statistics = getattr(trainer, "domain_statistics", None)
    if evaluate is None and statistics is not None:  # AgnosticFedAvg's device: counts and loss sums only
        counts, loss_sums = statistics(params, domains)
        return (np.asarray(counts, np.float64), np.asarray(loss_sums, np.float64),
                np.zeros(np.shape(counts), np.float64))
    if evaluate is None:
        raise EvaluationError("metric 'domain': this device's trainer has no evaluate_domains (its examples "
                              "carry no domain ids)")
    try:
        counts, loss_sums, correct = evaluate(params, domains)
    except TypeError:
        ev = evaluate(params)
        counts, loss_sums = ev.count, ev.loss_sum
        correct = ev.correct if ev.correct is not None else np.zeros_like(ev.count)
    return np.asarray(counts, np.float64), np.asarray(loss_sums, np.float64), np.asarray(correct, np.float64)


class RoundEvaluation:
    """One device's evaluation in one round: measured before training, reported after it."""

    def __init__(self, plan: EvaluationPlan, trainer: _RecordsTrainLoss, values: dict[str, np.ndarray],
                 clip: _Clipper) -> None:
        self.plan, self.trainer, self._values, self._clip = plan, trainer, values, clip

    @classmethod
    def before_training(cls, plan: EvaluationPlan, broadcast: Mapping[str, np.ndarray], device: LocalTrainer,
                        inner: ClientAlgorithm, local_state: Any) -> RoundEvaluation:
        train, held = held_out_views(device, plan.holdout, plan.seed)
        recorder = _RecordsTrainLoss(train)
        clip = _Clipper()
        if not plan.step:
            return cls(plan, recorder, {}, clip)
        model = ({name: broadcast[key] for key, name in zip(plan.model, plan.model_names) if key in broadcast}
                 if plan.model else dict(broadcast))
        n = held.num_examples
        w = plan.weight(n)
        values: dict[str, Any] = {"devices": np.float64(1.0), "examples": np.int64(min(n, plan.example_cap)),
                                  "weight": np.float64(w)}
        loss, accuracy = held.evaluate(model) if n else (0.0, float("nan"))
        scored = not np.isnan(accuracy)  # a regression model has no accuracy
        if "loss" in plan.metrics:
            values["loss"] = w * clip(loss, 0.0, plan.loss_bound)
        if "accuracy" in plan.metrics:
            values["accuracy"] = w * clip(accuracy, 0.0, 1.0) if scored else np.float64(0.0)
            values["scored"] = np.int64(scored)
        if "accuracy_histogram" in plan.metrics:
            values["accuracy_histogram"] = (clip.bin(accuracy, 0.0, 1.0, plan.bins) if scored
                                            else np.zeros(plan.bins, dtype=np.int64))
        if "personal_accuracy" in plan.metrics:
            if not isinstance(inner, PersonalisedClient):
                raise EvaluationError("metric 'personal_accuracy': this algorithm keeps no personal model")
            personal = inner.personal_model(model, local_state, train)
            values["personal_accuracy"] = w * clip(held.evaluate(personal)[1] if n else 0.0, 0.0, 1.0)
        if "domain" in plan.metrics:
            counts, loss_sums, correct = domain_sums(held, model, plan.domains)
            if counts.shape != (plan.domains,):
                raise EvaluationError(f"metric 'domain': this device labels {counts.size} domains, the job "
                                      f"{plan.domains}")
            scale = 1.0 / max(plan.example_cap, n)  # n_k / cap, or n_k / n above the cap: each within 1
            values["domain_weight"] = counts * scale
            values["domain_loss"] = clip(loss_sums / np.maximum(counts, 1), 0.0, plan.loss_bound) * counts * scale
            values["domain_accuracy"] = correct * scale
        if plan.custom:
            values.update(cls._custom(plan, held, model, w, clip))
        return cls(plan, recorder, values, clip)

    @staticmethod
    def _custom(plan: EvaluationPlan, held: LocalTrainer, model: Arrays, w: float, clip: _Clipper
                ) -> dict[str, np.ndarray]:
        metrics = getattr(held, "metrics", None)
        reported = dict(metrics(model)) if metrics is not None else {}
        missing = [c.name for c in plan.custom if c.name not in reported]
        if missing:
            raise EvaluationError(f"the job asks for metric(s) {missing}, which this device's trainer does not "
                                  "report (LocalTrainer.metrics)")
        out = {}
        for c in plan.custom:
            value = reported[c.name]
            if c.kind == "mean":
                out["custom." + c.name] = w * clip(value, c.low, c.high)
            elif c.kind == "count":
                out["custom." + c.name] = np.int64(np.rint(clip(value, 0, c.high)))
            else:
                out["custom." + c.name] = clip.bin(value, c.low, c.high, c.bins)
        return out

    def payload(self) -> Arrays:
        """The metric fields, with the training loss measured since ``before_training``."""
        values = dict(self._values)
        if "train_loss" in self.plan.metrics:
            w = self.plan.weight(self.trainer.num_examples) if self.trainer.losses or self.plan.device_weighted else 0.0
            loss = float(np.mean(self.trainer.losses)) if self.trainer.losses else 0.0
            values["train_loss"] = w * self._clip(loss, 0.0, self.plan.loss_bound)
            values["train_weight"] = np.float64(w)
        values["clipped"] = np.int64(min(self._clip.clipped, self.plan.clip_capacity))
        return {PREFIX + k: np.asarray(v) for k, v in values.items()}


class EvaluatedClient:
    """``inner`` with federated evaluation: strips the plan from the broadcast, evaluates before the
    first step, trains on the training view, and adds the metrics to the plan's step. In a round
    that only evaluates, the metrics are the whole input and the algorithm's half is not asked."""

    def __init__(self, inner: ClientAlgorithm) -> None:
        self.inner = inner
        self._rounds: dict[int, RoundEvaluation] = {}

    def __getattr__(self, attr: str) -> Any:  # personal_model and the like, when the inner half has them
        if attr == "inner":
            raise AttributeError(attr)
        return getattr(self.inner, attr)

    def contribute(
        self, step: str, broadcast: Mapping[str, np.ndarray], device: LocalTrainer, local_state: Any
    ) -> tuple[Arrays, Any]:
        plain = {k: v for k, v in broadcast.items() if k != PLAN}
        key = id(device)
        if PLAN in broadcast:
            plan = EvaluationPlan.from_tensor(broadcast[PLAN])
            self._rounds[key] = RoundEvaluation.before_training(plan, plain, device, self.inner, local_state)
        current = self._rounds.get(key)
        if current is not None and current.plan.only:  # nothing to train: the scores are the input
            del self._rounds[key]
            return current.payload(), local_state
        trainer = current.trainer if current is not None else device
        values, state = self.inner.contribute(step, plain, trainer, local_state)
        if current is not None and step == current.plan.step:
            values = {**values, **current.payload()}
            del self._rounds[key]
        return values, state
