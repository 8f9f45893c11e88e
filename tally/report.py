"""Report files for a simulation: per-round JSON and the plots a researcher looks at
(learning curves, λ or p over rounds, per-domain and per-device results, each against
the baseline run)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

SUMMARY_KEYS = ("test_accuracy", "test_loss", "mean_loss", "worst_domain_loss", "mean_accuracy", "worst10_accuracy",
                "gini", "parity_gap")


def _runs(report: dict, baseline: dict | None) -> list[dict]:
    return [report] + ([baseline] if baseline else [])


def _curves(path: Path, runs: list[dict], key: str, label: str) -> Path | None:
    if all(r["per_round"][0].get(key) is None for r in runs):
        return None
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for run in runs:
        ax.plot([p["round"] for p in run["per_round"]], [p.get(key) for p in run["per_round"]], label=run["algorithm"])
    ax.set_xlabel("round")
    ax.set_ylabel(label)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _weights(path: Path, report: dict) -> Path | None:
    key = next((k for k in ("lambda", "p") if k in report["per_round"][0]), None)
    if key is None:
        return None
    values = np.array([p[key] for p in report["per_round"]])
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for j in range(values.shape[1]):
        ax.plot(values[:, j], lw=1, label=f"{'domain' if key == 'lambda' else 'device'} {j}" if values.shape[1] <= 10 else None)
    ax.set_xlabel("round")
    ax.set_ylabel("λ" if key == "lambda" else "p")
    ax.set_title(f"{report['algorithm']}: {'domain weights λ' if key == 'lambda' else 'mixing coefficients p'}")
    if values.shape[1] <= 10:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _per_domain(path: Path, runs: list[dict]) -> Path | None:
    if "per_domain_loss" not in runs[0]["final"]:
        return None
    fig, ax = plt.subplots(figsize=(6, 3.5))
    width = 0.8 / len(runs)
    for k, run in enumerate(runs):
        losses = run["final"]["per_domain_loss"]
        ax.bar(np.arange(len(losses)) + k * width, losses, width, label=run["algorithm"])
    ax.set_xlabel("domain")
    ax.set_ylabel("loss")
    ax.set_title("per-domain loss (lower is better; the worst domain is what agnostic training targets)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _per_device(path: Path, runs: list[dict]) -> Path | None:
    if "per_device_accuracy" not in runs[0]["final"]:
        return None
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for run in runs:
        acc = np.sort(run["final"]["per_device_accuracy"])
        ax.plot(np.linspace(0, 100, acc.size), acc, label=f"{run['algorithm']} (worst 10%: {run['final']['worst10_accuracy']:.3f})")
    ax.set_xlabel("devices, worst to best (%)")
    ax.set_ylabel("accuracy")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_report(directory: Path, report: dict, baseline: dict | None = None) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    runs = _runs(report, baseline)
    rounds = directory / "rounds.json"
    rounds.write_text(json.dumps({r["algorithm"]: r["per_round"] for r in runs}, indent=2))
    summary: dict[str, Any] = {r["algorithm"]: {k: r["final"][k] for k in SUMMARY_KEYS if k in r["final"]} for r in runs}
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
