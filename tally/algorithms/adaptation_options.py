"""Local adaptation's options, without torch: what the coordinator checks in a job spec's
``adaptation:`` block and what a device receives with its task (specs/local-adaptation.md 6).

``AdaptationOptions`` is one technique's settings (``tally.client.adaptation.adapt`` runs it).
``JobAdaptation`` is the job option around it: the technique plus what the device does around the
technique after the job's last round commits (how much of its data it holds out to judge the
adapted model, whether it also trains the local-only baseline of the who-gains comparison). It
travels to devices as JSON in ``TaskAssignment.adaptation``. Both are plain data so that the
coordinator, which must not import the client SDK, and a device that never trains (a synthetic
fleet) can read them without loading torch.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from tally.algorithms.base import Options

METHODS = ("finetune", "freeze_base", "ewc", "distill")
KD_FORMS = ("hinton", "paper")
# The options each method alone uses: naming one for another method is a mistake in the spec.
METHOD_OPTIONS = {"trainable": ("freeze_base",), "ewc_lambda": ("ewc",), "alpha": ("distill",),
                  "temperature": ("distill",), "kd_form": ("distill",)}


@dataclass(frozen=True)
class AdaptationOptions(Options):
    options_of: ClassVar[str] = "adaptation"

    method: str = "finetune"
    epochs: int = 20
    lr: float = 0.1
    batch_size: int = 20
    trainable: tuple[str, ...] = ()  # freeze_base: patterns of the trained parameters; () = last module
    ewc_lambda: float = 5.0
    alpha: float = 0.5
    temperature: float = 6.0
    kd_form: str = "hinton"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"adaptation method must be one of {METHODS}, got {self.method!r}")
        if self.kd_form not in KD_FORMS:
            raise ValueError(f"kd_form must be 'hinton' or 'paper', got {self.kd_form!r}")
        if self.epochs < 0 or self.batch_size < 1 or self.lr <= 0 or self.temperature <= 0:
            raise ValueError("epochs must be >= 0, batch_size >= 1, lr and temperature > 0")
        if not 0 <= self.alpha <= 1 or self.ewc_lambda < 0:
            raise ValueError("alpha must lie in [0, 1] and ewc_lambda be >= 0")


@dataclass(frozen=True)
class JobAdaptation:
    """A job's ``adaptation:`` option as a device carries it out.

    ``validation``: the share of the device's examples held out of adaptation. On them the
    device compares the adapted model with the federated one and keeps the federated model when
    adaptation made it worse there (spec 11 #5: choose on validation, never on test data); 0
    holds nothing out, so the adapted model is kept unjudged. ``local_only_epochs``: when > 0,
    the device also trains a model on its own data alone, from fresh weights, and records the
    who-gains comparison (spec 5) on the held-out examples; 0 measures no baseline."""

    options: AdaptationOptions
    validation: float = 0.2
    local_only_epochs: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.validation < 1:
            raise ValueError(f"validation must lie in [0, 1), got {self.validation!r}")
        if self.local_only_epochs < 0:
            raise ValueError(f"local_only_epochs must be >= 0, got {self.local_only_epochs!r}")

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> JobAdaptation:
        raw = dict(raw)
        own = {f.name: raw.pop(f.name) for f in dataclasses.fields(cls) if f.name != "options" and f.name in raw}
        return cls(AdaptationOptions.from_dict(raw), **own)

    @classmethod
    def from_json(cls, text: str) -> JobAdaptation:
        raw = json.loads(text)
        if not isinstance(raw, Mapping):
            raise ValueError("an adaptation option is a JSON object")
        return cls.from_dict(raw)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self.options)
        out["trainable"] = list(self.options.trainable)
        return {**out, "validation": self.validation, "local_only_epochs": self.local_only_epochs}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)


def trainable_names(names: list[str], options: AdaptationOptions) -> list[str]:
    """The parameters adaptation trains: all of them, or for freeze_base those ``trainable``
    matches (by default the last module's: "only the final classifier trainable", spec 11 #11)."""
    if options.method != "freeze_base":
        return list(names)
    patterns = options.trainable or (names[-1].rpartition(".")[0] + ".*",)
    chosen = [n for n in names if any(fnmatch.fnmatchcase(n, p) for p in patterns)]
    if not chosen:
        raise ValueError(f"freeze_base: trainable {list(patterns)} matches none of {names}")
    return chosen
