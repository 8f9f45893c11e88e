"""``tally enrol``: provision devices, i.e. hand out the credentials ``Register`` demands.

Run where the coordinator's ``enrolment.key`` is (its secrets directory): the credential of a
device id is derived from that key, so nothing is stored and any number of devices can be
provisioned offline, e.g. in a factory line or an MDM push.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tally.security.enrolment import ENROLMENT_KEY_FILE, SharedKeyEnrolment, read_enrolment_key
from tally.security.tokens import MAX_ID_CHARS


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "enrol",
        help="print enrolment credentials for devices (what `tally client --credential` takes)",
        description=(
            "Print one JSON line per device id: its population and hex credential, an HMAC of the "
            "coordinator's enrolment key over (population, device id). A device registers with its "
            "credential and its own identity key; the coordinator binds the id to that key for good."
        ),
    )
    p.add_argument(
        "--key", type=Path, required=True,
        help=f"the coordinator's {ENROLMENT_KEY_FILE} (in its --secrets-dir, or its state dir)",
    )
    p.add_argument("--population", default="default", help="population the devices belong to")
    p.add_argument("device_ids", nargs="+", metavar="DEVICE_ID", help="ids of the devices to provision")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    try:
        enrolment = SharedKeyEnrolment(read_enrolment_key(args.key))
    except OSError as exc:
        print(f"tally enrol: --key {args.key}: {exc.strerror}", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"tally enrol: --key {exc}", file=sys.stderr)
        return 2
    for name, value in (("--population", args.population), *(("DEVICE_ID", d) for d in args.device_ids)):
        if not 0 < len(value) <= MAX_ID_CHARS:
            print(f"tally enrol: {name} must be 1..{MAX_ID_CHARS} characters", file=sys.stderr)
            return 2
    for device_id in args.device_ids:
        credential = enrolment.credential(args.population, device_id)
        print(json.dumps({"device_id": device_id, "population": args.population, "credential": credential.hex()}))
    return 0
