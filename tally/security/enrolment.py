"""Device enrolment: who may register, and under which identity key.

The secure sum protects a device only against neighbours the coordinator vouches for (their
identity keys go into the roster it signs), so ``Register`` is where sybils and impersonation must
be stopped. A device proves two things when it registers:

- it was provisioned: an ``EnrolmentVerifier`` admits its claim. The built-in one,
  ``SharedKeyEnrolment``, checks a per-device credential ``HMAC-SHA256(enrolment.key, population,
  device_id)`` that the operator hands out (``tally enrol``) when provisioning the device; a
  platform attestation service (Play Integrity, App Attest, a TPM quote) plugs in as another
  verifier, reading ``EnrolmentClaim.attestation``;
- it holds the identity key it claims: it signs ``registration_statement`` (device id, population,
  identity key and a timestamp) with that key. The coordinator keeps the latest timestamp per
  device, so a recorded Register cannot be replayed, and binds a device id to its first identity
  key for good, so a taken id cannot be re-registered with another key even by a holder of its
  credential.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from tally.security.errors import AuthError
from tally.security.tokens import MIN_SECRET_BYTES, _pack_bytes, _pack_str, load_or_create_secret

ENROLMENT_KEY_FILE = "enrolment.key"
CREDENTIAL_BYTES = 32
# How far a registration's timestamp may be from the coordinator's clock.
REGISTRATION_WINDOW_S = 300.0
_CREDENTIAL_DOMAIN = b"tally-enrolment-credential\x00"
_STATEMENT_DOMAIN = b"tally-registration\x00"


@dataclass(frozen=True)
class EnrolmentClaim:
    """What a registering device claims, as the coordinator received it."""

    device_id: str
    population: str
    identity_public: bytes
    credential: bytes
    attestation: str


class EnrolmentVerifier(Protocol):
    """Admits or refuses a registration. Raise ``AuthError`` (UNAUTHENTICATED or
    PERMISSION_DENIED) with a message the device may see; return to admit. Called once per
    ``Register``, after the size checks and before the identity signature is checked."""

    def admit(self, claim: EnrolmentClaim) -> None: ...


class SharedKeyEnrolment:
    """Per-device credentials derived from one enrolment key: the coordinator stores no list of
    devices to provision, and a leaked credential admits only its own device id."""

    def __init__(self, key: bytes) -> None:
        if len(key) < MIN_SECRET_BYTES:
            raise ValueError(f"an enrolment key has at least {MIN_SECRET_BYTES} bytes")
        self._key = key

    def credential(self, population: str, device_id: str) -> bytes:
        return enrolment_credential(self._key, population, device_id)

    def admit(self, claim: EnrolmentClaim) -> None:
        if not claim.credential:
            raise AuthError("UNAUTHENTICATED", "RegisterRequest.enrolment_credential is required")
        expected = self.credential(claim.population, claim.device_id)
        if not hmac.compare_digest(claim.credential, expected):
            raise AuthError(
                "PERMISSION_DENIED",
                "RegisterRequest.enrolment_credential is not valid for this device id and population",
            )


def enrolment_credential(key: bytes, population: str, device_id: str) -> bytes:
    message = _CREDENTIAL_DOMAIN + _pack_str(population, "population") + _pack_str(device_id, "device_id")
    return hmac.new(key, message, hashlib.sha256).digest()


def registration_statement(
    device_id: str, population: str, identity_public: bytes, timestamp: float
) -> bytes:
    """What a device signs with its identity key to register (length-prefixed fields, as the
    session tickets encode theirs)."""
    return (
        _STATEMENT_DOMAIN + _pack_str(device_id, "device_id") + _pack_str(population, "population")
        + _pack_bytes(identity_public, "identity_public") + struct.pack(">d", timestamp)
    )


def load_or_create_enrolment_key(directory: str | os.PathLike[str]) -> bytes:
    """``<directory>/enrolment.key``, created on first use."""
    return load_or_create_secret(Path(directory) / ENROLMENT_KEY_FILE)


def read_enrolment_key(path: str | os.PathLike[str]) -> bytes:
    """An existing enrolment key file (never created here: a device-side tool must not invent
    a key the coordinator does not have)."""
    data = Path(path).read_bytes()
    if len(data) < MIN_SECRET_BYTES:
        raise ValueError(f"{path} holds fewer than {MIN_SECRET_BYTES} bytes: not an enrolment key")
    return data

