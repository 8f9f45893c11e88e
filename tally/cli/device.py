"""``tally device``: act on one enrolled device through the coordinator's Admin API.

``revoke`` ends a device's participation for good: it can no longer register, check in, download
or be seated, from its next call on (a session it is already in finishes, with the ticket it
holds). No other device is touched: devices share no secret (their TLS holds the CA only; each is
known by its own identity key and tokens)."""

from __future__ import annotations

import argparse
from typing import Any

from tally.cli.job import _job, _print_json, admin_client_parser, output_parser


def register(sub: argparse._SubParsersAction) -> None:
    device = sub.add_parser("device", help="revoke an enrolled device", description=__doc__.splitlines()[0])
    actions = device.add_subparsers(dest="action", required=True, metavar="ACTION")
    client = admin_client_parser(output_parser())
    revoke = actions.add_parser("revoke", parents=[client], help="revoke one device for good")
    revoke.add_argument("device_id", help="the enrolled device's id")
    revoke.set_defaults(run=_job(_revoke, "device"))


def _revoke(stub: Any, args: argparse.Namespace, metadata: tuple) -> int:
    from tally.wire.v1 import admin_pb2

    reply = stub.RevokeDevice(admin_pb2.RevokeDeviceRequest(device_id=args.device_id), metadata=metadata,
                              timeout=args.timeout)
    if args.json:
        _print_json({"device_id": reply.device_id, "revoked": True})
    else:
        print(f"device {reply.device_id} revoked")
    return 0
