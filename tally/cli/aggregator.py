"""``tally aggregator``: run one secure-aggregator replica until SIGINT or SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric import ed25519

from tally import logs
from tally.aggregator.memory import limit_malloc_arenas
from tally.aggregator.service import DEFAULT_MAX_REQUEST_BYTES, AggregatorService
from tally.cli.argtypes import add_connection_arguments, add_metrics_arguments, connection_limits
from tally.security import TLSConfig, load_ticket_public_key
from tally.security.certs import COORDINATOR_CN
from tally.security.tls import DEFAULT_MAX_MESSAGE_BYTES, add_tls_arguments, check_listen, tls_config_from_args
from tally.security.tokens import TICKET_PUB_FILE
from tally.shutdown import stop_on_signals


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "aggregator",
        help="run a secure aggregator: secure-sum sessions for cohorts, cohort sums only",
        description=(
            "Serve AggregatorControl (for the coordinator) and SecureAggregation (for devices) on "
            "one gRPC port, with health checking and reflection, and Prometheus metrics with plain "
            "HTTP /healthz and /readyz on another. Sessions must carry a session ticket signed by the "
            "coordinator for this aggregator's --id; nothing is kept between sessions. Stops gracefully on "
            "SIGINT or SIGTERM (running sessions are aborted for their devices)."
        ),
    )
    p.add_argument("--listen", required=True, metavar="HOST:PORT",
                   help="gRPC address to bind (port 0 picks a free port)")
    p.add_argument("--id", required=True, dest="aggregator_id", metavar="NAME",
                   help="this aggregator's name; session tickets must be issued for it")
    p.add_argument("--control-listen", metavar="HOST:PORT",
                   help="serve the coordinator's control API on this address instead of --listen, "
                        "so devices never reach it and a firewall can admit only the coordinator "
                        "(the coordinator's --aggregator then names this address)")
    p.add_argument("--advertise", metavar="HOST:PORT",
                   help="address devices should dial (default: the bound address)")
    p.add_argument("--ticket-public-key", type=Path, metavar="PATH",
                   help="the coordinator's ticket verification key "
                        f"(default: <tls-dir>/{TICKET_PUB_FILE})")
    add_tls_arguments(p, "aggregator", server=True)
    p.add_argument("--controller-cn", default=COORDINATOR_CN, metavar="NAME",
                   help="with --require-client-cert (which needs --control-listen: devices present "
                        "no certificate), the only certificate CN admitted to AggregatorControl "
                        "(default: %(default)s)")
    add_metrics_arguments(p, "aggregator")
    p.add_argument("--max-message-bytes", type=int, default=DEFAULT_MAX_MESSAGE_BYTES,
                   help="largest gRPC message sent (default: %(default)s)")
    p.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                   help="largest gRPC message received (a device stream's only after its Join "
                        "was checked); raise it only for cohorts above ~40,000 devices (default: %(default)s)")
    add_connection_arguments(p)
    p.add_argument("--result-ttl", type=float, default=600.0, metavar="SECONDS",
                   help="drop a finished session's sums after this long if nobody closes it "
                        "(default: %(default)s)")
    p.add_argument("--grace", type=float, default=5.0, metavar="SECONDS",
                   help="how long RPCs in flight may finish at shutdown (default: %(default)s)")
    p.add_argument("--log-level", default="info", help="log level (default: %(default)s)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    limit_malloc_arenas()
    logs.configure(args.log_level)
    try:
        tls = tls_config_from_args(args)
        if tls.require_client_auth and args.control_listen is None:
            raise ValueError("--require-client-cert needs --control-listen: only the coordinator presents a "
                             "certificate (devices are authenticated by their Join), so the control API needs "
                             "a port of its own")
        for address in (args.listen, args.control_listen):
            if address is not None:
                check_listen(address, tls)
    except ValueError as exc:
        print(f"tally aggregator: {exc}", file=sys.stderr)
        return 2
    key_flag = "--ticket-public-key" if args.ticket_public_key else "--tls-dir"
    key_path = args.ticket_public_key or (args.tls_dir / TICKET_PUB_FILE if args.tls_dir else None)
    if key_path is None:
        print("tally aggregator: --ticket-public-key is required without --tls-dir",
              file=sys.stderr)
        return 2
    try:
        public_key = load_ticket_public_key(key_path)
    except OSError as exc:
        print(f"tally aggregator: {key_flag}: cannot read the coordinator's ticket key {key_path}: "
              f"{exc.strerror}", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"tally aggregator: {key_flag}: {exc}", file=sys.stderr)
        return 2
    return asyncio.run(_serve(args, tls, public_key))


async def _serve(
    args: argparse.Namespace, tls: TLSConfig, public_key: ed25519.Ed25519PublicKey
) -> int:
    service = AggregatorService(
        args.listen, tls, public_key, args.aggregator_id,
        advertised_address=args.advertise,
        metrics_port=args.metrics_port,
        metrics_addr=args.metrics_addr,
        max_message_bytes=args.max_message_bytes,
        max_request_bytes=args.max_request_bytes,
        result_ttl_s=args.result_ttl,
        controller=args.controller_cn,
        control_listen=args.control_listen,
        connection_limits=connection_limits(args),
    )
    try:
        await service.start()
    except (OSError, RuntimeError, ValueError) as exc:
        print(f"tally aggregator: {exc}", file=sys.stderr)
        return 1
    stop = stop_on_signals()
    control = "" if args.control_listen is None else f", control API on port {service.control_port}"
    print(f"aggregator {service.id} serving on {service.address} (port {service.port}{control}); "
          f"metrics on http://{args.metrics_addr}:{service.metrics_port}/metrics", flush=True)
    await stop.wait()
    await service.stop(args.grace)
    return 0
