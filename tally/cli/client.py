"""``tally client`` (one device on a dataset shard) and ``tally fleet`` (N simulated devices in
one or several processes), both against a running coordinator: their flags. What they do is in
``tally.cli.client_run`` and ``tally.cli.fleet_run``, imported only when a command runs, so
``--help`` needs neither torch nor gRPC nor the SDK, and ``tally client`` not the load tester."""

from __future__ import annotations

import argparse
import functools
import importlib
from pathlib import Path

from tally.cli import argtypes, exit_codes
from tally.cli.argtypes import add_metrics_arguments
from tally.security.tls import add_tls_arguments

DATASETS = ("digits",)


def _run(module: str, name: str, args: argparse.Namespace) -> int:
    """The command ``tally.cli.<module>.<name>``, imported when it runs."""
    return getattr(importlib.import_module(f"tally.cli.{module}"), name)(args)


def _runs(module: str, name: str) -> functools.partial[int]:
    # A partial, not a closure: `tally fleet --processes` pickles its arguments to each process.
    return functools.partial(_run, module, name)


def register(sub: argparse._SubParsersAction) -> None:
    c = sub.add_parser(
        "client",
        help="run one device on a shard of a dataset against a coordinator",
        description="Register, check in, train on the shard and take part in secure aggregation.",
        epilog=exit_codes.epilog(), formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_common(c)
    c.add_argument("--device-id", required=True, help="stable id of this device")
    c.add_argument("--shard", type=int, required=True, help="which shard of the split this device holds (0-based)")
    c.add_argument("--shards", type=int, required=True, help="number of shards the dataset is split into")
    c.add_argument("--cache-dir", type=Path, help="keep downloaded models here, by digest")
    c.add_argument("--state-dir", type=Path,
                   help="keep the device's per-job local state (personal layers) here, across restarts")
    c.add_argument("--max-tasks", type=int, help="exit after this many tasks (default: run until interrupted)")
    c.add_argument(
        "--identity", type=Path,
        help="the device's identity key file, created 0600 on first use and kept across restarts "
        "(default: <state-dir>/identity.key with --state-dir, else ~/.tally/<device-id>.identity)",
    )
    c.add_argument("--credential", type=_hex, default=b"", help="enrolment credential from `tally enrol` (hex)")
    c.add_argument(
        "--coordinator-key", type=Path,
        help="pin the coordinator's ticket.pub instead of learning it at registration",
    )
    _add_connect_timeout(c, "the device")
    c.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True,
                   help="a line on stderr when the device connects, ends a task or meets a new error, and a "
                   "summary at the end (the JSON statistics go to stdout either way)")
    c.set_defaults(run=_runs("client_run", "run_client"))

    f = sub.add_parser(
        "fleet",
        help="run N simulated devices (load tests, demos)",
        description="Many virtual devices, each a real client with its own stream, in one or several "
        "processes (--processes) of this machine and several machines (--shard).",
        epilog=exit_codes.epilog(), formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_common(f)
    f.add_argument("--devices", type=int, required=True, help="number of simulated devices")
    f.add_argument("--dropout", type=argtypes.FRACTION, default=0.0,
                   help="probability that a device drops in a session, in [0, 1)")
    f.add_argument(
        "--dropout-phases", metavar="PHASES",
        help="comma-separated phases a dropping device leaves in, chosen at random (default: any of "
        "advertise_keys, share_keys, masked_input, unmask)",
    )
    f.add_argument("--id-prefix", default="sim", help="device ids are <prefix>-<index>")
    f.add_argument("--cache-dir", type=Path, help="model cache shared by the simulated devices")
    f.add_argument("--state-dir", type=Path,
                   help="keep each device's per-job local state in <dir>/<device id>, across restarts")
    until = f.add_mutually_exclusive_group()
    until.add_argument("--max-tasks-per-device", type=int, help="each device stops after this many tasks")
    until.add_argument("--until-job-done", metavar="JOB_ID", help="stop when the coordinator reports the job finished")
    f.add_argument(
        "--shard", type=_shard, default=(0, 1), metavar="I/N",
        help="play only shard I (0-based) of N of the --devices devices, e.g. a Kubernetes indexed "
        "Job's $(JOB_COMPLETION_INDEX)/<completions>; ids, data and seeds follow the device's index in "
        "the whole fleet, so N shards are the same fleet as one process (default: 0/1, all)",
    )
    until.add_argument(
        "--stay", action="store_true",
        help="keep running after the jobs the fleet worked on end (default: exit when every job it "
        "was given tasks of has finished)",
    )
    _add_connect_timeout(f, "no device")
    f.add_argument("--json", type=Path, help="write the fleet's statistics here as JSON")
    f.add_argument(
        "--allow-plain", action="store_true",
        help="let the devices join benchmark-only plain (unmasked) sessions; without it they refuse",
    )
    f.add_argument(
        "--enrolment-key", type=Path,
        help="the coordinator's enrolment.key: the fleet provisions its simulated devices with it",
    )
    f.add_argument(
        "--synthetic", action="store_true",
        help="devices send synthetic updates (deterministic per device, job, round and step; no data, "
        "no training, no torch) instead of training on --dataset: a load test whose every committed "
        "sum can be checked exactly (--audit-token-file)",
    )
    f.add_argument(
        "--audit-token-file", type=Path, metavar="FILE",
        help="with the coordinator's admin token: at the end, check every committed sum the fleet's "
        "devices were in against the inputs they sent; exit 3 on any mismatch",
    )
    f.add_argument(
        "--audit-out", type=Path, metavar="FILE",
        help="write the fingerprints of every input the fleet's devices computed here (JSON), so that the "
        "shards of one fleet can be merged and checked together (bench/fleet.py does)",
    )
    f.add_argument(
        "--report", type=Path, metavar="DIR",
        help="at the end, write DIR/report.json (latency percentiles of every coordinator call and phase as "
        "the devices saw them, check-ins per second, each round's phases, early session ends) and "
        "DIR/report.png",
    )
    f.add_argument(
        "--profile", type=Path, metavar="YAML",
        help="how the devices behave: availability (or a diurnal curve), check-in period and jitter, "
        "compute speed, uplink/downlink bandwidth and latency, dropouts per phase, churn, misbehaviour "
        "(late, duplicated, replayed messages); each device draws its own from (--seed, its id). "
        "See tally/loadtest/behaviour.py and examples/fleet/profile.yaml",
    )
    f.add_argument(
        "--ramp", type=argtypes.number(0.0), default=0.0, metavar="SECONDS",
        help="devices come online over this many seconds, each at its own time (uniform, from --seed "
        "and its index), rather than all at once: a large fleet registering in one instant saturates "
        "the machine playing it (default: 0, all at once)",
    )
    f.add_argument(
        "--processes", type=argtypes.integer(1), metavar="P",
        help="play this shard's devices in P processes (process p plays sub-shard I*P+p of N*P; each "
        "serves its own metrics on --metrics-port + p); default: one per core this process may use "
        "(affinity and cgroup CPU limit), fewer for a small shard (one per 200 devices at most: "
        "tally.loadtest.processes.DEVICES_PER_EXTRA_PROCESS)",
    )
    f.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True, help="live progress display")
    f.set_defaults(run=_runs("fleet_run", "run_fleet"))


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--coordinator", required=True, metavar="ADDR", help="coordinator host:port")
    p.add_argument("--population", default="default", help="population (fleet) the devices belong to")
    p.add_argument("--dataset", choices=DATASETS, default="digits", help="bundled dataset to train on")
    p.add_argument("--alpha", type=float, default=0.5, help="Dirichlet label skew of the split (smaller: more skew)")
    p.add_argument("--seed", type=int, default=0, help="seed of the split, the training order and the encoding")
    p.add_argument("--model", metavar="KIND",
                   help="model kind the devices train: mlp, cnn, energy_mlp, or one of a --model-plugin's "
                   "(default: the job's, read from its model; a plug-in's model needs this and --hidden)")
    p.add_argument("--model-plugin", action="append", default=[], metavar="MODULE",
                   help="import this module's TALLY_MODELS, as the coordinator does (repeatable)")
    p.add_argument("--hidden", type=int,
                   help="hidden units of the mlp, channels of the cnn (default: the job's, read from its model)")
    p.add_argument(
        "--min-noise-multiplier", type=_non_negative, default=0.0, metavar="Z",
        help="refuse any sum whose differential-privacy noise is below multiplier Z: it must be "
        "distributed noise that the device adds its own share of (default: 0, no floor)")
    p.add_argument(
        "--max-epsilon", type=float, metavar="E",
        help="the device's own privacy budget: refuse, before training, any sum whose release would take "
        "its privacy ledger (PLD accounting of the noise it verified, no sampling amplification) past "
        "epsilon E at --delta; a sum without verifiable noise is never admitted (default: no budget)")
    p.add_argument("--delta", type=float, default=1e-5, metavar="D",
                   help="the delta of --max-epsilon (default: %(default)g)")
    p.add_argument("--budget-scope", choices=("device", "job"), default="device",
                   help="compose every job's releases into one budget (device) or each job's alone (job)")
    p.add_argument("--budget-accountant", choices=("pld", "rdp"), default="pld",
                   help="dp-accounting's PLD (tighter, default) or RDP accountant for the budget")
    p.add_argument(
        "--semi-honest-server", action="store_true",
        help="trust the aggregator not to lie about who survived: also join sessions without the "
        "consistency check (benchmarks, trusted deployments; a lying aggregator could then read one "
        "device's input). Without it the devices refuse such sessions")
    add_metrics_arguments(p, "client", optional=True)
    p.add_argument("--log-level", default="warning", help="structured JSON logs on stderr at this level")
    add_tls_arguments(p, identity=None)  # the CA only: a device presents no certificate


def _non_negative(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _hex(text: str) -> bytes:
    try:
        return bytes.fromhex(text)
    except ValueError:
        raise argparse.ArgumentTypeError("not hexadecimal") from None


def _shard(text: str) -> tuple[int, int]:
    index, sep, count = text.partition("/")
    try:
        i, n = int(index), int(count)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected I/N, e.g. 0/4") from None
    if not sep or n < 1 or not 0 <= i < n:
        raise argparse.ArgumentTypeError(f"{text!r}: expected I/N with 0 <= I < N")
    return i, n


def _add_connect_timeout(parser: argparse.ArgumentParser, who: str) -> None:
    parser.add_argument(
        "--connect-timeout", type=float, default=30.0, metavar="SECONDS",
        help=f"exit with an error if {who} reaches the coordinator within this time "
        "(default: %(default)s; 0: wait forever)",
    )
    parser.add_argument(
        "--task-timeout", type=argtypes.number(0.0), default=0.0, metavar="SECONDS",
        help=f"exit with status {exit_codes.NO_TASK} when no task has come within this time "
        "(default: 0, no limit)",
    )
