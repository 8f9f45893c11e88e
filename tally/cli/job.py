"""``tally job``: write and check job specs offline (``init``, ``validate``, ``schema``) and operate
a coordinator's jobs through its Admin API (``submit``, ``status``, ``list``, ``cancel``,
``watch``, ``model``, and the model-quality figures per round: ``metrics``, ``plot``; their
formatting is ``tally.cli.quality``). Every command takes ``--json`` for scripts."""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from tally.cli.argtypes import POSITIVE
from tally.coordinator.faces.admin_token import ADMIN_TOKEN_FILE

DEFAULT_ADDRESS = "127.0.0.1:7000"  # where `tally coordinator` listens unless told otherwise (k8s: 7000 too)
# Where an operator's shell says the coordinator is, so that no command repeats it; a flag overrides.
COORDINATOR_ENV, STATE_DIR_ENV, TLS_DIR_ENV = "TALLY_COORDINATOR", "TALLY_STATE_DIR", "TALLY_TLS_DIR"
STATES = ["PENDING", "RUNNING", "SUCCEEDED", "FAILED", "CANCELLED"]


def register(sub: argparse._SubParsersAction) -> None:
    job = sub.add_parser(
        "job", help="write, check, submit, inspect, cancel and watch jobs; fetch trained models",
        description="Job specs offline (init, validate, schema) and a coordinator's jobs through its "
        "Admin API (submit, status, list, cancel, watch, model, metrics, plot).",
    )
    actions = job.add_subparsers(dest="action", required=True, metavar="ACTION")
    output = output_parser()
    client = admin_client_parser(output)

    init = actions.add_parser("init", parents=[output], help="print a commented, valid spec for an algorithm")
    init.add_argument("algorithm", help="an installed algorithm, built in or a package's (`tally algorithms list`)")
    init.set_defaults(run=_offline(_init))
    validate = actions.add_parser("validate", parents=[output], help="check a spec offline (no coordinator)")
    validate.add_argument("spec", type=Path, help="job spec YAML file")
    validate.add_argument(
        "--aggregators", type=int, default=0, metavar="N",
        help="also warn about cohorts split over N aggregators too close to min_cohort (0: skip)",
    )
    validate.set_defaults(run=_offline(_validate))
    schema = actions.add_parser("schema", parents=[output], help="print the job-spec field reference")
    schema.add_argument("--package", metavar="DIST", default=None,
                        help="only the options of this installed algorithm package's algorithms")
    schema.set_defaults(run=_offline(_schema))

    submit = actions.add_parser("submit", parents=[client], help="submit a job spec (YAML)")
    submit.add_argument("spec", type=Path, help="job spec YAML file")
    submit.set_defaults(run=_job(_submit))
    status = actions.add_parser("status", parents=[client], help="show one job")
    status.add_argument("job_id", help="the id `tally job submit` printed")
    status.set_defaults(run=_job(_status))
    listing = actions.add_parser("list", parents=[client], help="list jobs")
    listing.add_argument(
        "--state", action="append", default=[], choices=STATES, help="only jobs in this state (repeatable)",
    )
    listing.set_defaults(run=_job(_list))
    cancel = actions.add_parser("cancel", parents=[client], help="cancel a job")
    cancel.add_argument("job_id", help="the job to cancel")
    cancel.add_argument("--reason", default="", help="recorded with the job")
    cancel.set_defaults(run=_job(_cancel))
    watch = actions.add_parser("watch", parents=[client], help="follow a job until it ends")
    watch.add_argument("job_id", help="the job to follow")
    watch.set_defaults(run=_job(_watch))
    model = actions.add_parser("model", parents=[client], help="download a trained model as ONNX")
    model.add_argument("job_id", help="the job whose model to fetch")
    model.add_argument("--out", type=Path, required=True, help="file to write the ONNX model to")
    model.add_argument("--round", type=int, help="a committed round, 0 for the initial model (default: the latest)")
    model.set_defaults(run=_job(_model))
    metrics = actions.add_parser(
        "metrics", parents=[client], help="each committed round's model quality (the devices' held-out sums)")
    metrics.add_argument("job_id", help="the job whose figures to show")
    metrics.add_argument("--csv", action="store_true", help="print CSV: one row per round, one column per figure")
    metrics.set_defaults(run=_job(_metrics))
    plot = actions.add_parser("plot", parents=[client], help="plot loss and accuracy per round (needs matplotlib)")
    plot.add_argument("job_id", help="the job whose curves to plot")
    plot.add_argument("--out", type=Path, required=True, help="image file to write (PNG, SVG, PDF by suffix)")
    plot.set_defaults(run=_job(_plot))


