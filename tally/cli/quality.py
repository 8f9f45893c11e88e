"""Model quality as the job commands show it: ``watch``'s line per round, ``status``'s latest and
best, ``metrics``' table (or JSON, CSV) and ``plot``'s curves.

Every figure here is what the coordinator computed from the devices' metric *sums*
(``tally.evaluation.summary``; docs/evaluation.md): the mean over devices, a histogram of how
many devices fall in each accuracy bin, never one device's value. The figures of round r score
the model the devices *received* in round r (v{r-1}), measured before they trained on it; those
of a round that only evaluates (``evaluation.final``/``separate``) score the model committed just
before it.

Kept apart from ``tally.cli.job`` so the job commands' other lines and this one change
independently.
"""

from __future__ import annotations

import csv
import io
import math
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tally.evaluation.summary import EVALUATION_ONLY, HISTOGRAM, histogram, is_quality

SPARK = "▁▂▃▄▅▆▇█"
PERSONAL = "personal.accuracy"
# The figures whose best round `tally job status` names: key -> whether higher is better.
BEST = {"eval.accuracy": True, PERSONAL: True, "eval.loss": False}
# Always first, in this order, wherever figures are listed; the rest (domains, custom) follow by name.
LEADING = ("train.loss", "eval.loss", "eval.accuracy", "eval.accuracy_p10", PERSONAL)
TRAILING = ("eval.devices", "eval.examples", "eval.clipped")
SHORT = {"train.loss": "train loss", "eval.loss": "eval loss", "eval.accuracy": "acc", "eval.accuracy_p10": "p10",
         PERSONAL: "personal acc", "eval.clipped": "clipped"}


class MissingPackage(RuntimeError):
    """An optional package a command needs is not installed (the message says which and how)."""


def require(module: str, command: str) -> Any:
    """``module`` imported, or ``MissingPackage`` naming the distribution to install."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        package = module.split(".")[0]
        raise MissingPackage(f"`tally job {command}` needs {package}, which is not installed: "
                             f"pip install {package} (or tally[all])") from None


@dataclass(frozen=True)
class RoundFigures:
    """One committed round's figures as GetJobMetrics returns them."""

    round: int
    committed_at: str
    metrics: dict[str, float]

    def as_dict(self) -> dict[str, Any]:
        return {"round": self.round, "committed_at": self.committed_at, "metrics": self.metrics}


# -- one line ------------------------------------------------------------------------------------


def spark(counts: Sequence[float]) -> str:
    """A histogram as one character per bin, the tallest bin full height (empty bins blank-low)."""
    top = max(counts, default=0.0)
    if top <= 0:
        return ""
    return "".join(SPARK[min(len(SPARK) - 1, int(round(c / top * (len(SPARK) - 1))))] if c > 0 else " "
                   for c in counts)


def _number(key: str, value: float) -> str:
    """Counts as whole numbers, means to three places."""
    if key in TRAILING or (key.startswith("custom.") and float(value).is_integer()):
        return f"{value:.0f}"
    return f"{value:.3f}" if abs(value) < 1000 else f"{value:.4g}"


def counts_line(metrics: Mapping[str, float]) -> str:
    """The round's own counts, compact: devices seated, each sum's contributors and dropouts,
    the attempt when it was a retry, and the ε spent under DP."""
    parts = []
    if "selected" in metrics:
        parts.append(f"{metrics['selected']:.0f} selected")
    for key in sorted(k for k in metrics if k.endswith(".contributors")):
        step = key.removesuffix(".contributors")
        dropped = metrics.get(f"{step}.dropped", 0.0)
        parts.append(f"{step} {metrics[key]:.0f}" + (f" ({dropped:.0f} dropped)" if dropped else ""))
    if metrics.get("attempt", 1.0) > 1:
        parts.append(f"attempt {metrics['attempt']:.0f}")
    if "privacy.epsilon" in metrics:
        parts.append(f"ε {metrics['privacy.epsilon']:.3g}")
    return ", ".join(parts)


def ordered_keys(keys: Iterable[str]) -> list[str]:
    """Scalar quality figures in reading order (histogram bins are left to ``spark``)."""
    keys = {k for k in keys if is_quality(k) and not _is_bin(k)}
    middle = sorted(keys - set(LEADING) - set(TRAILING), key=_custom_last)
    return [k for k in LEADING if k in keys] + middle + [k for k in TRAILING if k in keys]


