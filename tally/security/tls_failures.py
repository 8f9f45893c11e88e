"""TLS handshake failures in words an operator acts on.

gRPC reports a failed handshake as ``UNAVAILABLE: failed to connect to all addresses`` with the
TLS library's message buried in the details (``CERTIFICATE_VERIFY_FAILED: unable to get local
issuer certificate``), which reads like a dead address. A client names the actual cause (wrong
CA, wrong name, expired) so the operator fixes the certificate instead of the network.
"""

from __future__ import annotations

_NOT_ACCEPTED = "the server's certificate was not accepted"
_HANDSHAKE_FAILED = "the TLS handshake failed"
# (text in gRPC's status details, what it means), the first match wins: the specific causes
# before the generic handshake failure.
_CAUSES = (
    ("certificate has expired", "the server's certificate has expired (renew it: `tally certs`)"),
    ("certificate is not yet valid", "the server's certificate is not valid yet (compare the clocks)"),
    ("unable to get local issuer certificate",
     "the server's certificate is not signed by the CA this client trusts (wrong --tls-dir or CA)"),
    ("self signed certificate", "the server's certificate is not signed by the CA this client trusts "
     "(wrong --tls-dir or CA)"),
    ("Hostname Verification Check failed",
     "the server's certificate does not name the host dialled (dial a name it has, or add this one: "
     "`tally certs --dns/--ip`)"),
    ("WRONG_VERSION_NUMBER", "the server does not speak TLS (is it started with --insecure?)"),
    ("CERTIFICATE_VERIFY_FAILED", _NOT_ACCEPTED),
    # The peer closed the connection after the ClientHello: what a gateway that routes by SNI
    # (TLS passthrough) does with a name it has no route for.
    ("Handshake read failed", "the connection was closed during the handshake: a gateway routing by name "
     "(SNI) has no route for the name dialled, or nothing serves it (dial a name the gateway routes)"),
    ("handshake failed", _HANDSHAKE_FAILED),
)


def tls_failure(details: str) -> str | None:
    """What went wrong, when gRPC status ``details`` say a TLS handshake failed; else None."""
    for needle, meaning in _CAUSES:
        if needle in details:
            return f"TLS: {meaning}"
    return None


def specificity(error: str) -> int:
    """How much a retried call's error (``"Register: UNAVAILABLE (TLS: ...)"``) tells an operator:
    a named TLS cause (wrong CA, wrong name, expired) 3, a TLS failure without one 2, anything else
    1, nothing 0. A device keeps the most specific error it met, not the latest: once a handshake
    has failed, gRPC's later attempts may end in a bare ``UNAVAILABLE`` that reads like a dead
    address (issue 39)."""
    if not error:
        return 0
    for _, meaning in _CAUSES:
        if f"TLS: {meaning}" in error:
            return 2 if meaning in (_NOT_ACCEPTED, _HANDSHAKE_FAILED) else 3
    return 1