def _print_json(value: Any) -> None:
    print(json.dumps(value, indent=None, sort_keys=False), flush=True)


# -- offline -------------------------------------------------------------------------------------


def _offline(action: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Spec errors and unreadable files as one message each, never a traceback."""

    def run(args: argparse.Namespace) -> int:
        try:
            return action(args)
        except OSError as exc:
            print(f"tally job {args.action}: {exc.filename}: {exc.strerror}", file=sys.stderr)
            return 2
        except ValueError as exc:
            print(f"tally job {args.action}: {exc}", file=sys.stderr)
            return 2

    return run


def _init(args: argparse.Namespace) -> int:
    import yaml

    from tally.coordinator.spec.jobspec_docs import template

    text = template(args.algorithm)
    if args.json:
        _print_json(yaml.safe_load(text))
    else:
        sys.stdout.write(text)
    return 0


def _validate(args: argparse.Namespace) -> int:
    from tally.coordinator.spec import jobspec

    if args.aggregators < 0:
        raise ValueError(f"--aggregators must be >= 0, got {args.aggregators}")
    text = args.spec.read_text()
    renamed: list[str] = []
    try:
        spec = jobspec.parse(text, renamed)
    except jobspec.JobSpecError as exc:
        problems = str(exc).splitlines()
        if args.json:
            _print_json({"valid": False, "errors": problems, "warnings": []})
        else:
            print(f"{args.spec}: {len(problems)} problem(s)", file=sys.stderr)
            for line in problems:
                print(f"  {line}", file=sys.stderr)
        return 1
    if args.aggregators:  # the cohort planner and scipy's binomial tails: only when asked
        from tally.coordinator.rounds.cohort_risk import cohort_warnings

        renamed += cohort_warnings(spec, args.aggregators)
    warnings = renamed
    if args.json:
        _print_json({"valid": True, "errors": [], "warnings": warnings, "spec": spec.to_dict()})
    else:
        for warning in warnings:
            print(f"warning: {warning}", file=sys.stderr)
        print(f"{args.spec}: valid ({spec.algorithm}, {spec.rounds} rounds, cohorts of {spec.cohort_size})")
    return 0


def _schema(args: argparse.Namespace) -> int:
    from tally.algorithms import packages
    from tally.coordinator.spec import jobspec
    from tally.coordinator.spec.jobspec_docs import package_reference, reference

    if args.package is not None:
        if args.json:
            _print_json({name: model.model_json_schema() for name in packages.names_of(args.package)
                         if (model := jobspec.options_model(name)) is not None})
        else:
            sys.stdout.write(package_reference(args.package))
    elif args.json:
        _print_json(jobspec.JobSpec.model_json_schema())
    else:
        sys.stdout.write(reference())
    return 0


# -- through the Admin API -----------------------------------------------------------------------

Action = Callable[[Any, argparse.Namespace, tuple], int]


def output_parser() -> argparse.ArgumentParser:
    output = argparse.ArgumentParser(add_help=False)
    output.add_argument("--json", action="store_true", help="print JSON (one object per line for watch)")
    return output


def admin_client_parser(output: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The flags every command that calls the coordinator's Admin API takes."""
    client = argparse.ArgumentParser(add_help=False, parents=[output])
    client.add_argument(
        "--coordinator", metavar="HOST:PORT",
        help=f"the coordinator's address (default: ${COORDINATOR_ENV}, else {DEFAULT_ADDRESS}, where "
        "`tally coordinator` listens by default)",
    )
    client.add_argument(
        "--admin-token-file", type=Path,
        help=f"file with the admin token (default: <state-dir>/{ADMIN_TOKEN_FILE})",
    )
    client.add_argument(
        "--state-dir", type=Path,
        help=f"the coordinator's state directory, to find admin.token (default: ${STATE_DIR_ENV})",
    )
    client.add_argument("--timeout", type=POSITIVE, default=30.0, help="seconds per call (watch: none)")
    from tally.security.tls import add_tls_arguments

    add_tls_arguments(client, None)
    tls_dir = next(a for a in client._actions if a.dest == "tls_dir")
    tls_dir.help = f"{tls_dir.help} (default: ${TLS_DIR_ENV}, unless another TLS flag is given)"
    return client


def apply_environment(args: argparse.Namespace) -> None:
    """Fill the flags not given from the operator's environment. Read when a command runs, not when
    the parser is built, and a TLS directory only when no other TLS flag says how to connect
    (``--insecure`` or ``--ca`` given on the command line win over ``$TALLY_TLS_DIR``)."""
    import os

    args.coordinator = args.coordinator or os.environ.get(COORDINATOR_ENV) or DEFAULT_ADDRESS
    if args.state_dir is None and os.environ.get(STATE_DIR_ENV):
        args.state_dir = Path(os.environ[STATE_DIR_ENV])
    tls_given = args.tls_dir or args.ca or args.cert or args.key or args.insecure
    if not tls_given and os.environ.get(TLS_DIR_ENV):
        args.tls_dir = Path(os.environ[TLS_DIR_ENV])


def _job(action: Action, command: str = "job") -> Callable[[argparse.Namespace], int]:
    """Wrap an action with the channel, the admin token and readable errors."""

    def run(args: argparse.Namespace) -> int:
        import grpc

        from tally.cli.quality import MissingPackage
        from tally.security import bearer_metadata, channel_options, open_channel
        from tally.security.tls import tls_config_from_args
        from tally.wire.v1 import admin_pb2_grpc

        def fail(message: str, code: int) -> int:
            print(f"tally {command} {args.action}: {message}", file=sys.stderr)
            return code

        apply_environment(args)
        token_file = args.admin_token_file or (args.state_dir / ADMIN_TOKEN_FILE if args.state_dir else None)
        if token_file is None:
            return fail(f"give --admin-token-file or --state-dir (the coordinator's, holding admin.token; "
                        f"or set ${STATE_DIR_ENV})", 2)
        try:
            token = token_file.read_text().strip()
            channel = open_channel(args.coordinator, tls_config_from_args(args), channel_options())
        except OSError as exc:
            return fail(f"{exc.filename}: {exc.strerror}", 2)
        except ValueError as exc:
            return fail(str(exc), 2)
        with channel:
            try:
                return action(admin_pb2_grpc.AdminStub(channel), args, bearer_metadata(token))
            except OSError as exc:  # a spec that cannot be read, an --out that cannot be written
                return fail(f"{exc.filename}: {exc.strerror}", 2)
            except MissingPackage as exc:  # `plot` without matplotlib
                return fail(str(exc), 2)
            except grpc.RpcError as exc:
                if args.json:  # the JSON says it all: no second copy on stderr
                    _print_json({"error": exc.code().name, "message": exc.details()})
                    return 1
                hint = (f" (is a coordinator listening at {args.coordinator}? --coordinator sets the address)"
                        if exc.code() == grpc.StatusCode.UNAVAILABLE else "")
                return fail(f"{exc.code().name}: {exc.details()}{hint}", 1)

    return run


def _name(enum: Any, value: int, prefix: str) -> str:
    return enum.Name(value).removeprefix(prefix)


def _time(stamp: Any) -> str:
    """A protobuf Timestamp as ISO-8601 UTC to the second ('' when unset)."""
    if not stamp.seconds and not stamp.nanos:
        return ""
    return datetime.fromtimestamp(stamp.seconds, UTC).isoformat().replace("+00:00", "Z")


def job_dict(job: Any) -> dict[str, Any]:
    """A Job as JSON-ready fields: state and phase by name, times as ISO-8601."""
    from tally.wire.v1 import common_pb2

    phase = _name(common_pb2.RoundPhase, job.phase, "ROUND_PHASE_") if job.phase else ""
    return {
        "job_id": job.job_id, "name": job.name, "algorithm": job.algorithm,
        "state": _name(common_pb2.JobState, job.state, "JOB_STATE_"),
        "round": job.round, "rounds": job.rounds, "phase": phase, "step": job.step,
        "committed_round": job.committed_round, "message": job.message,
        "created_at": _time(job.created_at), "updated_at": _time(job.updated_at),
        "task_reports": [{"outcome": r.outcome, "reason": r.reason, "count": r.count, "example": r.example}
                         for r in job.task_reports],
        "warnings": list(job.warnings), "selection": job.selection,
        "algorithm_version": job.algorithm_version, "able_devices": job.able_devices,
        "declared_devices": job.declared_devices, "model_kind": job.model_kind,
        "model_kind_version": job.model_kind_version, "needs": list(job.needs),
        "devices_out_of_budget": job.devices_out_of_budget,
        "attempts": [{"attempt": a.attempt, "state": a.state, "started_at": _time(a.started_at),
                      "finished_at": _time(a.finished_at), "message": a.message} for a in job.attempts],
    }


def show(job: dict[str, Any]) -> str:
    """One line per job: id, state, algorithm, progress, times, and why devices failed."""
    where = f"round {job['round']} of {job['rounds']}" if job["rounds"] else f"round {job['round']}"
    if job["phase"]:
        where += f" ({job['phase']}{' ' + job['step'] if job['step'] else ''})"
    parts = [job["job_id"], job["state"], job["algorithm"], where, f"committed {job['committed_round']}",
             f"created {job['created_at']}", f"updated {job['updated_at']}"]
    parts += _selection(job)
    if job.get("algorithm_version"):
        model = f" on model {job['model_kind']} {job['model_kind_version']}" if job.get("model_kind_version") else ""
        needs = f" with trainer capability {', '.join(job['needs'])}" if job.get("needs") else ""
        parts.append(f"devices able to run {job['algorithm']} {job['algorithm_version']}{model}{needs}: "
                     f"{job['able_devices']} of {job['declared_devices']} checked in")
    if job.get("devices_out_of_budget"):
        parts.append(f"{job['devices_out_of_budget']} devices out of privacy budget (no longer selected)")
    failures = [f"{r['reason']} {r['count']}" + (f" (e.g. {r['example']!r})" if r.get("example") else "")
                for r in job["task_reports"] if r["outcome"] != "completed"]
    if failures:
        parts.append(f"device failures in round {job['round']}: " + ", ".join(failures))
    ended = [f"#{a['attempt']} {a['message'] or a['state']}" for a in job.get("attempts", ())
             if a["state"] != "running" and job["round"] > job["committed_round"]]
    if ended:
        parts.append(f"earlier attempts of round {job['round']}: " + "; ".join(ended))
    if job["message"]:
        parts.append(job["message"])
    return "  ".join(parts)


def _selection(job: dict[str, Any]) -> list[str]:
    """The selection line while a round selects its devices ("selection: 3/26 devices of
    population 'hospitals' checked in (deadline extended 1 of 3); ..."), composed by the
    coordinator; none otherwise."""
    return [job["selection"]] if job.get("selection") else []


def _one(job: Any, args: argparse.Namespace) -> int:
    fields = job_dict(job)
    _print_json(fields) if args.json else print(show(fields))
    return 0


def _submit(stub: Any, args: argparse.Namespace, metadata: tuple) -> int:
    from tally.wire.v1 import admin_pb2

    text = args.spec.read_text()
    job = stub.SubmitJob(admin_pb2.SubmitJobRequest(spec_yaml=text), metadata=metadata, timeout=args.timeout)
    if args.json:
        return _one(job, args)
    for warning in job.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    print(job.job_id)
    return 0


def _status(stub: Any, args: argparse.Namespace, metadata: tuple) -> int:
    from tally.cli import quality
    from tally.wire.v1 import admin_pb2

    job = job_dict(stub.GetJob(admin_pb2.GetJobRequest(job_id=args.job_id), metadata=metadata, timeout=args.timeout))
    job["quality"] = quality.summary(_figures(stub, args, metadata, optional=True))
    if args.json:
        _print_json(job)
    else:
        print("\n".join(filter(None, (show(job), quality.summary_line(job["quality"])))))
    return 0


def _list(stub: Any, args: argparse.Namespace, metadata: tuple) -> int:
    from tally.wire.v1 import admin_pb2, common_pb2

    states = [common_pb2.JobState.Value(f"JOB_STATE_{s}") for s in args.state]
    token, jobs = "", []
    while True:
        request = admin_pb2.ListJobsRequest(states=states, page_token=token)
        page = stub.ListJobs(request, metadata=metadata, timeout=args.timeout)
        jobs += [job_dict(job) for job in page.jobs]
        token = page.next_page_token
        if not token:
            break
    if args.json:
        _print_json(jobs)
    else:
        for job in jobs:
            print(show(job))
    return 0


def _cancel(stub: Any, args: argparse.Namespace, metadata: tuple) -> int:
    from tally.wire.v1 import admin_pb2

    request = admin_pb2.CancelJobRequest(job_id=args.job_id, reason=args.reason)
    return _one(stub.CancelJob(request, metadata=metadata, timeout=args.timeout), args)


def _watch(stub: Any, args: argparse.Namespace, metadata: tuple) -> int:
    from tally.cli.quality import round_line
    from tally.wire.v1 import admin_pb2, common_pb2

    state = common_pb2.JOB_STATE_UNSPECIFIED
    for event in stub.WatchJob(admin_pb2.WatchJobRequest(job_id=args.job_id), metadata=metadata):
        state = event.state
        fields = {
            "time": _time(event.time), "round": event.round,
            "phase": _name(common_pb2.RoundPhase, event.phase, "ROUND_PHASE_") if event.phase else "",
            "step": event.step, "state": _name(common_pb2.JobState, event.state, "JOB_STATE_"),
            "message": event.message, "metrics": dict(sorted(event.metrics.items())),
        }
        if args.json:
            _print_json(fields)
            continue
        metrics = round_line(fields["metrics"])
        where = " ".join(filter(None, (f"round {event.round}", fields["phase"], event.step)))
        print(f"{fields['time']}  {where}  {fields['state']}  {event.message}  {metrics}".rstrip(), flush=True)
    return 0 if state == common_pb2.JOB_STATE_SUCCEEDED else 1


def _model(stub: Any, args: argparse.Namespace, metadata: tuple) -> int:
    """Write the ONNX file only once every piece arrived and its digest matched. A personalised
    job's file is only the shared part of what devices use: a warning says so."""
    from tally.cli import quality
    from tally.wire.v1 import admin_pb2

    request = admin_pb2.GetModelRequest(job_id=args.job_id, round=args.round)  # round=None: absent
    data, digest, round_ = bytearray(), "", 0
    for chunk in stub.GetModel(request, metadata=metadata, timeout=args.timeout):
        if chunk.offset != len(data):
            print(f"tally job model: a piece at offset {chunk.offset}, expected {len(data)}", file=sys.stderr)
            return 1
        data += chunk.data
        digest, round_ = chunk.digest, chunk.round
    if hashlib.sha256(data).hexdigest() != digest:
        print(f"tally job model: the model of {args.job_id} round {round_} arrived damaged (digest mismatch)",
              file=sys.stderr)
        return 1
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(data)
    fields = {"job_id": args.job_id, "round": round_, "path": str(args.out), "bytes": len(data), "sha256": digest}
    job = stub.GetJob(admin_pb2.GetJobRequest(job_id=args.job_id), metadata=metadata, timeout=args.timeout)
    warning = quality.model_warning(job.algorithm, _figures(stub, args, metadata, optional=True))
    quality.warn(warning)
    if warning:
        fields["warning"] = warning
    _print_json(fields) if args.json else print(f"{args.out}: {args.job_id} round {round_}, {len(data)} bytes")
    return 0


def _figures(stub: Any, args: argparse.Namespace, metadata: tuple, optional: bool = False) -> list:
    """Every committed round's figures (``tally.cli.quality.RoundFigures``), oldest first.
    ``optional``: none from a coordinator older than GetJobMetrics (status and model still work
    against it during an upgrade)."""
    import grpc

    from tally.cli.quality import RoundFigures
    from tally.wire.v1 import admin_pb2

    try:
        reply = stub.GetJobMetrics(admin_pb2.GetJobMetricsRequest(job_id=args.job_id), metadata=metadata,
                                   timeout=args.timeout)
    except grpc.RpcError as exc:
        if optional and exc.code() == grpc.StatusCode.UNIMPLEMENTED:
            return []
        raise
    return [RoundFigures(r.round, _time(r.committed_at), dict(sorted(r.metrics.items()))) for r in reply.rounds]


def _metrics(stub: Any, args: argparse.Namespace, metadata: tuple) -> int:
    from tally.cli import quality

    if args.json and args.csv:
        print("tally job metrics: give --json or --csv, not both", file=sys.stderr)
        return 2
    rounds = _figures(stub, args, metadata)
    if args.json:
        _print_json({"job_id": args.job_id, "rounds": [r.as_dict() for r in rounds]})
    elif args.csv:
        sys.stdout.write(quality.csv_text(rounds))
    else:
        grid = quality.table(rounds, f"{args.job_id}: model quality per round (the devices' held-out sums)")
        from tally.cli.console import console

        console().print(grid)
    return 0


def _plot(stub: Any, args: argparse.Namespace, metadata: tuple) -> int:
    from tally.cli import quality

    rounds = _figures(stub, args, metadata)
    if quality.summary(rounds) is None:
        print(f"tally job plot: {args.job_id} has no model-quality figures yet (no committed round measured any; "
              "see its evaluation: section)", file=sys.stderr)
        return 1
    quality.plot(rounds, args.out, f"{args.job_id}: federated evaluation per round")
    _print_json({"job_id": args.job_id, "path": str(args.out), "rounds": len(rounds)}) if args.json else \
        print(f"{args.out}: {len(rounds)} rounds of {args.job_id}")
    return 0
