"""A deployment's private CA and one identity per service.

One CA (ECDSA P-256, which every gRPC/BoringSSL build and every client library accepts) signs a
certificate per role, each in its own directory, so each machine receives only what it needs and
every party is told apart by its certificate:

- ``ca/``: ``ca.pem`` and ``ca.key``, the only copy of the CA key (keep it offline);
- ``coordinator/``: ``coordinator.pem``/``.key`` (CN ``tally-coordinator``, serverAuth for devices
  and operators, clientAuth toward aggregators, whose control API admits this CN only), the
  session-ticket key pair, the device-token secret and the enrolment key;
- ``aggregator-<i>/`` (one per aggregator): its own ``aggregator.pem``/``.key`` (CN
  ``tally-aggregator-<i>``, serverAuth) and ``ticket.pub``; no CA key and no coordinator secret,
  so a compromised aggregator can neither mint certificates nor tickets nor device tokens;
- ``device/``: ``ca.pem`` only. No secret is shared by every device: a device checks the servers
  against the CA and authenticates itself with its own enrolled identity key (coordinator) and,
  per session, the coordinator's signed ticket and a per-session token (the Join in its
  aggregator stream's metadata). Revoking one device touches no other.

Server certificates cover loopback (``localhost``, ``127.0.0.1``, ``::1``), the Kubernetes service
names of their role (``tally-<role>``, ``tally-<role>.<ns>``, ``tally-<role>.<ns>.svc``,
``tally-<role>.<ns>.svc.cluster.local``, plus ``*.tally-<role>.<ns>.svc`` and the first
``POD_ORDINALS`` short pod names ``tally-<role>-<i>.tally-<role>`` for the pods of a headless
service) and whatever DNS names and IP addresses the operator adds. Every role directory holds
``ca.pem`` and the role's default file names, so ``--tls-dir <out>/<role>`` just works.
Certificates are written 0644, keys and secrets 0600, directories 0700, and nothing is overwritten
unless ``force`` is given (nothing at all is written when any target exists).
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import secrets
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from tally.security.enrolment import ENROLMENT_KEY_FILE
from tally.security.files import write_new

SERVER_ROLES = ("coordinator", "aggregator")
COORDINATOR_CN = "tally-coordinator"
DEVICE_ROLE = "device"
DEFAULT_NAMESPACE = "tally"
# StatefulSet pods behind a headless Service are dialled as ``tally-<role>-<i>.tally-<role>``; a
# wildcard cannot stand for them, since TLS clients (gRPC's among them) refuse a wildcard over a
# one-label domain such as ``*.tally-aggregator``. Server certificates name the first this many.
POD_ORDINALS = 16
DEFAULT_DAYS = 365
LOOPBACK_DNS = ("localhost",)
LOOPBACK_IPS = ("127.0.0.1", "::1")
CLOCK_SKEW = dt.timedelta(minutes=5)  # certificates are valid from a little before "now"

# File names inside the output directory.
CA_CERT, CA_KEY = "ca.pem", "ca.key"
TICKET_KEY, TICKET_PUB, TOKEN_SECRET = "ticket.key", "ticket.pub", "token.secret"


class CertificateError(ValueError):
    """Bad input to certificate generation, or a refusal to overwrite existing files."""


@dataclass(frozen=True)
class Deployment:
    """What ``write_deployment`` wrote: file name -> path, and the names each server cert covers."""

    directory: Path
    files: dict[str, Path]
    server_names: dict[str, tuple[str, ...]] = field(default_factory=dict)
    not_after: dt.datetime | None = None


def service_names(role: str, namespace: str = DEFAULT_NAMESPACE) -> list[str]:
    """Kubernetes DNS names of the ``tally-<role>`` Service in ``namespace``."""
    _check_dns_label(namespace, "namespace")
    svc = f"tally-{role}"
    return [
        svc,
        *(f"{svc}-{i}.{svc}" for i in range(POD_ORDINALS)),  # the pods, by the short names pods dial
        f"{svc}.{namespace}",
        f"{svc}.{namespace}.svc",
        f"{svc}.{namespace}.svc.cluster.local",
        f"*.{svc}.{namespace}.svc",
        f"*.{svc}.{namespace}.svc.cluster.local",
    ]


def server_sans(
    role: str,
    namespace: str = DEFAULT_NAMESPACE,
    dns: Iterable[str] = (),
    ips: Iterable[str] = (),
) -> tuple[list[str], list[ipaddress.IPv4Address | ipaddress.IPv6Address]]:
    """The DNS names and IP addresses a server certificate for ``role`` covers (deduplicated)."""
    names = _unique([*LOOPBACK_DNS, *service_names(role, namespace), *(_check_dns(d) for d in dns)])
    addresses = _unique([ipaddress.ip_address(a) for a in (*LOOPBACK_IPS, *(_check_ip(i) for i in ips))])
    return names, addresses


def make_ca(
    *, namespace: str = DEFAULT_NAMESPACE, days: int = DEFAULT_DAYS, now: dt.datetime | None = None
) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    """A fresh self-signed CA that may sign leaf certificates only (path length 0)."""
    _check_days(days)
    start = _now(now) - CLOCK_SKEW
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Tally"),
            x509.NameAttribute(NameOID.COMMON_NAME, f"Tally deployment CA ({namespace})"),
        ]
    )
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(start + CLOCK_SKEW + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True, content_commitment=False, key_encipherment=False,
                data_encipherment=False, key_agreement=False, key_cert_sign=True, crl_sign=True,
                encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(ski, critical=False)
        .sign(key, hashes.SHA256())
    )
    return key, cert


def make_leaf(
    ca_key: ec.EllipticCurvePrivateKey,
    ca_cert: x509.Certificate,
    common_name: str,
    *,
    server: bool,
    client: bool = False,
    dns: Sequence[str] = (),
    ips: Sequence[ipaddress.IPv4Address | ipaddress.IPv6Address] = (),
    days: int = DEFAULT_DAYS,
    now: dt.datetime | None = None,
) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    """A leaf certificate signed by the CA for serverAuth and/or clientAuth.

    Its validity never outlasts the CA's."""
    _check_days(days)
    start = _now(now) - CLOCK_SKEW
    end = min(start + CLOCK_SKEW + dt.timedelta(days=days), ca_cert.not_valid_after_utc)
    key = ec.generate_private_key(ec.SECP256R1())
    sans: list[x509.GeneralName] = [x509.DNSName(d) for d in dns]
    sans += [x509.IPAddress(a) for a in ips]
    builder = (
        x509.CertificateBuilder()
        .subject_name(
            x509.Name(
                [
                    x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Tally"),
                    x509.NameAttribute(NameOID.COMMON_NAME, common_name),
                ]
            )
        )
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True, content_commitment=False, key_encipherment=False,
                data_encipherment=False, key_agreement=False, key_cert_sign=False, crl_sign=False,
                encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(
            x509.ExtendedKeyUsage(
                [*([ExtendedKeyUsageOID.SERVER_AUTH] if server else []),
                 *([ExtendedKeyUsageOID.CLIENT_AUTH] if client else [])]
            ),
            critical=False,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
    )
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return key, builder.sign(ca_key, hashes.SHA256())


def aggregator_dir(i: int) -> str:
    return f"aggregator-{i}"


def deployment_files(aggregators: int = 1) -> list[str]:
    """Every file ``write_deployment`` writes, relative to its output directory, in order."""
    names = [f"ca/{CA_CERT}", f"ca/{CA_KEY}"]
    names += [f"coordinator/{n}" for n in (CA_CERT, "coordinator.pem", "coordinator.key", TICKET_KEY,
                                           TICKET_PUB, TOKEN_SECRET, ENROLMENT_KEY_FILE)]
    for i in range(1, aggregators + 1):
        names += [f"{aggregator_dir(i)}/{n}" for n in (CA_CERT, "aggregator.pem", "aggregator.key", TICKET_PUB)]
    return names + [f"{DEVICE_ROLE}/{CA_CERT}"]


def write_deployment(
    out: str | os.PathLike[str],
    *,
    aggregators: int = 1,
    namespace: str = DEFAULT_NAMESPACE,
    dns: Iterable[str] = (),
    ips: Iterable[str] = (),
    days: int = DEFAULT_DAYS,
    force: bool = False,
    now: dt.datetime | None = None,
) -> Deployment:
    """Create the CA and one directory per role in ``out`` (see the module docstring).

    Refuses (``CertificateError``, nothing written) when any target file exists, unless ``force``.
    """
    directory = Path(out)
    dns, ips = list(dns), list(ips)
    _check_days(days)
    if not isinstance(aggregators, int) or aggregators < 1:
        raise CertificateError(f"aggregators must be at least 1, got {aggregators!r}")
    names_by_role = {role: server_sans(role, namespace, dns, ips) for role in SERVER_ROLES}
    targets = [directory / n for n in deployment_files(aggregators)]
    existing = [p for p in targets if p.exists() or p.is_symlink()]
    if existing and not force:
        raise CertificateError(
            f"refusing to overwrite {', '.join(str(p) for p in existing)} (pass --force to replace)"
        )

    stamp = _now(now)
    ca_key, ca_cert = make_ca(namespace=namespace, days=days, now=stamp)
    ca_pem = (_cert_pem(ca_cert), 0o644)

    def leaf(cn: str, role: str | None, *, server: bool, client: bool) -> tuple[tuple[bytes, int], tuple[bytes, int]]:
        names, addresses = names_by_role[role] if role else ([cn], [])
        key, cert = make_leaf(ca_key, ca_cert, cn, server=server, client=client, dns=names, ips=addresses,
                              days=days, now=stamp)
        return (_cert_pem(cert), 0o644), (_key_pem(key), 0o600)

    ticket_key = ed25519.Ed25519PrivateKey.generate()
    ticket_pub = (
        ticket_key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        ),
        0o644,
    )
    cert, key = leaf(COORDINATOR_CN, "coordinator", server=True, client=True)
    contents: dict[str, tuple[bytes, int]] = {
        f"ca/{CA_CERT}": ca_pem,
        f"ca/{CA_KEY}": (_key_pem(ca_key), 0o600),
        f"coordinator/{CA_CERT}": ca_pem,
        "coordinator/coordinator.pem": cert,
        "coordinator/coordinator.key": key,
        f"coordinator/{TICKET_KEY}": (_key_pem(ticket_key), 0o600),
        f"coordinator/{TICKET_PUB}": ticket_pub,
        f"coordinator/{TOKEN_SECRET}": (secrets.token_bytes(32), 0o600),
        f"coordinator/{ENROLMENT_KEY_FILE}": (secrets.token_bytes(32), 0o600),
    }
    for i in range(1, aggregators + 1):
        cert, key = leaf(f"tally-aggregator-{i}", "aggregator", server=True, client=False)
        d = aggregator_dir(i)
        contents.update({f"{d}/{CA_CERT}": ca_pem, f"{d}/aggregator.pem": cert, f"{d}/aggregator.key": key,
                         f"{d}/{TICKET_PUB}": ticket_pub})
    contents[f"{DEVICE_ROLE}/{CA_CERT}"] = ca_pem

    # The output directory too: it holds the CA key and every role's secrets until handed out.
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    files = {}
    for name in deployment_files(aggregators):
        data, mode = contents[name]
        path = directory / name
        path.parent.mkdir(mode=0o700, exist_ok=True)
        files[name] = write_file_atomic(path, data, mode)
    return Deployment(
        directory=directory,
        files=files,
        server_names={
            role: (*names, *(str(a) for a in addrs)) for role, (names, addrs) in names_by_role.items()
        },
        not_after=ca_cert.not_valid_after_utc,
    )


