"""``tally-probe``: ask a Tally service for its gRPC health over the same TLS its clients use.

Kubernetes' built-in gRPC probe speaks plaintext only and every Tally port is TLS, so images and
manifests run this instead (an ``exec`` probe, and the images' HEALTHCHECK). It imports grpc and
the TLS helpers only, so it starts fast in every image, the aggregator's included.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tally.security.tls import add_tls_arguments, open_channel, tls_config_from_args


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tally-probe",
        description="Exit 0 when the gRPC health service at ADDRESS answers SERVING for --service, "
        "1 otherwise (with the reason on stderr), 2 on bad arguments.",
    )
    p.add_argument("address", metavar="HOST:PORT", help="the service to ask, usually 127.0.0.1:PORT")
    p.add_argument("--service", default="", help="health service name ('' : the whole server)")
    p.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer")
    p.add_argument(
        "--identity", dest="tls_identity", metavar="NAME",
        help="present <tls-dir>/NAME.pem and NAME.key as a client certificate (servers that demand "
        "mutual TLS)",
    )
    add_tls_arguments(p, None)
    return p


def check(address: str, args: argparse.Namespace) -> str | None:
    """None when SERVING, else why not."""
    with open_channel(address, tls_config_from_args(args)) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout
            )
        except grpc.RpcError as exc:
            return f"{exc.code().name}: {exc.details()}"
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return None


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        problem = check(args.address, args)
    except ValueError as exc:
        print(f"tally-probe: {exc}", file=sys.stderr)
        return 2
    if problem is not None:
        print(f"tally-probe: {args.address} {args.service or '(server)'}: {problem}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
