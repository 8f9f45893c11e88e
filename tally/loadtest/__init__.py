"""The load tester: fleets of simulated devices in one or several processes, their behaviours
(dropout plans, traits, timelines), synthetic updates and the audit of every cohort sum.

It drives real SDK ``Device`` objects through the SDK's one seam (``tally.client.DeviceHooks``), so
what it measures is the product's path; an edge application embedding the SDK never imports it."""

from __future__ import annotations

import importlib
from typing import Any

# Imported on first use (PEP 562), as tally.client does: `tally fleet --help` stays fast.
_EXPORTS = {"DropoutPlan": "tally.loadtest.dropout", "Fleet": "tally.loadtest.fleet",
            "FleetStats": "tally.loadtest.fleet"}


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'tally.loadtest' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)


__all__ = ["DropoutPlan", "Fleet", "FleetStats"]
