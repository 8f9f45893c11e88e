"""``tally certs``: create a deployment's CA and one directory of certificates and keys per role."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tally.security import certs


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "certs",
        help="create a CA and per-role TLS certificates and keys for a deployment",
        description=(
            "Create a private CA (ECDSA P-256) and one directory per role: coordinator/ (its "
            "certificate, for serving and for mutual TLS toward aggregators, the session-ticket key "
            "pair, the device-token secret and the enrolment key), aggregator-<i>/ (each aggregator "
            "its own certificate and ticket.pub), device/ (a client certificate for devices) and "
            "ca/ (the CA key). Server certificates cover localhost, 127.0.0.1, ::1 and the "
            "Kubernetes service names tally-<role>[.<namespace>[.svc[.cluster.local]]] plus anything "
            "given with --dns/--ip. Keys are written 0600, directories 0700. Existing files are "
            "never replaced unless --force is given."
        ),
        epilog=(
            "Give each machine only its directory: --tls-dir OUT/coordinator, OUT/aggregator-<i>, "
            "OUT/device. Keep OUT/ca offline."
        ),
    )
    p.add_argument("--out", type=Path, required=True, help="directory to write the PEM files into")
    p.add_argument(
        "--namespace", default=certs.DEFAULT_NAMESPACE,
        help="Kubernetes namespace used in the service DNS names (default: %(default)s)",
    )
    p.add_argument(
        "--dns", action="append", default=[], metavar="NAME",
        help="extra DNS name for both server certificates (repeatable)",
    )
    p.add_argument(
        "--ip", action="append", default=[], metavar="IP",
        help="extra IP address for both server certificates (repeatable)",
    )
    p.add_argument(
        "--days", type=_positive_int, default=certs.DEFAULT_DAYS,
        help="validity in days (default: %(default)s)",
    )
    p.add_argument(
        "--aggregators", type=_positive_int, default=1,
        help="how many aggregator identities to create (default: %(default)s)",
    )
    p.add_argument("--force", action="store_true", help="replace existing files")
    p.add_argument(
        "--k8s-secrets", type=Path, metavar="DIR",
        help="also write Kubernetes Secret manifests for --namespace into DIR: tls.yaml (the "
        "certificates; leave it out when cert-manager issues them) and keys.yaml (the "
        "coordinator's keys, ticket.pub for aggregators, enrolment.key for simulated fleets)",
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    try:
        deployment = certs.write_deployment(
            args.out, aggregators=args.aggregators, namespace=args.namespace, dns=args.dns,
            ips=args.ip, days=args.days, force=args.force,
        )
    except certs.CertificateError as exc:
        print(f"tally certs: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {len(deployment.files)} files to {deployment.directory}")
    for name, path in deployment.files.items():
        mode = path.stat().st_mode & 0o777
        print(f"  {name:<32} {mode:04o}")
    for role, names in deployment.server_names.items():
        print(f"{role} certificate covers: {', '.join(names)}")
    if deployment.not_after is not None:
        print(f"valid until {deployment.not_after:%Y-%m-%d %H:%M} UTC")
    if args.k8s_secrets is not None:
        from tally.ops.k8s_secrets import write_secret_manifests

        for path in write_secret_manifests(deployment.directory, args.k8s_secrets, args.namespace):
            print(f"Kubernetes Secrets for namespace {args.namespace}: {path}")
    return 0


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value