def write_file_atomic(path: Path, data: bytes, mode: int) -> Path:
    """Write ``data`` to ``path`` through a temporary file in the same directory, with ``mode``
    set before any byte is written (a key is never readable by others, even briefly)."""
    write_new(path, data, mode, replace=True)
    return path


def load_certificate(path: str | os.PathLike[str]) -> x509.Certificate:
    return x509.load_pem_x509_certificate(Path(path).read_bytes())


# -- helpers -----------------------------------------------------------------------------------


def _cert_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _key_pem(key: ec.EllipticCurvePrivateKey | ed25519.Ed25519PrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _now(now: dt.datetime | None) -> dt.datetime:
    if now is None:
        return dt.datetime.now(dt.UTC)
    if now.tzinfo is None:
        raise CertificateError("now must be timezone-aware")
    return now.astimezone(dt.UTC)


def _check_days(days: int) -> None:
    if not isinstance(days, int) or isinstance(days, bool) or days < 1:
        raise CertificateError(f"validity must be a positive number of days, got {days!r}")


def _check_dns_label(label: str, what: str) -> None:
    if (
        not label
        or len(label) > 63
        or not all(c.isascii() and (c.isalnum() or c == "-") for c in label)
        or label.startswith("-")
        or label.endswith("-")
    ):
        raise CertificateError(f"{what} {label!r} is not a valid DNS label")


def _check_dns(name: str) -> str:
    name = name.strip().rstrip(".").lower()
    labels = name.split(".")
    if not name or len(name) > 253:
        raise CertificateError(f"DNS name {name!r} is empty or too long")
    for i, label in enumerate(labels):
        if i == 0 and label == "*" and len(labels) > 2:
            continue
        _check_dns_label(label, "DNS name label")
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return name
    raise CertificateError(f"{name!r} is an IP address: pass it with --ip")


def _check_ip(value: str) -> str:
    try:
        return str(ipaddress.ip_address(value.strip()))
    except ValueError:
        raise CertificateError(f"{value!r} is not an IP address") from None


T = TypeVar("T")


def _unique(items: list[T]) -> list[T]:
    return list(dict.fromkeys(items))
