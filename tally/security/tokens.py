"""Device tokens and session tickets: the two credentials the coordinator issues.

**Device tokens** (``TokenIssuer``): the coordinator authenticates a device once and hands it a
bearer token that later calls carry in the ``authorization: Bearer <token>`` metadata. Only the
coordinator checks them, so a symmetric HMAC-SHA256 key suffices::

    tly1.<base64url(JSON claims)>.<base64url(HMAC-SHA256(secret, "tally-device-token\\0" + "tly1." + payload))>

The MAC covers the exact text of the version and the payload; verification compares the MAC text
in constant time *before* parsing anything, then checks expiry. Every failure raises
``AuthError("UNAUTHENTICATED", ...)``.

**Session tickets** (``TicketSigner``/``TicketVerifier``): the coordinator binds an aggregator
session to (job, round, session, sum ids, cohort size, config digest, aggregator, expiry, leader
epoch) and signs it with Ed25519; aggregators hold only the public key, so a compromised aggregator
cannot mint tickets for others. Binary layout, all integers big-endian::

    b"TLYT" | version u8 (=2) | job_id str | round u64 | session_id str | n_sums u16 | sum_id str*
        | cohort_size u32 | config_digest bytes | aggregator_id str | expires_at f64
        | leader_epoch u64 | signature[64]

where ``str``/``bytes`` are a u16 length and that many bytes (UTF-8 for str). The signature covers
``b"tally-session-ticket\\0"`` followed by everything before it. Every failure raises
``AuthError("PERMISSION_DENIED", ...)``.

**Leader epochs** (``TicketSigner.sign_epoch``): coordinator replicas fence aggregators with the
epoch a new leader took (``tally.coordinator.state.leadership``), signed by the same key under its
own domain (``b"tally-leader-epoch\\0" | epoch u64``), so no ticket can pass for one and no caller
without the key can raise an aggregator's floor and lock the real leader out.

Time is always passed in (``now``, Unix seconds as float), never read from a hidden clock.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import math
import os
import secrets
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519

from tally.security.errors import AuthError
from tally.security.files import private_dir, write_new

# -- device tokens -------------------------------------------------------------------------------

TOKEN_VERSION = "tly1"
TOKEN_METADATA_KEY = "authorization"
MAX_TOKEN_CHARS = 4096
MAX_ID_CHARS = 256
MIN_SECRET_BYTES = 32
_TOKEN_DOMAIN = b"tally-device-token\x00"
_B64URL = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")


@dataclass(frozen=True)
class DeviceClaims:
    device_id: str
    population: str
    issued_at: float
    expires_at: float
    token_id: str  # random, unique per token: lets a coordinator revoke or log one token


class TokenIssuer:
    """Issues and verifies device tokens with one HMAC secret.

    ``previous`` secrets are accepted for verification only, so the secret can be rotated without
    logging every device out. ``leeway_s`` tolerates a token issued slightly in the future (clock
    skew between coordinator replicas); expiry is strict."""

    def __init__(
        self, secret: bytes, *, previous: Iterable[bytes] = (), leeway_s: float = 30.0
    ) -> None:
        keys = [secret, *previous]
        for k in keys:
            if not isinstance(k, (bytes, bytearray)) or len(k) < MIN_SECRET_BYTES:
                raise ValueError(f"token secrets must be at least {MIN_SECRET_BYTES} bytes")
        self._secret = bytes(secret)
        self._all = [bytes(k) for k in keys]
        self._leeway = float(leeway_s)

    def issue(self, device_id: str, population: str, ttl_s: float, now: float) -> str:
        _check_id(device_id, "device_id")
        _check_id(population, "population")
        if not _finite(now) or not _finite(ttl_s) or ttl_s <= 0:
            raise ValueError("ttl_s must be positive and now finite")
        claims = {
            "d": device_id,
            "p": population,
            "i": now,
            "e": now + ttl_s,
            "j": secrets.token_hex(12),
        }
        payload = _b64e(json.dumps(claims, separators=(",", ":"), sort_keys=True).encode("ascii"))
        signed = f"{TOKEN_VERSION}.{payload}"
        return f"{signed}.{_b64e(self._mac(self._secret, signed))}"

    def verify(self, token: str, now: float) -> DeviceClaims:
        if not isinstance(token, str) or not token or len(token) > MAX_TOKEN_CHARS:
            raise _unauth("malformed device token")
        parts = token.split(".")
        if len(parts) != 3 or not all(p and set(p) <= _B64URL for p in parts):
            raise _unauth("malformed device token")
        version, payload, mac = parts
        if version != TOKEN_VERSION:
            raise _unauth(f"unsupported device token version {version[:16]!r}")
        signed = f"{version}.{payload}"
        ok = False
        for key in self._all:  # no early exit: time does not depend on which key matched
            ok |= hmac.compare_digest(_b64e(self._mac(key, signed)), mac)
        if not ok:
            raise _unauth("device token signature invalid")
        try:
            claims = json.loads(_b64d(payload))
            device_id, population = claims["d"], claims["p"]
            issued_at, expires_at, token_id = claims["i"], claims["e"], claims["j"]
        except (ValueError, KeyError, TypeError, UnicodeDecodeError, binascii.Error):
            raise _unauth("malformed device token") from None
        if not (
            isinstance(device_id, str) and isinstance(population, str) and isinstance(token_id, str)
            and _number(issued_at) and _number(expires_at)
        ):
            raise _unauth("malformed device token")
        if not _finite(now):
            raise ValueError("now must be finite")
        if now >= expires_at:
            raise _unauth("device token expired")
        if issued_at > now + self._leeway:
            raise _unauth("device token not yet valid")
        return DeviceClaims(device_id, population, float(issued_at), float(expires_at), token_id)

    @staticmethod
    def _mac(key: bytes, signed: str) -> bytes:
        return hmac.new(key, _TOKEN_DOMAIN + signed.encode("ascii"), hashlib.sha256).digest()


def bearer_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """Call metadata carrying ``token`` (pass as ``metadata=`` to a stub call)."""
    return ((TOKEN_METADATA_KEY, f"Bearer {token}"),)


def token_from_metadata(metadata: Iterable[tuple[str, str | bytes]] | None) -> str:
    """The bearer token of a call's ``invocation_metadata()``; ``AuthError`` when absent."""
    for key, value in metadata or ():
        if key.lower() == TOKEN_METADATA_KEY and isinstance(value, str):
            scheme, _, token = value.partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
    raise _unauth("missing bearer token")


