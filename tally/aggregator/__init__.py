"""The secure-aggregator service: runs secure-sum sessions for cohorts and hands back only their
sums. Stateless between sessions; run as many replicas as the fleet needs."""

from tally.aggregator.service import AggregatorService

__all__ = ["AggregatorService"]
