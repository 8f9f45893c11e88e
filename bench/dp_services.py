"""``dp_digits.py --services``: the accuracy-vs-epsilon sweep through the real services.

Per configuration (no DP, then distributed DP at each target epsilon), a fresh deployment: a
coordinator and two aggregators as processes over TLS (``ProcessCluster``), the job submitted with
its ``privacy:`` section, and the digits devices as one SDK fleet in this process (masking on,
each session left before its masked input with probability ``--dropout``). The final model
comes from the coordinator's store and is tested as the in-process run's is; the epsilon spent
is the ledger's, from the committed rounds' metrics. Each is followed by the in-process run at
the same settings (``run``), and both go in the row.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from tally import modelio
from tally.coordinator.state.store import Store
from tally.loadtest.dropout import DropoutPlan
from tally.loadtest.fleet import Fleet
from tally.ops.cluster import ProcessCluster
from tally.secagg.phases import Phase

# Seconds a device waits in a check-in for a round to seat it: short, so cohorts form quickly.
CHECKIN_HOLD_SECONDS = 1.0
AGGREGATORS = 2


def min_cohort(args: argparse.Namespace) -> int:
    """The coordinator applies min_cohort to each aggregator's half of the cohort: 60 % of a half,
    so ``--dropout`` leavers rarely fail an attempt (the in-process run never fails one), and at
    least 5, the smallest secure cohort at the default dropout and corrupt rates."""
    return max(5, int(0.6 * args.cohort / AGGREGATORS))


def job_spec(args: argparse.Namespace, seed: int, epsilon: float | None) -> str:
    options = json.dumps({"local_epochs": args.local_epochs, "local_lr": args.local_lr,
                          "server_lr": args.server_lr, "example_cap": 1, "batch_size": 16})
    text = (
        f"name: dp-digits\nalgorithm: fedavg\nrounds: {args.rounds}\ncohort_size: {args.cohort}\n"
        f"min_cohort: {min_cohort(args)}\nover_selection: 1.0\nretries: 5\n"
        f"model: {{kind: mlp, inputs: 64, classes: 10, hidden: {args.hidden}, seed: {seed}}}\n"
        f"options: {options}\nsecure: {{dropout_rate: {args.dropout}, corrupt_rate: {args.corrupt}}}\n"
    )
    if epsilon is not None:  # delta in positional notation: YAML reads 1e-05 as a string
        text += (f"privacy: {{mechanism: distributed, clip: {args.clip}, target_epsilon: {epsilon}, "
                 f"delta: {args.delta:.12f}, population: {args.clients}}}\n")
    return text


async def _through_services(args: argparse.Namespace, seed: int, epsilon: float | None, workdir: Path,
                            population: Callable) -> dict:
    devices, _, test = population(args, seed)
    cluster = ProcessCluster(workdir, aggregators=AGGREGATORS, checkin_hold_s=CHECKIN_HOLD_SECONDS)
    start = time.perf_counter()
    await cluster.start()
    try:
        job_id = await cluster.submit(job_spec(args, seed, epsilon))
        fleet = Fleet(cluster.target, cluster.tls, devices, enrolment_key=cluster.enrolment_key, seed=seed,
                      dropout=DropoutPlan(args.dropout, (Phase.MASKED_INPUT,), seed=seed) if args.dropout else None)
        try:
            stats = await fleet.run(until=fleet.until_job_done(job_id, every_seconds=0.5))
        finally:
            fleet.close()
        job = await cluster.job(job_id)
    finally:
        await cluster.stop()
    seconds = time.perf_counter() - start
    store = Store(cluster.state)
    try:
        model = modelio.deserialize(store.read_blob(store.model_version(job_id).model_digest))
        committed = sorted((r for r in store.rounds(job_id) if r.state == "committed"), key=lambda r: r.round)
    finally:
        store.close()
    loss, accuracy = test.evaluate(model)
    out = {"accuracy": accuracy, "loss": loss, "seconds": seconds, "job_state": job.state,
           "committed_rounds": len(committed), "sessions_completed": stats.sessions_completed,
           "dropouts": stats.dropouts}
    if epsilon is not None and committed:
        last = committed[-1].metrics
        out.update(epsilon_spent=last["privacy.epsilon"], noise_multiplier=last.get("privacy.noise_multiplier.0"),
                   contributors_per_round=[r.metrics.get("update.contributors") for r in committed])
    return out


def sweep_through_services(args: argparse.Namespace, in_process: Callable[..., dict], population: Callable,
                           median: Callable[[list[dict]], dict]) -> list[dict]:
    """Rows of (services, in process) per configuration, each the ``median`` over ``--seeds``
    seeds (with every seed's accuracy), also printed as a table."""
    configs: list[float | None] = [None, *args.epsilons]
    rows = []
    with tempfile.TemporaryDirectory() as tmp, Progress(console=Console(stderr=True)) as progress:
        root = args.workdir or Path(tmp)
        task = progress.add_task("DP digits through the services", total=2 * len(configs) * args.seeds)
        for i, epsilon in enumerate(configs):
            services, local = [], []
            for seed in range(args.seeds):
                services.append(asyncio.run(_through_services(args, seed, epsilon, root / f"run-{i}-{seed}",
                                                              population)))
                progress.advance(task)
                local.append(in_process(args, seed, None if epsilon is None else "distributed", epsilon))
                progress.advance(task)
            rows.append({"mechanism": "none" if epsilon is None else "distributed", "target_epsilon": epsilon,
                         "services": median(services), "in_process": median(local)})
    table = Table(title=f"DP FedAvg on digits through the services: {args.clients} devices, cohort "
                        f"{args.cohort}, {args.rounds} rounds, median of {args.seeds} seed(s)")
    for column in ("target eps", "spent eps (services / in process)", "accuracy (services / in process)",
                   "services seconds"):
        table.add_column(column)
    for r in rows:
        s, p = r["services"], r["in_process"]
        spent = ("-" if r["target_epsilon"] is None
                 else f"{s.get('epsilon_spent', float('nan')):.3f} / {p['epsilon_spent']:.3f}")
        table.add_row(f"{r['target_epsilon'] or 'no DP'}", spent, f"{s['accuracy']:.3f} / {p['accuracy']:.3f}",
                      f"{s['seconds']:.0f}")
    Console().print(table)
    return rows


def plot(rows: list[dict], args: argparse.Namespace) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4.2))
    private = [r for r in rows if r["target_epsilon"] is not None]
    for where, marker in (("services", "o"), ("in_process", "s")):
        ax.plot([r["target_epsilon"] for r in private], [r[where]["accuracy"] for r in private], marker=marker,
                label=f"distributed DP, {where.replace('_', ' ')}")
    baseline = next(r for r in rows if r["target_epsilon"] is None)
    ax.axhline(baseline["services"]["accuracy"], color="grey", linestyle="--", label="no DP, services")
    ax.axhline(baseline["in_process"]["accuracy"], color="grey", linestyle=":", label="no DP, in process")
    ax.set_xscale("log", base=2)
    ax.set_xlabel(f"epsilon (delta = {args.delta:g}, {args.rounds} rounds)")
    ax.set_ylabel("test accuracy")
    ax.set_title("through the services vs in process")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.plot, dpi=120)