# -- session tickets -----------------------------------------------------------------------------

TICKET_MAGIC = b"TLYT"
TICKET_VERSION = 2
MAX_TICKET_BYTES = 64 * 1024
SIGNATURE_BYTES = 64
_TICKET_DOMAIN = b"tally-session-ticket\x00"
_EPOCH_DOMAIN = b"tally-leader-epoch\x00"
EPOCH_STATEMENT_BYTES = 8 + SIGNATURE_BYTES


@dataclass(frozen=True)
class SessionTicket:
    job_id: str
    round: int
    session_id: str
    sum_ids: tuple[str, ...]
    cohort_size: int
    config_digest: bytes
    aggregator_id: str
    expires_at: float
    # The coordinator leader's epoch (replicas over PostgreSQL); 0 for a coordinator that leads alone.
    leader_epoch: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "sum_ids", tuple(self.sum_ids))
        object.__setattr__(self, "config_digest", bytes(self.config_digest))


def config_digest(data: bytes) -> bytes:
    """SHA-256 of a canonical session-config encoding, the value a ticket binds."""
    return hashlib.sha256(data).digest()


class TicketSigner:
    """Held by the coordinator: signs session tickets with an Ed25519 private key."""

    def __init__(self, private_key: ed25519.Ed25519PrivateKey) -> None:
        if not isinstance(private_key, ed25519.Ed25519PrivateKey):
            raise TypeError("TicketSigner needs an Ed25519 private key")
        self._key = private_key

    @property
    def public_key(self) -> ed25519.Ed25519PublicKey:
        return self._key.public_key()

    def verifier(self) -> TicketVerifier:
        return TicketVerifier(self.public_key)

    def sign(self, ticket: SessionTicket) -> bytes:
        body = _encode_ticket(ticket)
        return body + self._key.sign(_TICKET_DOMAIN + body)

    def sign_epoch(self, epoch: int) -> bytes:
        """A statement that a leader of ``epoch`` exists (``TicketVerifier.verify_epoch``)."""
        body = struct.pack(">Q", _epoch(epoch))
        return body + self._key.sign(_EPOCH_DOMAIN + body)


