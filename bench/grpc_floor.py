"""The CPU a bare gRPC asyncio server spends on one aggregator's messages of one round.

Issue 8 asks an aggregator's CPU per round to be within 1.5x of the secure-sum engine's time for
the same cohort, "the rest being gRPC and decoding". This measures the gRPC part on its own: a
server whose handler does nothing but read and write raw bytes (no protobuf, no protocol, no
session) in the message pattern of a secure-aggregation session, one bidirectional stream per
device, over TLS with client certificates as the aggregator runs. Whatever the engine costs, an
aggregator written on gRPC's asyncio API cannot spend less than this floor per round.

    .venv/bin/python bench/grpc_floor.py --streams 275 --dim 99985 --k 48 --json out.json

The server runs in its own process; its CPU (user + system) is read with psutil around each
round, and the median over rounds is reported with the per-message cost.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import psutil

METHOD = "/tally.bench.Floor/Session"


@dataclass(frozen=True)
class Pattern:
    """Bytes of each message of one device's session, in order, and after which device message
    the server answers with which of its own (the secure session's turn-taking)."""

    device: tuple[int, ...]
    server: tuple[int, ...]
    replies: tuple[tuple[int, ...], ...]  # replies[i]: the server messages sent after device message i

    @classmethod
    def secure_session(cls, devices: int, dim: int, k: int, bits: int = 29) -> Pattern:
        """Join, AdvertiseKeys, ShareKeysResponse, MaskedInput, Unmask from the device; Joined,
        ShareKeysRequest, ShareDelivery + MaskedInputRequest, UnmaskRequest, SessionDone back.
        Sizes follow the wire format's: 32-byte keys and commitments, 64-byte signatures,
        ~100-byte encrypted shares, the masked vector packed at ``bits`` bits a value."""
        share, keys = 100, 3 * 32 + 16
        device = (600, keys + 80, k * share + 40, (dim * bits + 7) // 8 + 40, k * 44 + 40)
        server = (60, k * (keys + 72) + 40, k * share + 40, 40, 4 * devices + 64 * k + 40, 40)
        return cls(device, server, ((0,), (), (1,), (2, 3), (4, 5)))


def _credentials(directory: Path) -> tuple[grpc.ServerCredentials, grpc.ChannelCredentials]:
    """The aggregator's and a device's credentials from a ``tally certs`` deployment, as the device
    port runs: server-authenticated TLS, the device holding the CA only."""
    read = lambda name: (directory / name).read_bytes()  # noqa: E731
    server = grpc.ssl_server_credentials(
        [(read("aggregator-1/aggregator.key"), read("aggregator-1/aggregator.pem"))])
    channel = grpc.ssl_channel_credentials(root_certificates=read("device/ca.pem"))
    return server, channel


OPTIONS = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]


async def _serve(pattern: Pattern, tls_dir: Path | None, port_file: Path) -> None:
    payloads = [b"\x00" * size for size in pattern.server]

    async def session(request_iterator, context: grpc.aio.ServicerContext) -> None:
        turn = 0
        async for _ in request_iterator:
            for reply in pattern.replies[turn]:
                await context.write(payloads[reply])
            turn += 1
            if turn == len(pattern.replies):
                return

    server = grpc.aio.server(options=OPTIONS)
    handler = grpc.stream_stream_rpc_method_handler(session)
    service, method = METHOD.rsplit("/", 1)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.strip("/"), {method: handler}),))
    address = "127.0.0.1:0"
    port = server.add_secure_port(address, _credentials(tls_dir)[0]) if tls_dir else server.add_insecure_port(address)
    await server.start()
    port_file.write_text(str(port))
    await server.wait_for_termination()


async def _round(target: str, credentials: grpc.ChannelCredentials | None, pattern: Pattern, streams: int) -> None:
    channel = (grpc.aio.secure_channel(target, credentials, options=OPTIONS) if credentials
               else grpc.aio.insecure_channel(target, options=OPTIONS))
    async with channel:
        open_session = channel.stream_stream(METHOD)
        payloads = [b"\x00" * size for size in pattern.device]

        async def device() -> None:
            call = open_session()
            for payload, replies in zip(payloads, pattern.replies, strict=True):
                await call.write(payload)
                for _ in replies:
                    await call.read()
            await call.done_writing()
            await call.code()  # the stream has ended on both sides

        await asyncio.gather(*(device() for _ in range(streams)))


def measure(args: argparse.Namespace) -> dict:
    pattern = Pattern.secure_session(args.streams, args.dim, args.k)
    with tempfile.TemporaryDirectory(prefix="tally-grpc-floor-") as tmp:
        tls_dir = Path(tmp) / "certs" if args.tls else None
        if tls_dir:
            from tally.security.certs import write_deployment

            write_deployment(tls_dir, aggregators=1, ips=["127.0.0.1"])
        port_file = Path(tmp) / "port"
        server = subprocess.Popen([sys.executable, __file__, "--serve", str(port_file), "--streams", str(args.streams),
                                   "--dim", str(args.dim), "--k", str(args.k), *(["--tls"] if args.tls else []),
                                   "--tls-dir", str(tls_dir or "")])
        try:
            deadline = time.monotonic() + 60
            while not (port_file.exists() and port_file.read_text()):
                if server.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit("grpc_floor: the server did not start")
                time.sleep(0.05)
            credentials = _credentials(tls_dir)[1] if tls_dir else None
            target = f"127.0.0.1:{port_file.read_text()}"
            process = psutil.Process(server.pid)
            asyncio.run(_round(target, credentials, pattern, args.streams))  # warm-up: connections, TLS
            per_round = []
            for _ in range(args.rounds):
                before = process.cpu_times()
                asyncio.run(_round(target, credentials, pattern, args.streams))
                after = process.cpu_times()
                per_round.append(after.user + after.system - before.user - before.system)
        finally:
            server.kill()
            server.wait()
    messages = args.streams * (len(pattern.device) + len(pattern.server))
    median = statistics.median(per_round)
    return {"streams": args.streams, "dim": args.dim, "k": args.k, "tls": args.tls,
            "messages_per_round": messages,
            "bytes_per_round": args.streams * (sum(pattern.device) + sum(pattern.server)),
            "server_cpu_seconds_per_round": per_round, "server_cpu_seconds_median": median,
            "server_cpu_microseconds_per_message": median / messages * 1e6}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--streams", type=int, default=275, help="devices of one aggregator's cohort")
    p.add_argument("--dim", type=int, default=99_985, help="values per device (the masked input's size)")
    p.add_argument("--k", type=int, default=48, help="neighbours per device (shares per message)")
    p.add_argument("--rounds", type=int, default=5, help="measured rounds (after one warm-up)")
    p.add_argument("--tls", action="store_true", help="TLS with client certificates, as the aggregator runs")
    p.add_argument("--json", type=Path)
    p.add_argument("--serve", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--tls-dir", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve:
        pattern = Pattern.secure_session(args.streams, args.dim, args.k)
        asyncio.run(_serve(pattern, Path(args.tls_dir) if args.tls else None, args.serve))
        return
    result = measure(args)
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
