"""The vocabulary of ``TaskReport.reason``, shared by the devices that send it and the coordinator
that counts it: a fixed set keeps the per-round counts and the metric's labels bounded, whatever a
device sends."""

from __future__ import annotations

REASONS = frozenset({
    "", "invalid_task", "policy", "already_sent_input", "model_mismatch", "training_error",
    "download_failed", "session_aborted", "dropped", "privacy_floor", "metric_unavailable",
    # The task names an algorithm the device does not have at the coordinator's version.
    "algorithm_version",
    # The task names a model kind the device does not have at the coordinator's version, or an
    # algorithm that needs a trainer capability the device does not offer.
    "model_version", "trainer_capability",
    "privacy_budget_spent",
})
# The reasons of tasks a device declined by its own rules, before or instead of sending an input
# (the others are failures: a download, training or session that went wrong).
REFUSALS = frozenset({
    "invalid_task", "policy", "already_sent_input", "algorithm_version", "privacy_floor", "privacy_budget_spent",
})
# The most reports one check-in may carry.
MAX_REPORTS = 16
# The most jobs one check-in's input ledger statement may name (the most recently updated).
MAX_LEDGER_JOBS = 16
# The longest input ledger id a check-in may state (the SDK draws 32 hex characters).
MAX_LEDGER_ID_CHARS = 64
# The longest job id a check-in's privacy_budget_spent may name.
MAX_JOB_ID_CHARS = 256


def reason_label(reason: str) -> str:
    """``reason`` when it is one of ``REASONS``, else "other"."""
    return reason if reason in REASONS else "other"