class TicketVerifier:
    """Held by aggregators: checks a ticket's signature, shape and expiry (and, when asked, that
    it names this aggregator)."""

    def __init__(self, public_key: ed25519.Ed25519PublicKey | bytes) -> None:
        if isinstance(public_key, (bytes, bytearray)):
            public_key = ed25519.Ed25519PublicKey.from_public_bytes(bytes(public_key))
        if not isinstance(public_key, ed25519.Ed25519PublicKey):
            raise TypeError("TicketVerifier needs an Ed25519 public key")
        self._key = public_key

    def verify(self, ticket: bytes, now: float, *, aggregator_id: str | None = None) -> SessionTicket:
        """The ticket's contents once its signature, shape, expiry and, when given, its
        aggregator check out."""
        if not isinstance(ticket, (bytes, bytearray, memoryview)):
            raise _denied("malformed session ticket")
        data = bytes(ticket)
        if not (len(TICKET_MAGIC) + 1 + SIGNATURE_BYTES < len(data) <= MAX_TICKET_BYTES):
            raise _denied("malformed session ticket")
        if data[: len(TICKET_MAGIC)] != TICKET_MAGIC:
            raise _denied("malformed session ticket")
        if data[len(TICKET_MAGIC)] != TICKET_VERSION:
            raise _denied(f"unsupported session ticket version {data[len(TICKET_MAGIC)]}")
        body, signature = data[:-SIGNATURE_BYTES], data[-SIGNATURE_BYTES:]
        try:
            self._key.verify(signature, _TICKET_DOMAIN + body)
        except InvalidSignature:
            raise _denied("session ticket signature invalid") from None
        try:
            parsed = _decode_ticket(body)
        except (ValueError, struct.error, UnicodeDecodeError):
            raise _denied("malformed session ticket") from None
        if not _finite(now):
            raise ValueError("now must be finite")
        if now >= parsed.expires_at:
            raise _denied("session ticket expired")
        if aggregator_id is not None and parsed.aggregator_id != aggregator_id:
            raise _denied("session ticket is for another aggregator")
        return parsed

    def verify_epoch(self, statement: bytes) -> int:
        """The epoch of a signed leader-epoch statement. It has no expiry: an old one names an
        old epoch, which raises no floor."""
        data = bytes(statement)
        if len(data) != EPOCH_STATEMENT_BYTES:
            raise _denied(f"malformed leader epoch: {EPOCH_STATEMENT_BYTES} bytes expected")
        body, signature = data[:8], data[8:]
        try:
            self._key.verify(signature, _EPOCH_DOMAIN + body)
        except InvalidSignature:
            raise _denied("leader epoch signature invalid") from None
        return int(struct.unpack(">Q", body)[0])


# -- owner tokens --------------------------------------------------------------------------------

OWNER_METADATA_KEY = "tally-owner-token-bin"
OWNER_TOKEN_BYTES = 32
_OWNER_DOMAIN = b"tally-session-owner\x00"


class OwnerTokens:
    """The coordinator's proof, on AggregatorControl, that it opened a session.

    Every cohort member holds the session ticket, so the ticket cannot prove ownership. The owner
    token is derived (HMAC-SHA256 of the coordinator's token secret over the aggregator and
    session ids, domain-separated from device tokens) rather than stored: a restarted coordinator
    can still close the sessions it opened, and the secret never leaves it. Aggregators receive
    and keep only its SHA-256."""

    def __init__(self, secret: bytes) -> None:
        if len(secret) < MIN_SECRET_BYTES:
            raise ValueError(f"an owner-token secret has at least {MIN_SECRET_BYTES} bytes")
        self._secret = secret

    def token(self, aggregator_id: str, session_id: str) -> bytes:
        message = _OWNER_DOMAIN + _pack_str(aggregator_id, "aggregator_id") + _pack_str(session_id, "session_id")
        return hmac.new(self._secret, message, hashlib.sha256).digest()


