"""What a device stream may cost before it has joined a session.

Until its Join is checked (session ticket and token), a stream is anyone holding a device
certificate. Such a stream may send one message, a Join of at most ``MAX_JOIN_BYTES``: a larger
first message is refused unparsed, so it costs the bytes gRPC read and nothing more. It must come
within the Join deadline, and a source (one address) and the aggregator as a whole hold at most so
many unjoined streams: the next one is refused at once, before anything is read. Each refusal has
its own reason in ``tally_aggregator_rejected_total``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from prometheus_client import Gauge

from aggregator.errors import Rejected

# A Join holds a session ticket (a few hundred bytes), a device index and a 32-byte token.
MAX_JOIN_BYTES = 16 << 10


@dataclass(frozen=True)
class StreamLimits:
    """``join_timeout_s``: how long a stream may stay open without a Join. ``per_source`` and
    ``total``: unjoined streams at once. A fleet process multiplexes its devices over one
    connection and a cohort's devices join at once, so ``per_source`` must exceed a shard's
    largest cohort."""

    join_timeout_s: float = 10.0
    per_source: int = 2048
    total: int = 8192

    def __post_init__(self) -> None:
        if not self.join_timeout_s > 0:
            raise ValueError(f"join timeout must be > 0 seconds, got {self.join_timeout_s}")
        if not 1 <= self.per_source <= self.total:
            raise ValueError(f"unjoined streams per source ({self.per_source}) must lie in 1..total ({self.total})")


class UnjoinedStreams:
    """Counts the streams that have not joined yet, per source and in all; ``gauge`` shows the total."""

    def __init__(self, limits: StreamLimits, gauge: Gauge | None = None) -> None:
        self.limits = limits
        self._by_source: Counter[str] = Counter()
        self._total = 0
        self._gauge = gauge

    def admit(self, source: str) -> None:
        limits = self.limits
        if self._total >= limits.total:
            raise Rejected("RESOURCE_EXHAUSTED", f"the aggregator already holds {limits.total} streams that "
                           "have not joined a session; retry later", "too_many_unjoined")
        if self._by_source[source] >= limits.per_source:
            raise Rejected("RESOURCE_EXHAUSTED", f"{source} already holds {limits.per_source} streams that have "
                           "not joined a session; retry later", "too_many_unjoined_from_source")
        self._by_source[source] += 1
        self._set(self._total + 1)

    def release(self, source: str) -> None:
        self._set(self._total - 1)
        self._by_source[source] -= 1
        if not self._by_source[source]:
            del self._by_source[source]

    @property
    def open(self) -> int:
        return self._total

    def _set(self, total: int) -> None:
        self._total = total
        if self._gauge is not None:
            self._gauge.set(total)
