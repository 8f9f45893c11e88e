"""``tally fleet --report DIR``: the load test's report, as JSON and one PNG a person reads.

The PNG has six panels: check-ins per second over the run, each round's phases as bars on the
same clock, latency percentiles of every coordinator call and phase as the devices measured
them, where sessions ended early, the epsilon the devices' own privacy ledgers have spent (p50,
p99 and max over the devices, as the fleet exports them to Prometheus) and the tasks they refused,
by reason, over the run. The JSON holds every plotted series. matplotlib is only needed for the
picture.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tally.loadtest.fleet import FleetStats
from tally.loadtest.timeline import EPSILON_SERIES, FleetTimeline
from tally.secagg.phases import DEADLINED


def write_report(timeline: FleetTimeline, stats: FleetStats, directory: Path) -> list[Path]:
    """report.json, timeline.json (the samples, so that the reports of the shards of one fleet
    on several machines can be merged: ``FleetTimeline.merge``), and report.png when matplotlib
    is installed; the paths written."""
    directory.mkdir(parents=True, exist_ok=True)
    report = {"fleet": stats.to_dict(), **timeline.summary()}
    written = [directory / "report.json", directory / "timeline.json"]
    written[0].write_text(json.dumps(report, indent=2))
    written[1].write_text(json.dumps(timeline.to_json()))
    try:
        import matplotlib
    except ImportError:
        return written
    matplotlib.use("Agg")
    written.append(_plot(timeline, report, directory / "report.png"))
    return written


def _plot(timeline: FleetTimeline, report: dict[str, Any], path: Path) -> Path:
    import matplotlib.pyplot as plt

    start = min(timeline.checkins, default=0)
    fig, ((checkins, rounds), (latency, ended), (epsilon, refused)) = plt.subplots(3, 2, figsize=(13, 12))
    seconds = sorted(timeline.checkins)
    checkins.plot([s - start for s in seconds], [timeline.checkins[s] for s in seconds], lw=1)
    checkins.set(title="check-ins per second", xlabel="seconds since the first check-in", ylabel="check-ins")

    colours = dict(zip(DEADLINED, plt.get_cmap("tab10").colors, strict=False))
    ordered = sorted(report["rounds"].items(), key=lambda kv: min(s for s, _ in kv[1].values()))
    for row, (_, phases) in enumerate(ordered):
        for phase, (begin, end) in phases.items():  # first ask to last answer of the phase
            rounds.barh(row, end - begin, left=begin, color=colours.get(phase, "grey"), height=0.8)
    rounds.set_yticks(range(len(ordered)), [name.rsplit("/", 1)[-1] for name, _ in ordered], fontsize=7)
    rounds.set(title="round timeline: each phase from first ask to last answer",
               xlabel="seconds since the first check-in", ylabel="round")
    rounds.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=c) for c in colours.values()], labels=list(colours),
                  fontsize=7, loc="lower right")

    series = {**{f"rpc {k}": v for k, v in report["rpc_seconds"].items()},
              **{f"phase {k}": v for k, v in report["phase_seconds"].items()}}
    names = list(series)
    for offset, q in zip((-0.25, 0.0, 0.25), ("p50", "p95", "p99"), strict=True):
        latency.barh([i + offset for i in range(len(names))], [series[n][q] for n in names], height=0.25, label=q)
    latency.set_yticks(range(len(names)), names, fontsize=7)
    latency.set(title="latency as the devices saw it (CheckIn: held until selected)", xlabel="seconds",
                xscale="log")
    latency.legend(fontsize=7)

    early = report["ended_early"]
    if not early:
        ended.text(0.5, 0.5, "every session completed", ha="center", va="center", transform=ended.transAxes)
    ended.bar(range(len(early)), list(early.values()))
    ended.set_xticks(range(len(early)), list(early), rotation=30, ha="right", fontsize=7)
    ended.set(title="sessions that ended early, by phase / outcome", ylabel="sessions")
    _plot_privacy(epsilon, refused, report)
    fig.suptitle(f"fleet of {report['fleet']['devices']}: {report['fleet']['tasks_done']} tasks, "
                 f"{report['fleet']['checkins']} check-ins")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _plot_privacy(epsilon: Any, refused: Any, report: dict[str, Any]) -> None:
    """The devices' own epsilon quantiles and their refusals by reason, on the run's clock (steps:
    a figure holds until it changes)."""
    spent = report["device_epsilon"]
    for name in EPSILON_SERIES:
        epsilon.step(spent["seconds"], spent[name], where="post", label=name)
    epsilon.set(title="epsilon each device's own ledger has spent (over the devices)",
                xlabel="seconds since the first check-in", ylabel="epsilon")
    epsilon.legend(fontsize=7)
    refused.sharex(epsilon)  # one clock: a refusal lines up with the epsilon that caused it
    for reason, series in report["refusals"].items():
        refused.step([s for s, _ in series], [n for _, n in series], where="post", label=reason)
    if report["refusals"]:
        refused.legend(fontsize=7)
    else:
        refused.text(0.5, 0.5, "no device refused a task", ha="center", va="center", transform=refused.transAxes)
    refused.set(title="tasks the devices refused, by reason (so far)", xlabel="seconds since the first check-in",
                ylabel="tasks")