def owner_metadata(token: bytes) -> tuple[tuple[str, bytes], ...]:
    return ((OWNER_METADATA_KEY, token),)


def owner_token_from_metadata(metadata: Iterable[tuple[str, str | bytes]] | None) -> bytes:
    """The owner token a control call presents; ``AuthError`` when it is missing or malformed."""
    for key, value in metadata or ():
        if key == OWNER_METADATA_KEY and isinstance(value, bytes) and len(value) == OWNER_TOKEN_BYTES:
            return value
    raise AuthError(
        "UNAUTHENTICATED",
        f"control calls need the session's owner token ({OWNER_TOKEN_BYTES} bytes in {OWNER_METADATA_KEY})",
    )


def _encode_ticket(t: SessionTicket) -> bytes:
    if not isinstance(t.round, int) or isinstance(t.round, bool) or not 0 <= t.round < 2**64:
        raise ValueError("round must be an integer in [0, 2^64)")
    if not isinstance(t.cohort_size, int) or isinstance(t.cohort_size, bool) or not 1 <= t.cohort_size < 2**32:
        raise ValueError("cohort_size must be an integer in [1, 2^32)")
    if not t.sum_ids or len(set(t.sum_ids)) != len(t.sum_ids) or len(t.sum_ids) >= 2**16:
        raise ValueError("sum_ids must be non-empty and distinct")
    if not _finite(t.expires_at):
        raise ValueError("expires_at must be finite")
    out = bytearray(TICKET_MAGIC)
    out.append(TICKET_VERSION)
    out += _pack_str(t.job_id, "job_id")
    out += struct.pack(">Q", t.round)
    out += _pack_str(t.session_id, "session_id")
    out += struct.pack(">H", len(t.sum_ids))
    for s in t.sum_ids:
        out += _pack_str(s, "sum_id")
    out += struct.pack(">I", t.cohort_size)
    out += _pack_bytes(t.config_digest, "config_digest")
    out += _pack_str(t.aggregator_id, "aggregator_id")
    out += struct.pack(">d", float(t.expires_at))
    out += struct.pack(">Q", _epoch(t.leader_epoch))
    if len(out) + SIGNATURE_BYTES > MAX_TICKET_BYTES:
        raise ValueError("session ticket too large")
    return bytes(out)


def _decode_ticket(body: bytes) -> SessionTicket:
    r = _Reader(body, len(TICKET_MAGIC) + 1)
    job_id = r.text()
    round_ = r.unpack(">Q")
    session_id = r.text()
    sum_ids = tuple(r.text() for _ in range(r.unpack(">H")))
    cohort_size = r.unpack(">I")
    digest = r.blob()
    aggregator_id = r.text()
    expires_at = r.unpack(">d")
    leader_epoch = r.unpack(">Q")
    if r.pos != len(body):
        raise ValueError("trailing bytes")
    if not sum_ids or len(set(sum_ids)) != len(sum_ids) or cohort_size < 1 or not _finite(expires_at):
        raise ValueError("invalid field")
    return SessionTicket(job_id, round_, session_id, sum_ids, cohort_size, digest, aggregator_id, expires_at,
                         leader_epoch)


