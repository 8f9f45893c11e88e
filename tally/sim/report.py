"""Report files for a simulation: per-round JSON and the plots a researcher looks at
(learning curves, λ or p over rounds, per-domain and per-device results, each against
the baseline run)."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.ticker import MaxNLocator

TITLE_CHARS = 60  # a title wider than the 6-inch figure is wrapped, never clipped
LOG_SPAN = 100.0  # positive values spanning more than this factor are drawn on a log axis

SUMMARY_KEYS = ("test_accuracy", "test_loss", "mean_loss", "worst_domain_loss", "mean_accuracy", "worst10_accuracy",
                "gini", "parity_gap")


def _runs(report: dict, baseline: dict | None) -> list[dict]:
    return [report] + ([baseline] if baseline else [])


def _save(fig: Any, ax: Any, path: Path, title: str = "") -> Path:
    if title:
        ax.set_title(textwrap.fill(title, TITLE_CHARS), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _scale_y(ax: Any, values: Any) -> None:
    """A log axis when the values are positive and span orders of magnitude (losses falling
    to 1e-8 are a flat line at zero on a linear axis)."""
    finite = np.asarray([v for v in np.ravel(np.asarray(values, dtype=float)) if np.isfinite(v)])
    if finite.size and finite.min() > 0 and finite.max() / finite.min() > LOG_SPAN:
        ax.set_yscale("log")


def _curves(path: Path, runs: list[dict], key: str, label: str) -> Path | None:
    if all(r["per_round"][0].get(key) is None for r in runs):
        return None
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for run in runs:
        ax.plot([p["round"] for p in run["per_round"]], [p.get(key) for p in run["per_round"]], label=run["algorithm"])
    ax.set_xlabel("round")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel(label)
    _scale_y(ax, [p.get(key) for run in runs for p in run["per_round"] if p.get(key) is not None])
    ax.legend()
    return _save(fig, ax, path)


def _weights(path: Path, report: dict) -> Path | None:
    key = next((k for k in ("lambda", "p") if k in report["per_round"][0]), None)
    if key is None:
        return None
    values = np.array([p[key] for p in report["per_round"]])
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for j in range(values.shape[1]):
        ax.plot(values[:, j], lw=1,
                label=f"{'domain' if key == 'lambda' else 'device'} {j}" if values.shape[1] <= 10 else None)
    ax.set_xlabel("round")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("λ" if key == "lambda" else "p")
    if values.shape[1] <= 10:
        ax.legend(fontsize=7)
    return _save(fig, ax, path,
                 f"{report['algorithm']}: {'domain weights λ' if key == 'lambda' else 'mixing coefficients p'}")


def _per_domain(path: Path, runs: list[dict]) -> Path | None:
    if "per_domain_loss" not in runs[0]["final"]:
        return None
    fig, ax = plt.subplots(figsize=(6, 3.5))
    width = 0.8 / len(runs)
    domains = np.arange(len(runs[0]["final"]["per_domain_loss"]))
    for k, run in enumerate(runs):
        ax.bar(domains + (k - (len(runs) - 1) / 2) * width, run["final"]["per_domain_loss"], width,
               label=run["algorithm"])
    ax.set_xticks(domains)  # one tick per domain, at the centre of its bars
    ax.set_xlabel("domain")
    ax.set_ylabel("loss")
    _scale_y(ax, [run["final"]["per_domain_loss"] for run in runs])
    ax.legend()
    return _save(fig, ax, path, "per-domain loss (lower is better; the worst domain is what agnostic training targets)")


def _per_device(path: Path, runs: list[dict]) -> Path | None:
    if "per_device_accuracy" not in runs[0]["final"]:
        return None
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for run in runs:
        acc = np.sort(run["final"]["per_device_accuracy"])
        ax.plot(np.linspace(0, 100, acc.size), acc,
                label=f"{run['algorithm']} (worst 10%: {run['final']['worst10_accuracy']:.3f})")
    ax.set_xlabel("devices, worst to best (%)")
    ax.set_ylabel("accuracy")
    ax.legend()
    return _save(fig, ax, path)


def write_report(directory: Path, report: dict, baseline: dict | None = None) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    runs = _runs(report, baseline)
    rounds = directory / "rounds.json"
    rounds.write_text(json.dumps({r["algorithm"]: r["per_round"] for r in runs}, indent=2))
    summary: dict[str, Any] = {
        r["algorithm"]: {k: r["final"][k] for k in SUMMARY_KEYS if k in r["final"]} for r in runs}
    fairness = directory / "summary.json"
    fairness.write_text(json.dumps(summary, indent=2))
    plots = [
        _curves(directory / "loss.png", runs, "test_loss", "test loss"),
        _curves(directory / "accuracy.png", runs, "test_accuracy", "test accuracy"),
        _weights(directory / "weights.png", report),
        _per_domain(directory / "per_domain.png", runs),
        _per_device(directory / "per_device.png", runs),
    ]
    return [rounds, fairness] + [p for p in plots if p is not None]