def _custom_last(key: str) -> tuple[bool, str]:
    """The built-in figures (per domain) before a trainer's own."""
    return key.startswith("custom."), key


def _is_bin(key: str) -> bool:
    return key.startswith(HISTOGRAM) or ".hist." in key


def histograms(figures: Mapping[str, float]) -> dict[str, list[float]]:
    """Each histogram among the figures, by its name ('eval.accuracy', 'custom.NAME')."""
    prefixes = sorted({k[:k.rindex(".") + 1] for k in figures if _is_bin(k)}, key=_custom_last)
    return {p.removesuffix("_hist.").removesuffix(".hist."): histogram(figures, p) for p in prefixes}


def _label(key: str) -> str:
    return SHORT.get(key) or key.removeprefix("eval.").removeprefix("custom.")


def quality_line(figures: Mapping[str, float]) -> str:
    """The round's model quality in one line: losses, accuracies, the worst decile and the
    accuracy histogram as a spark, per-domain and custom figures."""
    parts = []
    for key in ordered_keys(figures):
        if key in ("eval.devices", "eval.examples"):
            continue
        if key == "eval.clipped" and not figures[key]:
            continue
        parts.append(f"{_label(key)} {_number(key, figures[key])}")
    for name, counts in histograms(figures).items():
        parts.append(f"{_label(name)} spread [{spark(counts)}]")
    if "eval.devices" in figures:
        parts.append(f"over {figures['eval.devices']:.0f} devices")
    return "  ".join(parts)


def round_line(metrics: Mapping[str, float]) -> str:
    """What ``tally job watch`` prints after an event's message."""
    return "  ".join(filter(None, (counts_line(metrics), quality_line(metrics))))


# -- status --------------------------------------------------------------------------------------


def summary(rounds: Sequence[RoundFigures]) -> dict[str, Any] | None:
    """The latest round with figures, its figures, and the best value and its round of each of
    ``BEST`` (None when no round measured anything)."""
    measured = [r for r in rounds if any(is_quality(k) for k in r.metrics)]
    if not measured:
        return None
    latest = measured[-1]
    best = {}
    for key, higher in BEST.items():
        seen = [(r.metrics[key], r.round) for r in measured if key in r.metrics]
        if seen:
            value, round_ = min(seen, key=lambda vr: (-vr[0] if higher else vr[0], vr[1]))  # earliest on ties
            best[key] = {"value": value, "round": round_}
    return {"round": latest.round, "latest": {k: v for k, v in latest.metrics.items() if is_quality(k)},
            "best": best}


def summary_line(found: Mapping[str, Any] | None) -> str:
    """``tally job status``'s quality line ('' when the job measured nothing yet)."""
    if found is None:
        return ""
    best = ", ".join(f"{_label(k)} {_number(k, b['value'])} (round {b['round']})" for k, b in found["best"].items())
    return f"quality at round {found['round']}: {quality_line(found['latest'])}" + (f"; best: {best}" if best else "")


# -- tally job metrics ---------------------------------------------------------------------------


def columns(rounds: Sequence[RoundFigures]) -> list[str]:
    """Every figure any round has, in reading order, quality first, the round's counts after."""
    keys: set[str] = set().union(*(r.metrics for r in rounds)) if rounds else set()
    quality_keys = ordered_keys(keys)
    bins = sorted(k for k in keys if _is_bin(k))
    return quality_keys + bins + sorted(keys - set(quality_keys) - set(bins))


def csv_text(rounds: Sequence[RoundFigures]) -> str:
    """One row per round, one column per figure (empty where a round lacks it)."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    keys = columns(rounds)
    writer.writerow(["round", "committed_at", *keys])
    for r in rounds:
        writer.writerow([r.round, r.committed_at, *(repr(r.metrics[k]) if k in r.metrics else "" for k in keys)])
    return out.getvalue()


def table(rounds: Sequence[RoundFigures], title: str) -> Any:
    """A rich table of the quality figures per round, each histogram as a spark column."""
    rich_table = require("rich.table", "metrics")
    keys = ordered_keys(set().union(*(r.metrics for r in rounds)) if rounds else ())
    names = sorted({name for r in rounds for name in histograms(r.metrics)})
    grid = rich_table.Table(title=title)
    grid.add_column("round", justify="right")
    for key in keys:
        grid.add_column(_label(key), justify="right")
    for name in names:
        grid.add_column(f"{_label(name)} spread")
    grid.add_column("devices (counts)")
    for r in rounds:
        spreads = histograms(r.metrics)
        grid.add_row(round_label(r), *(_number(k, r.metrics[k]) if k in r.metrics else "" for k in keys),
                     *(spark(spreads.get(name, [])) for name in names), counts_line(r.metrics))
    return grid


def round_label(r: RoundFigures) -> str:
    """A round's number, and for a round that only evaluated, the training round it scored."""
    scored = r.metrics.get(EVALUATION_ONLY)
    return str(r.round) if scored is None else f"{r.round} (eval of {int(scored)})"


