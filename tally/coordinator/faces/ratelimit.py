"""Per-source rate limits on the device-facing calls anyone can make.

``Register`` costs a signature check and a database write, and ``CheckIn`` holds a call open;
both are reachable before (or with) nothing more than a device credential, so one source must not
be able to flood them. A token bucket per source address: ``burst`` calls at once, then ``rate``
per second. Sources are forgotten once their bucket is full again, so the table stays as small as
the set of sources active within ``burst / rate`` seconds, and is capped at ``max_sources``
(beyond it new sources are refused rather than letting the table grow without bound).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class RateLimit:
    rate_per_s: float
    burst: float

    def __post_init__(self) -> None:
        if not self.rate_per_s > 0 or not self.burst >= 1:
            raise ValueError(f"a rate limit needs rate_per_s > 0 and burst >= 1, got {self}")


# Per source address. Generous enough for a simulated fleet on one host; a deployment behind a
# NAT or load balancer that hides device addresses should raise them.
DEFAULT_REGISTER_LIMIT = RateLimit(rate_per_s=50.0, burst=2000.0)
DEFAULT_CHECKIN_LIMIT = RateLimit(rate_per_s=500.0, burst=5000.0)
# Nothing a device or an operator sends the coordinator is large (models travel the other way),
# so requests are capped well below what it sends: an unauthenticated Register cannot make the
# coordinator buffer megabytes.
DEFAULT_MAX_REQUEST_BYTES = 1 << 20


class SourceRateLimiter:
    def __init__(self, limit: RateLimit, clock: Callable[[], float], max_sources: int = 100_000) -> None:
        self.limit, self._clock, self._max = limit, clock, max_sources
        # source -> (tokens, time of last update); least recently seen first.
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()

    def allow(self, source: str) -> bool:
        """Take one token from ``source``'s bucket; False when it is empty."""
        now = self._clock()
        self._forget_full(now)
        if source not in self._buckets and len(self._buckets) >= self._max:
            return False
        tokens, last = self._buckets.pop(source, (self.limit.burst, now))
        tokens = min(self.limit.burst, tokens + (now - last) * self.limit.rate_per_s)
        allowed = tokens >= 1
        self._buckets[source] = (tokens - 1 if allowed else tokens, now)
        return allowed

    def _forget_full(self, now: float) -> None:
        refill_s = self.limit.burst / self.limit.rate_per_s
        while self._buckets:
            source, (_, last) = next(iter(self._buckets.items()))
            if now - last < refill_s:
                return
            del self._buckets[source]
