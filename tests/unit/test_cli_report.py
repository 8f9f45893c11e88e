"""`tally simulate --report` plots a person can read (issue 9, item 10): titles inside the figure,
whole-number ticks for rounds and domains, a log axis for losses that fall to 1e-8."""

from __future__ import annotations

import numpy as np
import pytest

from tally.sim import report


def _run(algorithm: str, rounds: int, domains: int, floor: float) -> dict:
    losses = np.geomspace(1.0, floor, rounds)
    weights = np.full((rounds, domains), 1 / domains)
    return {
        "algorithm": algorithm,
        "per_round": [{"round": r, "test_loss": float(losses[r]), "test_accuracy": 1 - float(losses[r]),
                       "lambda": weights[r].tolist()} for r in range(rounds)],
        "final": {"per_domain_loss": np.linspace(1e-8, 3e-8, domains).tolist(), "test_accuracy": 0.9,
                  "per_device_accuracy": [0.5, 0.7, 0.9], "worst10_accuracy": 0.5},
    }


@pytest.mark.parametrize(("rounds", "domains"), [(3, 2), (7, 3), (40, 5)])
def test_report_plots_fit_their_titles_and_use_whole_ticks_and_log_losses(tmp_path, monkeypatch, rounds, domains):
    figures = []
    monkeypatch.setattr(report.plt, "close", figures.append)  # keep the figures to look at them
    paths = report.write_report(tmp_path, _run("agnostic_fedavg", rounds, domains, 1e-8),
                                _run("fedavg", rounds, domains, 1e-3))
    assert {p.name for p in paths} >= {"loss.png", "accuracy.png", "weights.png", "per_domain.png", "per_device.png"}
    assert len(figures) == 5
    for fig in figures:
        renderer = fig.canvas.get_renderer()
        for ax in fig.axes:
            title = ax.title.get_window_extent(renderer)
            assert title.x0 >= 0 and title.x1 <= fig.bbox.x1, ax.get_title()
            if ax.get_xlabel() in ("round", "domain"):
                low, high = ax.get_xlim()
                ticks = [t for t in ax.get_xticks() if low <= t <= high]
                assert ticks and all(float(t).is_integer() for t in ticks), (ax.get_xlabel(), ticks)
            if ax.get_ylabel() == "test loss":  # from 1 to 1e-8
                assert ax.get_yscale() == "log"
            if ax.get_ylabel() == "test accuracy":
                assert ax.get_yscale() == "linear"
