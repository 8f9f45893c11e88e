"""``tally demo``: the whole system on 127.0.0.1 with the embedded defaults.

One coordinator and two aggregators run as separate processes behind TLS (certificates
from ``tally certs``); a fleet of simulated devices trains a torch classifier on
scikit-learn's digits, split non-IID, through secure aggregation, with a tenth of the
devices dropping at random phases. Each committed global model is then fetched as ONNX
and scored with ONNX Runtime on held-out digits, which is also how an application
without torch would use it.

Beside that central score the demo shows the job's federated evaluation: what the devices
measured on their own held-out examples (a tenth of each device's digits, never trained on),
which the coordinator knows only as sums (``tally job metrics``). No real deployment has the
central test set; the demo has both, so it shows that the federated figure tells the truth:
for each model the two agree within ``TOLERANCE_SE`` standard errors of their difference
(``agreement``), 0.03 apart on average (measured in docs/quickstart.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import yaml
from rich.console import Console
from rich.table import Table

from tally.cli.argtypes import FRACTION, POSITIVE, integer
from tally.cli.console import console as cli_console
from tally.evaluation.summary import EVALUATION_ONLY
from tally.ops.cluster import ProcessCluster
from tally.security.enrolment import SharedKeyEnrolment
from tally.shutdown import Signalled, cancelled_by_signals
from tally.wire.v1 import admin_pb2, common_pb2

DEVICES_DIR = "devices"  # under --out: each simulated device's state (its input ledger)

JOB_SPEC = """\
name: demo-digits-fedavg
algorithm: fedavg
rounds: {rounds}
cohort_size: {cohort}
over_selection: {over_selection}
min_cohort: 10
model: {{kind: mlp, inputs: 64, classes: 10, hidden: 64, seed: 0}}
options: {{local_epochs: 5, local_lr: 0.1, batch_size: 16}}
secure: {{dropout_rate: {dropout_rate}, corrupt_rate: 0.05}}
deadlines: {{checkin: 20, download: 20, advertise_keys: 10, share_keys: 10, masked_input: 30, unmask: 10}}
evaluation: {{final: true}}
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        help="coordinator, two aggregators and a simulated fleet on 127.0.0.1, with a report",
        description=__doc__,
    )
    p.add_argument("--devices", type=_devices, default=60,
                   help=f"simulated devices (at least {MIN_DEVICES}: {WHY_MIN_DEVICES})")
    p.add_argument("--rounds", type=integer(1), default=30, help="rounds of the job")
    p.add_argument("--dropout", type=FRACTION, default=0.1, help="probability a device drops in a session, in [0, 1)")
    p.add_argument("--alpha", type=POSITIVE, default=0.5, help="Dirichlet label skew of the split")
    p.add_argument("--seed", type=integer(0), default=0, help="seed of the split, training and dropouts")
    p.add_argument("--out", type=Path, default=Path("out/demo"), help="report, plot, state and certificates")
    p.add_argument(
        "--resume", action="store_true",
        help="continue the job an interrupted demo left in OUT/state (default: start from a fresh state)",
    )
    p.set_defaults(run=run)


MIN_DEVICES = 60
WHY_MIN_DEVICES = ("a round selects at most half of them, so a round interrupted after devices sent inputs can be "
                   "retried with the other half, and each of the two aggregators still sums at least 10 after "
                   "dropouts")
OVER_SELECTION = 1.3  # the job spec's
# The federated and the central accuracy of a model differ by sampling alone: the devices score
# ~60 held-out digits a round (binomial, n_fed), the central test set has 359 (n_test). They agree
# when |difference| <= TOLERANCE_SE * sqrt(p (1 - p) (1/n_fed + 1/n_test)), p the pooled accuracy;
# measured over 4 seeds of 31 models the largest was 1.9 standard errors, so 4 leaves chance no
# say (a binomial difference passes 4 with probability 1 - 6e-5).
TOLERANCE_SE = 4.0