class _Reader:
    def __init__(self, data: bytes, pos: int) -> None:
        self.data, self.pos = data, pos

    def unpack(self, fmt: str) -> Any:  # an int or a float, as ``fmt`` says (struct's own type)
        (value,) = struct.unpack_from(fmt, self.data, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def blob(self) -> bytes:
        n = self.unpack(">H")
        if self.pos + n > len(self.data):
            raise ValueError("truncated")
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def text(self) -> str:
        return self.blob().decode("utf-8")


def _pack_bytes(value: bytes, what: str) -> bytes:
    if not isinstance(value, (bytes, bytearray)) or len(value) >= 2**16:
        raise ValueError(f"{what} must be bytes shorter than 64 KiB")
    return struct.pack(">H", len(value)) + bytes(value)


def _pack_str(value: str, what: str) -> bytes:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{what} must be a non-empty string")
    return _pack_bytes(value.encode("utf-8"), what)


# -- key and secret persistence ------------------------------------------------------------------

TOKEN_SECRET_FILE = "token.secret"
TICKET_KEY_FILE = "ticket.key"
TICKET_PUB_FILE = "ticket.pub"


def load_or_create_secret(path: str | os.PathLike[str]) -> bytes:
    """``path`` (32 random bytes, 0600), created on first use; refused when it holds fewer than
    ``MIN_SECRET_BYTES``. Every raw secret Tally keeps on disk goes through here."""
    data = _load_or_create(Path(path), lambda: secrets.token_bytes(32))
    if len(data) < MIN_SECRET_BYTES:
        raise ValueError(f"{path} holds fewer than {MIN_SECRET_BYTES} bytes")
    return data


def load_or_create_token_secret(directory: str | os.PathLike[str]) -> bytes:
    """``<directory>/token.secret``: device tokens and session owner tokens derive from it."""
    return load_or_create_secret(Path(directory) / TOKEN_SECRET_FILE)


def load_or_create_ticket_key(directory: str | os.PathLike[str]) -> ed25519.Ed25519PrivateKey:
    """``<directory>/ticket.key`` (Ed25519, PKCS#8 PEM, 0600), created on first use, with its
    public half in ``ticket.pub`` (0644) for aggregators."""
    d = Path(directory)
    pem = _load_or_create(
        d / TICKET_KEY_FILE,
        lambda: ed25519.Ed25519PrivateKey.generate().private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        ),
    )
    key = serialization.load_pem_private_key(pem, password=None)
    if not isinstance(key, ed25519.Ed25519PrivateKey):
        raise ValueError(f"{d / TICKET_KEY_FILE} is not an Ed25519 private key")
    pub = key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    pub_path = d / TICKET_PUB_FILE
    if not pub_path.exists() or pub_path.read_bytes() != pub:
        write_new(pub_path, pub, 0o644, replace=True)
    return key


def load_ticket_public_key(path: str | os.PathLike[str]) -> ed25519.Ed25519PublicKey:
    """An Ed25519 public key from a PEM file (``ticket.pub``) or a 32-byte raw file."""
    data = Path(path).read_bytes()
    if len(data) == 32:
        return ed25519.Ed25519PublicKey.from_public_bytes(data)
    key = serialization.load_pem_public_key(data)
    if not isinstance(key, ed25519.Ed25519PublicKey):
        raise ValueError(f"{path} is not an Ed25519 public key")
    return key


def _load_or_create(path: Path, make: Callable[[], bytes]) -> bytes:
    if path.exists():
        return path.read_bytes()
    private_dir(path.parent)
    try:
        write_new(path, make(), 0o600, replace=False)
    except FileExistsError:  # another process won the race: use its file
        pass
    return path.read_bytes()


# -- helpers -------------------------------------------------------------------------------------


def _b64e(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _b64d(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _epoch(epoch: object) -> int:
    if not isinstance(epoch, int) or isinstance(epoch, bool) or not 0 <= epoch < 2**64:
        raise ValueError("leader_epoch must be an integer in [0, 2^64)")
    return epoch


def _finite(x: object) -> bool:
    return _number(x) and math.isfinite(x)  # type: ignore[arg-type]


def _number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _check_id(value: object, what: str) -> None:
    if not isinstance(value, str) or not value or len(value) > MAX_ID_CHARS:
        raise ValueError(f"{what} must be a non-empty string of at most {MAX_ID_CHARS} characters")


def _unauth(message: str) -> AuthError:
    return AuthError("UNAUTHENTICATED", message)


def _denied(message: str) -> AuthError:
    return AuthError("PERMISSION_DENIED", message)
