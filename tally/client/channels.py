"""grpc.aio channels with the deployment's TLS settings, one per target per process.

A fleet of simulated devices shares one channel per coordinator or aggregator address: HTTP/2
multiplexes their calls, and a thousand devices do not open a thousand connections.
"""

from __future__ import annotations

import grpc

from tally.security import TLSConfig, channel_options
from tally.security.tls import ChannelOptions, open_aio_channel


def reconnect_options(initial_seconds: float, max_seconds: float) -> list[tuple[str, int]]:
    """gRPC's own reconnect backoff (default: up to 2 minutes) bounded by the device's retry
    policy, so a device notices a restarted server as soon as its next retry."""
    initial, ceiling = max(1, int(initial_seconds * 1000)), max(1, int(max_seconds * 1000))
    return [
        ("grpc.initial_reconnect_backoff_ms", initial),
        ("grpc.min_reconnect_backoff_ms", initial),
        ("grpc.max_reconnect_backoff_ms", ceiling),
    ]


class Channels:
    """Channels opened on first use and kept until ``close`` (after which they reopen on use)."""

    def __init__(
        self,
        tls: TLSConfig,
        max_message_bytes: int | None = None,
        extra_options: ChannelOptions = (),
    ) -> None:
        self.tls = tls
        base = channel_options() if max_message_bytes is None else channel_options(max_message_bytes)
        self._options = [*base, *extra_options]
        self._open: dict[str, grpc.aio.Channel] = {}

    def get(self, target: str) -> grpc.aio.Channel:
        channel = self._open.get(target)
        if channel is None:
            channel = self._open[target] = open_aio_channel(target, self.tls, self._options)
        return channel

    async def close(self) -> None:
        channels, self._open = list(self._open.values()), {}
        for channel in channels:
            await channel.close()
