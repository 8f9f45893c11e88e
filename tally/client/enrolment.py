"""The device half of enrolment (``tally.security.enrolment``): what a device sends to register.

A device is provisioned with a long-term identity key and, for the coordinator's built-in
verifier, a per-device credential; each registration signs a fresh statement with the identity
key, so a recorded one is useless to anyone else.
"""

from __future__ import annotations

import hashlib
import hmac
import os

from tally.secagg import SigningKey
from tally.security.enrolment import registration_statement
from tally.security.tokens import load_or_create_secret
from tally.wire.v1 import coordinator_pb2


def register_request(
    identity: SigningKey,
    device_id: str,
    population: str,
    credential: bytes,
    now: float,
    attestation: str = "",
) -> coordinator_pb2.RegisterRequest:
    return coordinator_pb2.RegisterRequest(
        device_id=device_id,
        population=population,
        attestation=attestation,
        identity_public=identity.public,
        enrolment_credential=credential,
        timestamp=now,
        signature=identity.sign(registration_statement(device_id, population, identity.public, now)),
    )


def load_or_create_identity(path: str | os.PathLike[str]) -> SigningKey:
    """The device's identity key from ``path`` (32 raw bytes, 0600), created on first use. It must
    outlive restarts: the coordinator binds the device id to it for good."""
    data = load_or_create_secret(path)
    if len(data) != 32:
        raise ValueError(f"{path} is not a device identity key (32 raw bytes)")
    return SigningKey(data)


def simulated_identity(enrolment_key: bytes, device_id: str) -> SigningKey:
    """A simulated device's identity, derived from the enrolment key the simulator holds anyway:
    a fleet restarted against the same coordinator registers under the same keys."""
    return SigningKey(
        hmac.new(enrolment_key, b"tally-simulated-identity\x00" + device_id.encode(), hashlib.sha256).digest())
