"""``tally k8s apply|render|fleet|status``: what an operator otherwise does by hand with kubectl.

- ``apply OVERLAY``: render the kustomize overlay and server-side apply every object (plus the
  Secrets ``tally certs --k8s-secrets`` wrote, with ``--secrets``);
- ``render OVERLAY``: the same objects printed as YAML, offline (no cluster);
- ``fleet``: launch the overlay's indexed fleet Job for N devices in S shards (or scale a running
  one's parallelism), a load test from inside the cluster;
- ``status``: pods, aggregators ready, the fleet Job, and the coordinator's jobs with their round
  from its admin API.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rich.table import Table

from tally.cli.console import console as cli_console
from tally.ops import k8s

DEFAULT_OVERLAY = Path("k8s/overlays/dev")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "k8s", help="deploy on Kubernetes, run a fleet there, and show the deployment's state",
        description="Operate a Tally deployment on Kubernetes through the API server of your "
        "kubeconfig (or the pod's service account inside a cluster).",
    )
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--kubeconfig", type=Path, help="kubeconfig file (default: $KUBECONFIG or ~/.kube/config)")
    common.add_argument("--context", help="kubeconfig context (default: the current one)")
    common.add_argument("--namespace", default="tally", help="the deployment's namespace (default: %(default)s)")

    apply = actions.add_parser("apply", parents=[common], help="server-side apply a rendered overlay",
                               description="Render OVERLAY with `kubectl kustomize` and server-side "
                               f"apply every object as field manager {k8s.FIELD_MANAGER!r}.")
    apply.add_argument("overlay", type=Path, help="kustomize directory, e.g. k8s/overlays/dev")
    apply.add_argument("--secrets", type=Path, metavar="DIR",
                       help="also apply DIR/*.yaml (from `tally certs --k8s-secrets DIR`)")
    apply.add_argument("--dry-run", action="store_true", help="server-side dry run: validate, change nothing")
    apply.set_defaults(run=run_apply)

    render = actions.add_parser("render", help="print an overlay's manifests (offline, no cluster)",
                                description="Render OVERLAY with `kubectl kustomize` and print every object "
                                "as YAML, in the order `apply` sends them (namespaces and CRD-free objects "
                                "first); no kubeconfig, no API server.")
    render.add_argument("overlay", type=Path, help="kustomize directory, e.g. k8s/overlays/prod")
    render.add_argument("--secrets", type=Path, metavar="DIR",
                        help="also print DIR/*.yaml (from `tally certs --k8s-secrets DIR`)")
    render.set_defaults(run=run_render)

    fleet = actions.add_parser("fleet", parents=[common], help="launch or scale the simulated fleet Job",
                               description="Run the overlay's indexed fleet Job: pod i plays shard i of "
                               "--shards of the --devices devices. A running fleet of the same size is "
                               "scaled (parallelism); any other replaces it.")
    fleet.add_argument("--overlay", type=Path, default=DEFAULT_OVERLAY,
                       help="overlay whose fleet Job to use (default: %(default)s)")
    fleet.add_argument("--devices", type=int, required=True, help="simulated devices in all")
    fleet.add_argument("--shards", type=int, required=True, help="pods (the Job's completions)")
    fleet.add_argument("--parallelism", type=int, help="pods running at once (default: all)")
    fleet.add_argument("--dropout", type=float, help="probability a device drops in a session")
    fleet.set_defaults(run=run_fleet)

    status = actions.add_parser("status", parents=[common], help="pods, aggregators, fleet, jobs and rounds",
                                description="The deployment's pods and workloads, then the coordinator's "
                                "jobs from its admin API (reach it with `kubectl port-forward -n tally "
                                "svc/tally-coordinator 7000:7000`).")
    status.add_argument("--coordinator", default="localhost:7000", help="the admin API (default: %(default)s)")
    status.add_argument("--tls-dir", type=Path, help="a directory with the deployment's ca.pem (e.g. certs/device)")
    status.add_argument("--admin-token-file", type=Path,
                        help="the admin token (default: read from the coordinator pod; needs pods/exec)")
    status.add_argument("--no-jobs", action="store_true", help="skip the admin API")
    status.set_defaults(run=run_status)


def _fail(message: str) -> int:
    print(f"tally k8s: {message}", file=sys.stderr)
    return 2


def _objects(args: argparse.Namespace) -> list[dict]:
    objects = k8s.render(args.overlay)
    if args.secrets is not None:
        objects += k8s.load_manifests(args.secrets)
    return objects


def run_render(args: argparse.Namespace) -> int:
    import yaml

    try:
        objects = k8s.apply_order(_objects(args))
    except k8s.K8sError as exc:
        return _fail(str(exc))
    sys.stdout.write(yaml.safe_dump_all(objects, sort_keys=False))
    return 0


def run_apply(args: argparse.Namespace) -> int:
    try:
        objects = _objects(args)
        cluster = k8s.Cluster(args.kubeconfig, args.context)
        for line in cluster.apply(objects, dry_run=args.dry_run):
            print(line)
    except k8s.K8sError as exc:
        return _fail(str(exc))
    except Exception as exc:  # noqa: BLE001 (the API server's answer: ApiException, connection errors)
        return _fail(f"apply failed: {exc}")
    return 0


def run_fleet(args: argparse.Namespace) -> int:
    try:
        template = k8s.find_object(k8s.render(args.overlay), "Job", k8s.FLEET_JOB)
        template["metadata"]["namespace"] = args.namespace
        job = k8s.fleet_job(template, devices=args.devices, shards=args.shards,
                            parallelism=args.parallelism, dropout=args.dropout)
        print(k8s.Cluster(args.kubeconfig, args.context).launch_fleet(job))
    except (k8s.K8sError, ValueError) as exc:
        return _fail(str(exc))
    except Exception as exc:  # noqa: BLE001 (as in apply: a CLI message, not a traceback)
        return _fail(f"fleet failed: {exc}")
    return 0


def run_status(args: argparse.Namespace) -> int:
    console = cli_console()
    try:
        cluster = k8s.Cluster(args.kubeconfig, args.context)
        state = cluster.status(args.namespace)
        token = None
        if not args.no_jobs:
            token = (args.admin_token_file.read_text().strip() if args.admin_token_file
                     else cluster.admin_token(args.namespace))
    except (k8s.K8sError, OSError) as exc:
        return _fail(str(exc))
    except Exception as exc:  # noqa: BLE001 (as in apply: a CLI message, not a traceback)
        return _fail(f"status failed: {exc}")
    pods = Table("pod", "phase", "ready", "restarts", title=f"namespace {args.namespace}")
    for pod in state.pods:
        pods.add_row(pod.name, pod.phase, "yes" if pod.ready else "no", str(pod.restarts))
    console.print(pods)
    for name, (ready, wanted) in state.ready.items():
        console.print(f"{name}: {ready}/{wanted} ready")
    if state.fleet is not None:
        f = state.fleet
        console.print(f"fleet: {f['succeeded']}/{f['completions']} shards done, {f['active']} running, "
                      f"{f['failed']} failed")
    if token is None:
        return 0
    try:
        jobs = coordinator_jobs(args.coordinator, args.tls_dir, token)
    except (OSError, ValueError, RuntimeError) as exc:
        return _fail(f"admin API at {args.coordinator}: {exc}")
    table = Table("job", "state", "round", "phase", "committed", title="coordinator jobs")
    for row in jobs:
        table.add_row(*row)
    console.print(table)
    return 0


def coordinator_jobs(address: str, tls_dir: Path | None, token: str) -> list[tuple[str, str, str, str, str]]:
    """(job id, state, round, phase, committed round) of every job, from the admin API."""
    import grpc

    from tally.security import TLSConfig, bearer_metadata, channel_options, open_channel
    from tally.wire.v1 import admin_pb2, admin_pb2_grpc, common_pb2

    tls = TLSConfig(ca=tls_dir / "ca.pem") if tls_dir is not None else TLSConfig()
    rows, page = [], ""
    with open_channel(address, tls, channel_options()) as channel:
        stub = admin_pb2_grpc.AdminStub(channel)
        while True:
            try:
                reply = stub.ListJobs(admin_pb2.ListJobsRequest(page_token=page),
                                      metadata=bearer_metadata(token), timeout=10)
            except grpc.RpcError as exc:
                raise RuntimeError(f"{exc.code().name}: {exc.details()}") from None
            for job in reply.jobs:
                rows.append((job.job_id, common_pb2.JobState.Name(job.state).removeprefix("JOB_STATE_"),
                             str(job.round), common_pb2.RoundPhase.Name(job.phase).removeprefix("ROUND_PHASE_"),
                             str(job.committed_round)))
            page = reply.next_page_token
            if not page:
                return rows