def _devices(text: str) -> int:
    value = integer(1)(text)
    if value < MIN_DEVICES:
        raise argparse.ArgumentTypeError(
            f"the demo needs at least {MIN_DEVICES} devices ({WHY_MIN_DEVICES}), got {value}")
    return value


def _prepare(out: Path, resume: bool, console: Console) -> None:
    """Clear the last run's state for this one unless ``resume``, so an interrupted run's job
    never continues silently beside the new one (the cluster writes fresh certificates then)."""
    state = out / "state"
    if resume:
        if not (state / "admin.token").exists():
            raise ValueError(f"--resume: no earlier demo state in {state}")
        console.print(f"resuming from {state}")
        return
    if state.exists():
        shutil.rmtree(state)
        console.print(f"fresh state: removed the previous run's {state} (--resume continues its job instead)")
    # Fresh logs and device ledgers too: a resumed run appends to its own, a new one must not
    # read like the last.
    for leftover in ("logs", DEVICES_DIR):
        shutil.rmtree(out / leftover, ignore_errors=True)


async def _unfinished_job(cluster: ProcessCluster) -> admin_pb2.Job | None:
    """The newest job a resumed coordinator is still running."""
    stub, md = cluster.admin()
    states = [common_pb2.JOB_STATE_PENDING, common_pb2.JOB_STATE_RUNNING]
    page = await stub.ListJobs(admin_pb2.ListJobsRequest(states=states), metadata=md, timeout=30)
    return page.jobs[-1] if page.jobs else None


async def _demo(args: argparse.Namespace, console: Console) -> dict:
    # Imported here, not with the module: they bring torch and scikit-learn, and `--help` must
    # not wait for them.
    from tally.client import Device, OnnxModel
    from tally.datasets.digits import digits
    from tally.loadtest import DropoutPlan, Fleet
    from tally.models.mlp import mlp
    from tally.training import TorchTrainer, single_threaded

    out = args.out.resolve()
    _prepare(out, args.resume, console)
    # One identity per process, as a deployment would hand them out; the coordinator's own
    # check-in hold, as a deployment would run it.
    async with ProcessCluster(out, aggregators=2, checkin_hold_s=None,
                              new_certificates=not args.resume) as cluster:
        console.print(f"coordinator and two aggregators up; devices dial {cluster.target} "
                      f"(TLS, CA in {cluster.certs})")
        stub, md = cluster.admin()
        # A device that sent an input in a round never serves the round's retry: the other half of
        # the population is what a retry past MaskedInput (after a failure or a --resume) seats.
        cohort = int(args.devices / 2 / OVER_SELECTION)
        resumed = await _unfinished_job(cluster) if args.resume else None
        if resumed is not None:
            job_id, cohort = resumed.job_id, int(yaml.safe_load(resumed.spec_yaml)["cohort_size"])
            console.print(f"job {job_id}: resumed after round {resumed.committed_round}")
        else:
            spec = JOB_SPEC.format(rounds=args.rounds, cohort=cohort, over_selection=OVER_SELECTION,
                                   dropout_rate=max(args.dropout, 0.05))
            submitted = await stub.SubmitJob(admin_pb2.SubmitJobRequest(spec_yaml=spec), metadata=md, timeout=30)
            job_id = submitted.job_id
            for warning in submitted.warnings:  # e.g. cohorts split too close to min_cohort
                console.print(f"warning: {warning}")
            console.print(f"job {job_id}: fedavg, {args.rounds} rounds, cohorts of {cohort} of {args.devices} devices")

        single_threaded()
        fed = digits(args.devices, alpha=args.alpha, seed=args.seed)
        factory = lambda: mlp(fed.num_features, fed.num_classes, hidden=64, seed=0)  # noqa: E731
        trainers = [TorchTrainer(factory, X, y, seed=args.seed + i) for i, (X, y) in enumerate(fed.clients)]
        # The demo provisions its simulated devices with the coordinator's enrolment key.
        enrolment_key = cluster.enrolment_key
        # Each device keeps its input ledger on disk, as a real one would: after an interruption
        # it can show the coordinator which rounds it sent nothing to, and be seated again in them.
        fleet = Fleet(cluster.target, cluster.tls, trainers, dropout=DropoutPlan(args.dropout, seed=args.seed),
                      seed=args.seed, enrolment_key=enrolment_key, state_dir=out / DEVICES_DIR)
        start = time.perf_counter()
        stats = await fleet.run(until=fleet.until_job_done(job_id), progress=True, console=console)
        elapsed = time.perf_counter() - start
        fleet.close()
        job = await stub.GetJob(admin_pb2.GetJobRequest(job_id=job_id), metadata=md, timeout=30)

        credential = SharedKeyEnrolment(enrolment_key).credential("default", "demo-evaluator")
        evaluator = Device(cluster.target, cluster.tls, "demo-evaluator", trainers[0], enrolment_credential=credential)
        test_x, test_y = fed.test
        central = []  # of the initial model and each committed one
        for r in range(0, args.rounds + 1):  # the final evaluation's round commits the same model again
            model = OnnxModel.from_bytes(await evaluator.fetch_onnx(f"{job_id}/v{r}"))
            central.append(float(model.evaluate(test_x, test_y)[1]))
        figures = await stub.GetJobMetrics(admin_pb2.GetJobMetricsRequest(job_id=job_id), metadata=md, timeout=30)
    federated = _federated(figures)
    accuracy = central[1:]
    return {
        "job_id": job_id,
        "job_state": common_pb2.JobState.Name(job.state).removeprefix("JOB_STATE_"),
        "job_message": job.message,
        "devices": args.devices,
        "rounds": len(accuracy),
        "cohort_size": cohort,
        "accuracy_per_round": accuracy,
        "final_accuracy": accuracy[-1] if accuracy else None,
        "initial_accuracy": central[0],
        "federated": federated,
        "agreement": _agreement(central, federated, len(test_y)),
        "dropouts_handled": stats.dropouts,
        "sessions_completed": stats.sessions_completed,
        "sessions_aborted": stats.sessions_aborted,
        "bytes_up": stats.bytes_up,
        "bytes_down": stats.bytes_down,
        "seconds": elapsed,
    }


