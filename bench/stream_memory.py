"""What unauthenticated device streams cost a real aggregator: memory and open streams.

Anyone who reaches the aggregator's device port (devices hold no certificate: each stream is
authenticated by the Join in its metadata) opens session streams without a Join:

- ``oversized``: each stream sends one ``--size``-byte message, ``--batch`` streams at a time,
  ``--messages`` in all. The aggregator's resident memory (VmRSS of its process, sampled every
  20 ms) is reported before, at its peak, when the last stream has ended and ``--settle`` seconds
  later, with the peak's growth per message in flight.
- ``idle``: ``--idle`` streams open and send nothing. Reported: how many the aggregator still holds
  open ``--wait`` seconds later, and how each one ended.

The aggregator is the ``tally aggregator`` command in its own process over TLS, as deployed (the
control API on its own mutual-TLS port), started by ``ProcessCluster`` with no coordinator.
Writes JSON (``--json``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc

from tally.ops.cluster import ProcessCluster
from tally.security import TLSConfig
from tally.security.tls import open_aio_channel
from tally.wire.v1 import secagg_pb2

METHOD = "/tally.v1.SecureAggregation/Session"


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


class Sampler(threading.Thread):
    """Peak VmRSS of a process since the last ``reset``."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid, self.peak, self._stop = pid, 0, threading.Event()

    def run(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, _rss(self.pid))

    def reset(self) -> None:
        self.peak = _rss(self.pid)

    def stop(self) -> None:
        self._stop.set()


async def _one_stream(channel: grpc.aio.Channel, payload: bytes | None) -> str:
    """Open a stream, send ``payload`` (or nothing), wait for the aggregator to end it."""
    call = channel.stream_stream(METHOD)()
    try:
        if payload is not None:
            await call.write(payload)  # fails once the aggregator has refused the stream
        async for _ in call:
            pass
    except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
        return (await call.code()).name
    return "OK"


def _message(size: int) -> bytes:
    """A well-formed device message of at most ``size`` bytes."""
    message = secagg_pb2.DeviceToAggregator(masked_input_response=secagg_pb2.MaskedInputResponse(
        sum_id="x", sender=1, data=b"\1" * (size - 32)))
    return message.SerializeToString()


async def oversized(target: str, tls: TLSConfig, args, sampler: Sampler, pid: int) -> dict:
    payload = _message(args.size - 64)
    options = [("grpc.max_send_message_length", 64 << 20)]
    before = _rss(pid)
    sampler.reset()
    statuses: dict[str, int] = {}
    async with open_aio_channel(target, tls, options) as channel:
        for start in range(0, args.messages, args.batch):
            batch = min(args.batch, args.messages - start)
            for status in await asyncio.gather(*(_one_stream(channel, payload) for _ in range(batch))):
                statuses[status] = statuses.get(status, 0) + 1
    ended = _rss(pid)
    peak = sampler.peak
    await asyncio.sleep(args.settle)
    settled = _rss(pid)
    return {
        "messages": args.messages, "batch": args.batch, "message_bytes": len(payload),
        "statuses": statuses, "rss_before_bytes": before, "rss_peak_bytes": peak,
        "rss_after_end_bytes": ended, "rss_after_settle_bytes": settled, "settle_s": args.settle,
        "peak_growth_per_message_in_flight_bytes": (peak - before) / args.batch,
        "retained_after_settle_bytes": settled - before,
    }


async def idle(target: str, tls: TLSConfig, args) -> dict:
    async with open_aio_channel(target, tls) as channel:
        started = time.perf_counter()
        streams = [asyncio.ensure_future(_one_stream(channel, None)) for _ in range(args.idle)]
        done, _ = await asyncio.wait(streams, timeout=args.wait)
        open_after = len(streams) - len(done)
        codes: dict[str, int] = {}
        for task in done:
            codes[task.result()] = codes.get(task.result(), 0) + 1
        for task in streams:
            task.cancel()
        return {"idle_streams": args.idle, "still_open_after_wait": open_after, "wait_s": args.wait,
                "ended_by_status": codes, "waited_s": time.perf_counter() - started}


async def _measure(workdir: Path, args: argparse.Namespace) -> dict:
    async with ProcessCluster(workdir, aggregators=1, replicas=0) as cluster:
        target = f"127.0.0.1:{cluster.ports['aggregator-1']}"
        async with open_aio_channel(target, cluster.tls) as channel:
            await asyncio.wait_for(channel.channel_ready(), 60)
        pid = cluster.processes["aggregator-1"].pid
        assert pid is not None
        sampler = Sampler(pid)
        sampler.start()
        report = {"oversized": await oversized(target, cluster.tls, args, sampler, pid),
                  "idle": await idle(target, cluster.tls, args),
                  "machine": {"cpus": os.cpu_count()}, "date": time.strftime("%Y-%m-%d")}
        sampler.stop()
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--messages", type=int, default=80, help="oversized messages in all")
    p.add_argument("--batch", type=int, default=40, help="streams open at once")
    p.add_argument("--size", type=int, default=4 << 20, help="bytes per message (the aggregator's default limit)")
    p.add_argument("--settle", type=float, default=15.0, help="seconds to wait after the last stream before sampling")
    p.add_argument("--idle", type=int, default=1000, help="streams that never send anything")
    p.add_argument("--wait", type=float, default=2.0, help="seconds after which idle streams still open are counted")
    p.add_argument("--json", type=Path, help="write the results here")
    args = p.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        report = asyncio.run(_measure(Path(tmp), args))
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