# -- tally job plot ------------------------------------------------------------------------------


def plot(rounds: Sequence[RoundFigures], path: Path, title: str) -> None:
    """Loss and accuracy per round, the devices' accuracy spread shaded between the worst-decile
    estimate and the mean."""
    matplotlib = require("matplotlib", "plot")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    def series(key: str) -> tuple[list[int], list[float]]:
        pairs = [(r.round, r.metrics[key]) for r in rounds if key in r.metrics and math.isfinite(r.metrics[key])]
        return [p[0] for p in pairs], [p[1] for p in pairs]

    keys = set().union(*(r.metrics for r in rounds)) if rounds else set()
    fig, (loss_ax, acc_ax) = plt.subplots(1, 2, figsize=(10, 3.8))
    for key in ["train.loss", "eval.loss", *sorted(k for k in keys if k.startswith("eval.domain") and
                                                   k.endswith(".loss"))]:
        x, y = series(key)
        if x:
            loss_ax.plot(x, y, marker="." if "domain" in key else "o", ls=":" if "domain" in key else "-",
                         label=_label(key))
    loss_ax.set_ylabel("loss")
    both = [r for r in rounds if "eval.accuracy" in r.metrics and "eval.accuracy_p10" in r.metrics]
    if both:
        acc_ax.fill_between([r.round for r in both], [r.metrics["eval.accuracy_p10"] for r in both],
                            [r.metrics["eval.accuracy"] for r in both], alpha=0.25,
                            label="devices' spread (worst decile to mean)")
    for key in ["eval.accuracy", PERSONAL, "eval.accuracy_p10",
                *sorted(k for k in keys if k.startswith("eval.domain") and k.endswith(".accuracy"))]:
        x, y = series(key)
        if x:
            acc_ax.plot(x, y, marker="." if "domain" in key or "p10" in key else "o",
                        ls=":" if "domain" in key or "p10" in key else "-",
                        label={"eval.accuracy": "eval accuracy (mean)", "eval.accuracy_p10": "worst decile (est.)"}
                        .get(key, _label(key)))
    acc_ax.set_ylabel("accuracy")
    acc_ax.set_ylim(0, 1)
    for ax in (loss_ax, acc_ax):
        ax.set_xlabel("round")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


# -- tally job model -----------------------------------------------------------------------------


def personalised(algorithm: str) -> bool:
    """Whether the algorithm's devices end up with models of their own (LG-FedAvg, SuPerFed)."""
    from tally import algorithms
    from tally.algorithms.base import PersonalisedClient

    if algorithm not in algorithms.NAMES:
        return False
    return isinstance(algorithms.make(algorithm)[1], PersonalisedClient)


def model_warning(algorithm: str, rounds: Sequence[RoundFigures]) -> str:
    """What a personalised job's downloaded model is, and which figure to judge the job by
    ('' for an algorithm whose devices all use the global model)."""
    if not personalised(algorithm):
        return ""
    latest = next((r for r in reversed(rounds) if PERSONAL in r.metrics), None)
    measured = (f" (round {latest.round}: {PERSONAL} {_number(PERSONAL, latest.metrics[PERSONAL])}, "
                f"the global model's eval.accuracy {_number('', latest.metrics.get('eval.accuracy', math.nan))})"
                if latest is not None else "")
    return (f"{algorithm} is personalised: this file is the shared part, the model a new device starts from; "
            "each device's own layers stay on the device and are not in it, so it scores lower than what "
            f"devices use. Judge the job by {PERSONAL}{measured}, shown by `tally job metrics`.")


def warn(text: str) -> None:
    if text:
        print(f"warning: {text}", file=sys.stderr)
