"""The job spec's ``privacy:`` section: its type, its checks at submit, its resolved settings.

A spec states a noise multiplier or a target epsilon (then the noise multiplier is calibrated
with dp-accounting over the job's rounds). Everything that could stop the job from delivering
the stated privacy is checked here, at submit, with the reason: an unreachable target, a field
DP cannot bound, a cohort too small to carry distributed noise, a ring too narrow.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tally.privacy.accounting import calibrate
from tally.privacy.errors import PrivacyRefused
from tally.privacy.planning import DEFAULT_WRAP_PROBABILITY
from tally.privacy.server import PrivacySettings, PrivateServer


class PrivacySpec(BaseModel):
    """Differential privacy of the released sums (``central``: the coordinator adds Gaussian
    noise; ``distributed``: each device adds its share of discrete Gaussian noise in the ring)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)
    mechanism: Literal["central", "distributed"] = Field(description="who adds the noise")
    clip: float = Field(gt=0, description="L2 bound of one device's payload")
    noise_multiplier: float | None = Field(None, gt=0, description="noise std / clip (or give target_epsilon)")
    target_epsilon: float | None = Field(None, gt=0, description="epsilon the whole job may spend")
    delta: float = Field(1e-5, gt=0, lt=1, description="delta of the (epsilon, delta) guarantee")
    population: int | None = Field(
        None, ge=2, description="devices the cohort is sampled from; claims Poisson amplification "
        "(q = cohort_size / population), which the deployment must make true")
    bits: int | None = Field(None, ge=2, le=64, description="ring width (distributed); default: chosen")
    wrap_probability: float = Field(
        DEFAULT_WRAP_PROBABILITY, gt=0, lt=1, description="chance a noisy cohort sum leaves the ring (refused)")


def _sampling_rate(privacy: PrivacySpec, cohort_size: int) -> float:
    return 1.0 if privacy.population is None else min(1.0, cohort_size / privacy.population)


def settings_for(privacy: PrivacySpec, *, rounds: int, cohort_size: int, min_cohort: int,
                 dropout_rate: float, corrupt_rate: float) -> PrivacySettings:
    """The settings a job runs with; ``PrivacyRefused`` when the spec cannot be met."""
    if (privacy.noise_multiplier is None) == (privacy.target_epsilon is None):
        raise PrivacyRefused("give exactly one of noise_multiplier and target_epsilon")
    if privacy.population is not None and privacy.population < cohort_size:
        raise PrivacyRefused(f"population {privacy.population} is smaller than cohort_size {cohort_size}")
    q = _sampling_rate(privacy, cohort_size)
    z = privacy.noise_multiplier
    if z is None:
        z = calibrate(privacy.target_epsilon, privacy.delta, rounds, q)
    return PrivacySettings(
        privacy.mechanism, privacy.clip, z, privacy.delta, cohort_size, dropout_rate, corrupt_rate,
        min_cohort, q, privacy.bits, privacy.wrap_probability, privacy.target_epsilon, rounds,
    )


def _job(secure: Any, rounds: int, cohort_size: int, min_cohort: int) -> dict[str, Any]:
    return {"rounds": rounds, "cohort_size": cohort_size, "min_cohort": min_cohort,
            "dropout_rate": secure.dropout_rate, "corrupt_rate": secure.corrupt_rate}


def private_job_server(server: Any, spec: Any, rounds: int | None = None) -> Any:
    """A job's server half, wrapped with its ``privacy:`` section when it has one. ``rounds``: all
    the job's rounds when some only evaluate (each then counts as a training round's sums when a
    target epsilon is calibrated: never fewer releases than it makes, so the target holds)."""
    if spec.privacy is None:
        return server
    job = _job(spec.secure, spec.rounds if rounds is None else rounds, spec.cohort_size, spec.min_cohort)
    return PrivateServer(server, spec.algorithm, settings_for(spec.privacy, **job))


def job_problems(privacy: PrivacySpec, *, algorithm: str, make_server: Callable[[], Any],
                 initial: Callable[[], Any], secure: Any, rounds: int, cohort_size: int,
                 min_cohort: int) -> list[str]:
    """Why a job's privacy section cannot be honoured (empty when it can), one line each.
    ``make_server``/``initial`` build the algorithm's server half and first model; their own
    errors are the job spec's other checks to report."""
    if secure.plain:
        return ["privacy: secure.plain shows every device's payload to the aggregator; DP of the sum "
                "means nothing there"]
    try:
        server, params = make_server(), initial()
    except (TypeError, ValueError):
        return []
    try:
        wrapped = PrivateServer(server, algorithm, settings_for(
            privacy, **_job(secure, rounds, cohort_size, min_cohort)))
        wrapped.steps(wrapped.init(params))  # lays out and plans every step
    except ValueError as exc:  # PrivacyRefused, or the codec refusing a ring wider than 64 bits
        return [f"privacy: {exc}"]
    return []
