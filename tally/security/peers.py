"""Who is on the other end of a gRPC call, as far as limits per source are concerned."""

from __future__ import annotations


def source_of(peer: str) -> str:
    """The address part of a gRPC peer string (``ipv4:10.0.0.1:5000`` -> ``ipv4:10.0.0.1``):
    a source's many connections share one bucket."""
    kind, _, rest = peer.partition(":")
    if kind in ("ipv4", "ipv6"):
        return f"{kind}:{rest.rsplit(':', 1)[0]}"
    return peer
