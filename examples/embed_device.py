"""Embedding a Tally device in an application, as written (a test runs this file).

The application supplies what only it has: its data and a training loop (here a shard of
scikit-learn's digits and the SDK's TorchTrainer; a real app plugs in its own LocalTrainer). The
SDK does the rest: registration with an enrolment credential, check-ins paced by the coordinator,
model download, training (cuda when present), the secure sum, and ONNX inference afterwards
without torch.

    tally enrol --key deploy/certs/coordinator/enrolment.key phone-17      # once, by the operator
    python examples/embed_device.py --coordinator localhost:7000 --tls-dir deploy/certs/device \\
        --device-id phone-17 --credential <hex> --state-dir ~/.tally/phone-17
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

import numpy as np

from tally.client import Device, OnnxModel
from tally.client.enrolment import load_or_create_identity
from tally.datasets.digits import digits
from tally.models.mlp import mlp
from tally.security import TLSConfig
from tally.training import TorchTrainer


def application_trainer(shard: int, shards: int, hidden: int) -> tuple[TorchTrainer, np.ndarray]:
    """The app's data and model (must be the job's model), and a few inputs to predict on later."""
    split = digits(shards, alpha=0.5, seed=0)
    features, labels = split.clients[shard]
    trainer = TorchTrainer(lambda: mlp(split.num_features, split.num_classes, hidden=hidden, seed=0),
                           features, labels)
    return trainer, features[:5].astype(np.float32)


async def main(args: argparse.Namespace) -> None:
    tls = TLSConfig.plaintext() if args.insecure else TLSConfig.from_dir(args.tls_dir, None)
    trainer, inputs = application_trainer(args.shard, args.shards, args.hidden)
    device = Device(
        args.coordinator, tls, args.device_id, trainer,
        # The identity key must survive restarts: the coordinator binds the device id to it.
        identity=load_or_create_identity(args.state_dir / "identity.key"),
        enrolment_credential=bytes.fromhex(args.credential),
        # The input ledger (one masked input per round, across restarts) and per-job local state.
        state_dir=args.state_dir,
        cache_dir=args.state_dir / "models",
    )
    stats = await device.run(max_tasks=args.tasks)
    print(f"{stats.tasks_done} task(s), {stats.sessions_completed} secure sum(s) completed, "
          f"rounds contributed: {stats.contributed}")
    model = OnnxModel.from_bytes(await device.fetch_onnx("latest"))
    print("predictions of the latest global model:", model.logits(inputs).argmax(axis=1).tolist())


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--coordinator", required=True, help="coordinator host:port")
    parser.add_argument("--tls-dir", type=Path, help="the device directory of `tally certs`")
    parser.add_argument("--insecure", action="store_true", help="plaintext (loopback only)")
    parser.add_argument("--device-id", required=True, help="this device's id, as enrolled")
    parser.add_argument("--credential", required=True, help="hex credential from `tally enrol`")
    parser.add_argument("--state-dir", type=Path, required=True,
                        help="identity key, input ledger, local state and model cache")
    parser.add_argument("--shard", type=int, default=0, help="which digits shard stands in for the app's data")
    parser.add_argument("--shards", type=int, default=10, help="how many shards the digits are split into")
    parser.add_argument("--hidden", type=int, default=64, help="hidden units of the job's mlp")
    parser.add_argument("--tasks", type=int, default=1, help="tasks to take before stopping")
    arguments = parser.parse_args()
    if not arguments.insecure and arguments.tls_dir is None:
        parser.error("--tls-dir is required (or --insecure on loopback)")
    asyncio.run(main(arguments))
