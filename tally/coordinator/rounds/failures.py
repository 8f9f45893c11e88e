"""How a round attempt or a whole job ends early: the round loop, the cohort sessions, the step
answers and the checkpoints all raise these, and only the round loop (``tally.coordinator.rounds.runner``)
catches them, so they live below all four."""

from __future__ import annotations


class AttemptFailed(Exception):
    """The current attempt is discarded; the round may be retried."""


class JobFailed(Exception):
    """The job cannot go on; the message says why."""
