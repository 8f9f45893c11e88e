"""How likely a valid spec's rounds are to fail on this coordinator's aggregators.

``min_cohort`` binds each aggregator's cohort, not the round: 26 selected devices over two
aggregators are two cohorts of 13, each of which must keep ``max(t, min_cohort)`` devices through
its dropouts, or the attempt fails and the round is retried. A spec cannot see this alone (it
depends on how many aggregators there are), so the coordinator warns at submission.
"""

from __future__ import annotations

from tally.coordinator.rounds.planner import NoCapacity, split_cohorts
from tally.coordinator.spec.jobspec import JobSpec
from tally.secagg import UnsafeParameters, choose_params

# Above this chance that a round's first attempt fails, the operator is told before the job runs.
WARN_FAILURE_PROBABILITY = 0.01


def attempt_failure_probability(spec: JobSpec, aggregators: int) -> tuple[float, list[int], list[int]]:
    """(chance that some cohort keeps too few devices, cohort sizes, survivors each needs), with
    every selected device dropping independently at ``secure.dropout_rate``."""
    plans = split_cohorts(
        [str(i) for i in range(spec.selection_target)], [str(a) for a in range(aggregators)],
        spec.min_cohort, spec.max_cohort_per_aggregator,
    )
    sizes = [len(plan.devices) for plan in plans]
    needs = [spec.min_cohort if spec.secure.plain else max(choose_params(n, spec.secure.threat()).t, spec.min_cohort)
             for n in sizes]
    from scipy.stats import binom  # only with aggregators to split over: `job validate` alone needs no scipy

    keep = 1.0 - spec.secure.dropout_rate
    success = 1.0
    for size, need in zip(sizes, needs):
        success *= float(binom.sf(need - 1, size, keep))  # P(survivors >= need)
    return 1.0 - success, sizes, needs


def cohort_warnings(spec: JobSpec, aggregators: int) -> list[str]:
    """Plain-language warnings for a spec this coordinator accepted; empty when none apply."""
    if aggregators < 1:
        return []
    try:
        failure, sizes, needs = attempt_failure_probability(spec, aggregators)
    except (NoCapacity, UnsafeParameters) as exc:
        return [f"cohorts: {exc}"]
    if failure <= WARN_FAILURE_PROBABILITY:
        return []
    split = "/".join(str(n) for n in sizes)
    return [
        f"min_cohort: {spec.selection_target} selected devices are split {split} over {len(sizes)} "
        f"aggregator cohort(s), each of which must keep {'/'.join(str(n) for n in needs)} devices "
        f"(min_cohort {spec.min_cohort} applies per aggregator) with secure.dropout_rate "
        f"{spec.secure.dropout_rate:g}: about {failure:.0%} of round attempts will fail and be retried; "
        "raise cohort_size or over_selection, lower min_cohort, or run fewer aggregators"
    ]
