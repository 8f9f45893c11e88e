"""``tally simulate``: its command line. The run itself (``tally.cli.simulate_run``) brings
torch, scikit-learn and the algorithms; `--help` and a mistyped option need none of them."""

from __future__ import annotations

import argparse
from pathlib import Path

from tally.cli.argtypes import FRACTION, POSITIVE, installed_algorithm, integer, number

ADAPTATIONS = ("finetune", "freeze_base", "ewc", "distill")
# The datasets of tally.sim.scenarios.BUILDERS (a test keeps the two equal).
DATASETS = ("digits", "toy-regression", "domain-digits", "heterogeneous-digits", "domain-linear",
            "pathological-digits", "rotated-digits")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("simulate", help="run an algorithm in process (no network) and write metrics as JSON")
    p.add_argument("--algorithm", type=installed_algorithm, default="fedavg",
                   help="an installed algorithm to run (`tally algorithms list`)")
    p.add_argument("--dataset", choices=DATASETS, default="digits", help="bundled or generated data")
    p.add_argument("--clients", type=integer(2), default=50, help="devices in the population")
    p.add_argument("--cohort", type=integer(2), default=None, help="devices per round (default: all)")
    p.add_argument("--rounds", type=integer(1), default=20, help="rounds to run")
    p.add_argument("--domains", type=integer(1), default=4, help="domains (domain datasets)")
    p.add_argument("--alpha", type=POSITIVE, default=0.5, help="Dirichlet skew (smaller: more skew)")
    p.add_argument("--samples", type=integer(1), default=100, help="samples per client (generated datasets)")
    p.add_argument("--noise", type=number(0.0), default=None, help="noise (dataset default when omitted)")
    p.add_argument("--partition", choices=("client", "data"), default=None, help="domain partition type")
    p.add_argument("--seed", type=integer(0), default=0, help="seed of the data split, training and dropouts")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--secure", dest="secure", action="store_true", default=True, help="real secure sums (default)")
    mode.add_argument("--plain", dest="secure", action="store_false", help="plain float sums (baseline)")
    p.add_argument("--dropout", type=FRACTION, default=0.0,
                   help="fraction of each cohort dropping (secure mode), in [0, 1)")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE", help="algorithm option (JSON value)")
    p.add_argument("--reveal", action="append", default=[], metavar="NAME",
                   help="opt in to revealing a per-device value (only aaggff_s: response)")
    p.add_argument("--json", type=Path, required=True, help="where to write the metrics")
    p.add_argument("--report", type=Path, default=None, help="also write per-round JSON and PNG plots here")
    p.add_argument("--baseline", default="fedavg",
                   type=lambda text: text if text == "none" else installed_algorithm(text),
                   help="installed algorithm the report compares against ('none': no baseline)")
    p.add_argument("--classes-per-device", type=integer(1), default=2,
                   help="classes each device holds (pathological-digits, rotated-digits)")
    p.add_argument("--adapt", action="append", default=[], choices=ADAPTATIONS, metavar="METHOD",
                   help="after the run, adapt each device's model locally and report who gains from federated "
                        f"learning (repeatable; one of {', '.join(ADAPTATIONS)}; personal datasets)")
    p.add_argument("--adapt-epochs", type=integer(1), default=10, help="epochs of local adaptation")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from tally.cli import simulate_run

    return simulate_run.run(args)
