"""What the exit status of ``tally client`` and ``tally fleet`` means, and the one line that says
why. A load test in CI passed while every device failed: the fleet printed its counts and exited
0 against a FAILED job, and against a coordinator that never seated a device (issue 39). A
device's command now ends non-zero when a job it served failed or no task ever came."""

from __future__ import annotations

from collections.abc import Mapping

OK = 0
UNREACHABLE = 1
USAGE = 2
AUDIT_MISMATCH = 3
JOB_FAILED = 4
NO_TASK = 5

MEANINGS = {
    OK: "the devices served their jobs and none of them failed",
    UNREACHABLE: "no device reached the coordinator within --connect-timeout, or the coordinator refused "
                 "the devices for a reason retrying cannot fix",
    USAGE: "a flag or a file it names is wrong",
    AUDIT_MISMATCH: "(fleet, --audit-token-file) a committed sum does not match the inputs the devices sent",
    JOB_FAILED: "a job the devices had tasks of ended FAILED (the last line names it and the devices' "
                "commonest failure reasons)",
    NO_TASK: "no device was ever given a task: within --task-timeout, or (a whole fleet) before the "
             "jobs of its population ended",
}

# Failure reasons named in the closing line, most frequent first.
TOP_REASONS = 3


def epilog() -> str:
    """The exit codes, for a command's ``--help``."""
    return "exit status:\n" + "\n".join(f"  {code}  {meaning}" for code, meaning in MEANINGS.items())


def failed_jobs(job_states: Mapping[str, str], failures: Mapping[str, Mapping[str, int]]) -> str:
    """One line per FAILED job: ``job J FAILED: model_mismatch x29, training_error x3`` (the
    reasons are the devices' own, for their tasks of that job); "" when no job failed."""
    lines = []
    for job, state in job_states.items():
        if state != "FAILED":
            continue
        reasons = sorted(failures.get(job, {}).items(), key=lambda item: (-item[1], item[0]))[:TOP_REASONS]
        why = ", ".join(f"{reason} x{count}" for reason, count in reasons) or "the devices reported no failed task"
        lines.append(f"job {job} FAILED: {why} (`tally job status {job}` says why the coordinator stopped it)")
    return "\n".join(lines)