def _federated(figures: admin_pb2.JobMetrics) -> list[dict]:
    """Per committed round, what its devices measured on their held-out examples. Round r's
    devices score the model they received, the one after round r - 1, before training on it; the
    final evaluation's devices score the final model (``evaluation: {final: true}``)."""
    return [{"round": r.round, "model": int(r.metrics.get(EVALUATION_ONLY, r.round - 1)),
             "accuracy": r.metrics["eval.accuracy"],
             "loss": r.metrics["eval.loss"], "examples": int(r.metrics["eval.examples"]),
             "devices": int(r.metrics["eval.devices"]), "worst_decile": r.metrics["eval.accuracy_p10"]}
            for r in figures.rounds if "eval.accuracy" in r.metrics]


def _agreement(central: list[float], federated: list[dict], n_test: int) -> dict:
    """How far the devices' figure of each model is from its central score, in accuracy and in
    standard errors of the difference of two binomial estimates."""
    gaps, errors = [], []
    for f in federated:
        p_fed, p_test, n_fed = f["accuracy"], central[f["model"]], f["examples"]
        pooled = (p_fed * n_fed + p_test * n_test) / (n_fed + n_test)
        se = float(np.sqrt(pooled * (1 - pooled) * (1 / n_fed + 1 / n_test)))
        f["difference"] = p_fed - p_test
        f["standard_errors"] = abs(p_fed - p_test) / se if se > 0 else 0.0
        gaps.append(abs(f["difference"]))
        errors.append(f["standard_errors"])
    return {
        "models_compared": len(gaps), "tolerance_standard_errors": TOLERANCE_SE,
        "mean_abs_difference": float(np.mean(gaps)) if gaps else None,
        "max_abs_difference": max(gaps, default=None), "max_standard_errors": max(errors, default=None),
        "within_tolerance": all(e <= TOLERANCE_SE for e in errors),
    }


