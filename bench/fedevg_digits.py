"""FedEvg on scikit-learn's 8x8 digits: devices split by Dirichlet(alpha) labels, the
synthetic set refined through the secure sum, then a classifier trained only on the synthetic
set is scored on real held-out digits (the thesis' utility measure, Tables 4.2-4.3).

    .venv/bin/python bench/fedevg_digits.py --rounds 200 --alpha 0.1 --json bench/results/fedevg_digits.json
"""

from __future__ import annotations

import argparse
import json
import time
from functools import partial
from pathlib import Path

from tally.algorithms.fedevg import SYNTHETIC_X, SYNTHETIC_Y, FedEvgClient, FedEvgOptions, FedEvgServer
from tally.datasets.digits import digits
from tally.models.energy import energy_mlp
from tally.models.params import get_params
from tally.secagg import ThreatModel
from tally.sim.rounds import SecureSum, plain_sum, run_rounds
from tally.training import single_threaded
from tally.training.energy import EnergyTrainer, export_synthetic, synthetic_classifier_accuracy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=200, help="T")
    parser.add_argument("--clients", type=int, default=10, help="K (all take part every round)")
    parser.add_argument("--alpha", type=float, default=0.1, help="Dirichlet label skew")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="one run per seed")
    parser.add_argument("--step", type=float, default=1.0, help="server SGLD step at round 0 (beta_0)")
    parser.add_argument("--plain", action="store_true", help="exact float sums instead of the secure sum")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--export", type=Path, help="write the last run's synthetic set (npz, PNG) here")
    args = parser.parse_args()
    single_threaded()
    runs = []
    for seed in args.seeds:
        fed = digits(args.clients, alpha=args.alpha, seed=seed)
        options = FedEvgOptions(classes=10, inputs=64, per_class=10, step_start=args.step, step_end=0.01,
                              schedule_rounds=args.rounds, noise=0.01, input_range=(0.0, 1.0),
                              local_iterations=20, local_lr=1e-3, batch_size=64, sgld_step=1.0,
                              sgld_noise=0.01, synthetic_weight=0.1, seed=seed)
        factory = partial(energy_mlp, 64, 10, 128, seed)
        devices = [EnergyTrainer(factory, X, y, seed=100 * seed + i) for i, (X, y) in enumerate(fed.clients)]
        sum_fn = plain_sum if args.plain else SecureSum(ThreatModel(dropout_rate=0.1, corrupt_rate=0.05), seed=seed)
        start = time.perf_counter()
        state, _ = run_rounds(FedEvgServer(options), FedEvgClient(options), devices, get_params(factory()),
                              args.rounds, args.clients, sum_fn, seed=seed)
        accuracy = synthetic_classifier_accuracy(state.synthetic, *fed.test)
        runs.append({"seed": seed, "accuracy": accuracy, "seconds": time.perf_counter() - start})
        print(f"seed {seed}: synthetic-only classifier {accuracy:.3f} on real held-out digits "
              f"({runs[-1]['seconds']:.0f} s)", flush=True)
        if args.export:
            export_synthetic(state.synthetic, args.export, image_side=8)
    result = {"rounds": args.rounds, "clients": args.clients, "alpha": args.alpha, "secure": not args.plain,
              "step_start": args.step,
              "samples": int(state.synthetic[SYNTHETIC_Y].size),
              "upload_values": int(state.synthetic[SYNTHETIC_X].size + state.synthetic[SYNTHETIC_Y].size),
              "runs": runs}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