def _plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(6, 3.5))
    central = [report["initial_accuracy"], *report["accuracy_per_round"]]
    ax.plot(np.arange(len(central)), central, marker="o", label="central: ONNX Runtime on the test digits")
    ax.plot([f["model"] for f in report["federated"]], [f["accuracy"] for f in report["federated"]], marker=".",
            ls=":", label="federated: the devices' held-out sums")
    ax.axhline(0.9, color="grey", ls="--", lw=1)
    ax.legend(fontsize="small", loc="lower right")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("model after round")
    ax.set_ylabel("accuracy")
    ax.set_ylim(0, 1)
    ax.set_title(f"FedAvg over secure sums: {report['devices']} devices, {report['dropouts_handled']} dropouts")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _table(report: dict) -> Table:
    """Each model's central score beside what the devices measured of it (the last one in the
    final evaluation's round)."""
    table = Table(title="demo: accuracy of each model")
    for name in ("model after round", "central (ONNX, test digits)", "federated (devices' held-out)",
                 "held-out examples", "difference (std errors)"):
        table.add_column(name, justify="right")
    by_model = {f["model"]: f for f in report["federated"]}
    for r, acc in enumerate([report["initial_accuracy"], *report["accuracy_per_round"]]):
        f = by_model.get(r)
        table.add_row(str(r), f"{acc:.3f}", *((f"{f['accuracy']:.3f}", str(f["examples"]),
                                               f"{f['difference']:+.3f} ({f['standard_errors']:.1f})")
                                              if f else ("-", "", "")))
    return table


def run(args: argparse.Namespace) -> int:
    console = cli_console()
    try:
        # SIGTERM or SIGINT cancels the demo, so its ``finally`` stops every child process (they
        # would otherwise outlive it, orphaned, holding their ports).
        report = asyncio.run(cancelled_by_signals(_demo(args, console)))
    except Signalled as stopped:
        print(f"tally demo: stopped by {stopped}; its coordinator and aggregators were stopped", file=sys.stderr)
        return 128 + stopped.signum
    except (ValueError, RuntimeError) as exc:  # --resume with nothing to resume, a service that did not start
        print(f"tally demo: {exc}", file=sys.stderr)
        return 1
    console.print(_table(report))
    agreement = report["agreement"]
    if agreement["models_compared"]:
        verdict = "agree" if agreement["within_tolerance"] else "DISAGREE"
        console.print(
            f"federated evaluation vs the central test score: {verdict} within {TOLERANCE_SE:g} standard errors "
            f"for all {agreement['models_compared']} models (largest {agreement['max_standard_errors']:.1f}); "
            f"mean |difference| {agreement['mean_abs_difference']:.3f}, largest {agreement['max_abs_difference']:.3f}"
        )
    console.print(
        f"{report['sessions_completed']} device sessions summed, {report['dropouts_handled']} dropouts handled, "
        f"{report['bytes_up'] / 2**20:.1f} MiB up / {report['bytes_down'] / 2**20:.1f} MiB down, "
        f"{report['seconds']:.0f} s"
    )
    args.out.mkdir(parents=True, exist_ok=True)
    report_path, plot_path = args.out / "report.json", args.out / "accuracy.png"
    report_path.write_text(json.dumps(report, indent=2))
    _plot(report, plot_path)
    ok = report["final_accuracy"] is not None and report["final_accuracy"] >= 0.9
    print(f"report: {report_path}  plot: {plot_path}")
    if ok:  # the quickstart's last line: whether the run reached 90 %, either way
        print(f"tally demo: final test accuracy {report['final_accuracy']:.3f}: reached 90 %")
    else:
        why = (f"job {report['job_state']}: {report['job_message']}" if report["job_state"] != "SUCCEEDED"
               else f"final accuracy {report['final_accuracy']:.3f} is below 0.9")
        print(f"tally demo: {why} (logs in {args.out / 'logs'})", file=sys.stderr)
    return 0 if ok else 1
