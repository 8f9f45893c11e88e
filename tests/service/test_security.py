"""Transport security and credentials: real TLS handshakes against a real gRPC server with
certificates from `tally certs`, plaintext refused off loopback, device tokens and session tickets
that reject every forgery, truncation and expiry."""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import ipaddress
import socket
import ssl
import stat
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519
from cryptography.x509.oid import ExtendedKeyUsageOID
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tally.cli import certs as certs_cli
from tally.security import (
    AuthError,
    SessionTicket,
    TicketSigner,
    TicketVerifier,
    TLSConfig,
    TokenIssuer,
    bearer_metadata,
    bind,
    certs,
    channel_options,
    config_digest,
    is_loopback_host,
    load_or_create_ticket_key,
    load_or_create_token_secret,
    load_ticket_public_key,
    open_channel,
    token_from_metadata,
)
from tally.security.certs import POD_ORDINALS
from tally.security.tls import (
    add_tls_arguments,
    peer_identity,
    server_options,
    target_hosts,
    tls_config_from_args,
)

TIMEOUT = 5.0


# -- fixtures ------------------------------------------------------------------------------------


def _run_certs(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="tally")
    sub = parser.add_subparsers(dest="command", required=True)
    certs_cli.register(sub)
    args = parser.parse_args(argv)
    return args.run(args)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    out = tmp_path_factory.mktemp("pki")
    assert _run_certs(["certs", "--out", str(out), "--namespace", "prod", "--dns", "fl.example.org",
                       "--ip", "10.1.2.3", "--days", "30"]) == 0
    return out


@pytest.fixture(scope="module")
def other_pki(tmp_path_factory):
    out = tmp_path_factory.mktemp("other")
    certs.write_deployment(out)
    return out


def _who(request: bytes, context: grpc.ServicerContext) -> bytes:
    return (peer_identity(context) or "-").encode()


def _start(config: TLSConfig, address: str = "127.0.0.1:0"):
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=channel_options(1 << 20))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    server.add_generic_rpc_handlers(
        [grpc.method_handlers_generic_handler("test.Who", {"Am": grpc.unary_unary_rpc_method_handler(_who)})]
    )
    port = bind(server, address, config)
    server.start()
    return server, port


@pytest.fixture
def tls_server(pki):
    server, port = _start(TLSConfig.from_dir(pki / "aggregator-1", "aggregator"))
    yield port
    server.stop(None)


@pytest.fixture
def mtls_server(pki):
    server, port = _start(TLSConfig.from_dir(pki / "aggregator-1", "aggregator", require_client_auth=True))
    yield port
    server.stop(None)


def _check(target: str, config: TLSConfig) -> int:
    with open_channel(target, config, options=channel_options(1 << 20)) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=TIMEOUT
        )
        return reply.status


def _fails_with(target: str, config: TLSConfig) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as err:
        _check(target, config)
    return err.value.code()


# -- real TLS ------------------------------------------------------------------------------------


@pytest.mark.parametrize("host", ["localhost", "127.0.0.1"])
def test_tls_health_check_verifies_ca_and_san(pki, tls_server, host):
    status = _check(f"{host}:{tls_server}", TLSConfig.from_dir(pki / "device", None))
    assert status == health_pb2.HealthCheckResponse.SERVING


def test_tls_kubernetes_service_name_verified(pki, tls_server):
    config = TLSConfig(ca=pki / "ca" / "ca.pem", server_name="tally-aggregator.prod.svc")
    assert _check(f"127.0.0.1:{tls_server}", config) == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.parametrize("pod", [0, 1, POD_ORDINALS - 1])
def test_tls_verifies_each_statefulset_pod_by_the_short_name_pods_dial(pki, tls_server, pod):
    """Pods dial `tally-aggregator-<i>.tally-aggregator`; gRPC refuses a wildcard over the one-label
    `tally-aggregator`, so each pod's name is in the certificate (the dev overlay's containers
    failed every session with `*.tally-aggregator`)."""
    config = TLSConfig(ca=pki / "ca" / "ca.pem", server_name=f"tally-aggregator-{pod}.tally-aggregator")
    assert _check(f"127.0.0.1:{tls_server}", config) == health_pb2.HealthCheckResponse.SERVING
    beyond = TLSConfig(ca=pki / "ca" / "ca.pem", server_name=f"tally-aggregator-{POD_ORDINALS}.tally-aggregator")
    assert _fails_with(f"127.0.0.1:{tls_server}", beyond) == grpc.StatusCode.UNAVAILABLE


def test_tls_wrong_ca_is_unavailable(other_pki, tls_server):
    assert _fails_with(f"localhost:{tls_server}", TLSConfig.from_dir(other_pki / "device", None)) == (
        grpc.StatusCode.UNAVAILABLE
    )


def test_tls_wrong_server_name_is_unavailable(pki, tls_server):
    # The aggregator's certificate does not vouch for the coordinator's name.
    config = TLSConfig(ca=pki / "ca" / "ca.pem", server_name="tally-coordinator.prod.svc")
    assert _fails_with(f"127.0.0.1:{tls_server}", config) == grpc.StatusCode.UNAVAILABLE


def _served_certificate(port: int, ca: Path) -> bytes:
    """The DER certificate the server presents in a fresh TLS handshake."""
    context = ssl.create_default_context(cafile=str(ca))
    context.set_alpn_protocols(["h2"])
    with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT) as raw:
        with context.wrap_socket(raw, server_hostname="localhost") as tls:
            return tls.getpeercert(binary_form=True)


def test_a_renewed_certificate_is_served_without_a_restart(tmp_path):
    """Issue 7: cert-manager renews before expiry by rewriting the mounted files. New handshakes
    get the new certificate at once; a connection already open keeps working; a half-written
    renewal (a new certificate beside the old key) is not served."""
    certs.write_deployment(tmp_path)
    served = tmp_path / "aggregator-1"
    ca_key = serialization.load_pem_private_key((tmp_path / "ca" / "ca.key").read_bytes(), None)
    ca_cert = certs.load_certificate(tmp_path / "ca" / "ca.pem")

    def renewed() -> tuple[bytes, bytes]:
        key, cert = certs.make_leaf(ca_key, ca_cert, "tally-aggregator-1", server=True,
                                    dns=["localhost"], ips=[ipaddress.ip_address("127.0.0.1")])
        return (cert.public_bytes(serialization.Encoding.PEM),
                key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()))

    server, port = _start(TLSConfig.from_dir(served, "aggregator"))
    try:
        first = (served / "aggregator.pem").read_bytes()
        assert _served_certificate(port, served / "ca.pem") == ssl.PEM_cert_to_DER_cert(first.decode())
        with open_channel(f"localhost:{port}", TLSConfig.from_dir(tmp_path / "device", None)) as open_one:
            health_check = health_pb2_grpc.HealthStub(open_one).Check
            health_check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT)

            cert_pem, key_pem = renewed()
            certs.write_file_atomic(served / "aggregator.key", key_pem, 0o600)
            certs.write_file_atomic(served / "aggregator.pem", cert_pem, 0o644)
            assert _served_certificate(port, served / "ca.pem") == ssl.PEM_cert_to_DER_cert(cert_pem.decode())
            assert health_check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT).status == \
                health_pb2.HealthCheckResponse.SERVING  # the open connection was not cut

            half, _ = renewed()  # a certificate whose key has not been written yet
            certs.write_file_atomic(served / "aggregator.pem", half, 0o644)
            assert _served_certificate(port, served / "ca.pem") == ssl.PEM_cert_to_DER_cert(cert_pem.decode())
    finally:
        server.stop(None)


def test_plaintext_client_cannot_talk_to_tls_server(tls_server):
    assert _fails_with(f"127.0.0.1:{tls_server}", TLSConfig.plaintext()) == grpc.StatusCode.UNAVAILABLE


def test_mtls_rejects_client_without_certificate(pki, mtls_server):
    assert _fails_with(f"localhost:{mtls_server}", TLSConfig.from_dir(pki / "device", None)) == (
        grpc.StatusCode.UNAVAILABLE
    )


def test_mtls_rejects_client_cert_from_other_ca(other_pki, pki, mtls_server):
    config = TLSConfig(ca=pki / "ca" / "ca.pem", cert=other_pki / "coordinator" / "coordinator.pem",
                       key=other_pki / "coordinator" / "coordinator.key")
    assert _fails_with(f"localhost:{mtls_server}", config) == grpc.StatusCode.UNAVAILABLE


def test_mtls_accepts_client_certificate_and_reports_identity(pki, mtls_server):
    config = TLSConfig.from_dir(pki / "coordinator", "coordinator")
    assert _check(f"localhost:{mtls_server}", config) == health_pb2.HealthCheckResponse.SERVING
    with open_channel(f"localhost:{mtls_server}", config) as channel:
        who = channel.unary_unary("/test.Who/Am")(b"", timeout=TIMEOUT)
    assert who == b"tally-coordinator"


def test_plaintext_loopback_server_works():
    server, port = _start(TLSConfig.plaintext(), "127.0.0.1:0")
    try:
        assert _check(f"127.0.0.1:{port}", TLSConfig.plaintext()) == health_pb2.HealthCheckResponse.SERVING
    finally:
        server.stop(None)


@pytest.mark.parametrize(
    "address", ["0.0.0.0:0", "[::]:0", ":0", "10.1.2.3:0", "192.168.0.1:50051", "example.org:0",
                "tally-aggregator:0"],
)
def test_insecure_bind_refused_off_loopback(address):
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    with pytest.raises(ValueError, match="loopback"):
        bind(server, address, TLSConfig.plaintext())
    server.stop(None)


@pytest.mark.parametrize(
    "target", ["10.0.0.1:1", "tally-aggregator:50051", "dns:///example.org:443", "0.0.0.0:1",
               "ipv4:127.0.0.1:1,10.0.0.1:1", "[2001:db8::1]:1"],
)
def test_insecure_channel_refused_off_loopback(target):
    with pytest.raises(ValueError, match="loopback"):
        open_channel(target, TLSConfig.plaintext())


@pytest.mark.parametrize(
    "target", ["127.0.0.1:1", "localhost:1", "[::1]:1", "127.9.9.9:1", "dns:///localhost:1",
               "ipv4:127.0.0.1:1,127.0.0.2:1", "ipv6:[::1]:1", "unix:/tmp/tally.sock"],
)
def test_insecure_channel_allowed_to_loopback(target):
    open_channel(target, TLSConfig.plaintext()).close()


def test_loopback_detection():
    for host in ["localhost", "LOCALHOST", "127.0.0.1", "127.255.0.1", "::1", "[::1]", "::ffff:127.0.0.1"]:
        assert is_loopback_host(host), host
    for host in ["0.0.0.0", "::", "", "10.0.0.1", "localhost.example.org", "128.0.0.1", "example"]:
        assert not is_loopback_host(host), host
    assert target_hosts("dns://8.8.8.8/example.org:443") == ["example.org"]
    assert target_hosts("unix-abstract:tally") == [None]


def test_tls_config_validation_and_args(pki):
    with pytest.raises(ValueError):
        TLSConfig(insecure=True, ca=pki / "ca.pem")
    with pytest.raises(ValueError):
        TLSConfig(cert=pki / "client.pem")
    with pytest.raises(ValueError):
        TLSConfig(cert=pki / "aggregator.pem", key=pki / "aggregator.key", require_client_auth=True)
    with pytest.raises(ValueError, match="cannot read"):
        _check("localhost:1", TLSConfig(ca=pki / "missing.pem"))
    assert channel_options(1024) == [
        ("grpc.max_send_message_length", 1024), ("grpc.max_receive_message_length", 1024)
    ]
    with pytest.raises(ValueError):
        channel_options(0)

    parser = argparse.ArgumentParser()
    add_tls_arguments(parser, "aggregator", server=True)
    role_dir = pki / "aggregator-1"
    cfg = tls_config_from_args(parser.parse_args(["--tls-dir", str(role_dir), "--require-client-cert"]))
    assert cfg == TLSConfig.from_dir(role_dir, "aggregator", require_client_auth=True)
    with pytest.raises(ValueError, match="--tls-dir: .* has no ca.pem"):  # the deployment's root, not a role's
        tls_config_from_args(parser.parse_args(["--tls-dir", str(pki)]))
    assert tls_config_from_args(parser.parse_args(["--insecure"])).insecure
    # Each side has only the flag that means something to it.
    client = argparse.ArgumentParser()
    add_tls_arguments(client, None)
    parsed = client.parse_args(["--tls-dir", str(pki / "device"), "--server-name", "x"])
    assert tls_config_from_args(parsed).server_name == "x"
    for side, flag in ((parser, "--server-name"), (client, "--require-client-cert")):
        with pytest.raises(SystemExit):
            side.parse_args([flag, *(["x"] if flag == "--server-name" else [])])


def test_a_second_service_cannot_take_a_port_in_use(tmp_path):
    """Issue 9, item 1: gRPC's default SO_REUSEPORT let a second coordinator or aggregator bind
    a port in use and silently take half its connections. Both services now refuse."""
    from tally.aggregator import AggregatorService
    from tally.coordinator.service import CoordinatorService

    first = grpc.server(futures.ThreadPoolExecutor(max_workers=1), options=server_options())
    port = bind(first, "127.0.0.1:0", TLSConfig.plaintext())
    first.start()
    try:
        second = grpc.server(futures.ThreadPoolExecutor(max_workers=1), options=server_options())
        with pytest.raises(RuntimeError, match=f"could not bind '127.0.0.1:{port}'"):
            bind(second, f"127.0.0.1:{port}", TLSConfig.plaintext())

        async def start_services():
            key = load_or_create_ticket_key(tmp_path / "s")
            aggregator = AggregatorService(f"127.0.0.1:{port}", TLSConfig.plaintext(),
                                           key.public_key(), "agg")
            with pytest.raises(RuntimeError, match="another service"):
                await aggregator.start()
            coordinator = CoordinatorService(f"127.0.0.1:{port}", TLSConfig.plaintext(), tmp_path / "s", [])
            with pytest.raises(RuntimeError, match="another service"):
                await coordinator.start()
            await coordinator.stop(grace=0)

        asyncio.run(start_services())
    finally:
        first.stop(None)


# -- certificates and the CLI --------------------------------------------------------------------


def test_certs_cli_writes_files_with_permissions(pki):
    for name in certs.deployment_files():
        mode = stat.S_IMODE((pki / name).stat().st_mode)
        secret = name.endswith((".key", ".secret"))
        assert mode == (0o600 if secret else 0o644), (name, oct(mode))
        assert stat.S_IMODE((pki / name).parent.stat().st_mode) == 0o700


def test_each_role_gets_its_own_identity_and_only_its_own_secrets(tmp_path):
    """Attack 12: aggregators receive no CA key, ticket key, token secret or enrolment key, each
    aggregator has its own key pair, and devices the CA only."""
    certs.write_deployment(tmp_path, aggregators=3)
    roles = {p.name: {f.name for f in p.iterdir()} for p in tmp_path.iterdir()}
    assert set(roles) == {"ca", "coordinator", "aggregator-1", "aggregator-2", "aggregator-3", "device"}
    secrets_ = {"ca.key", "ticket.key", "token.secret", "enrolment.key"}
    for role, files in roles.items():
        if role.startswith("aggregator-"):
            assert files == {"ca.pem", "aggregator.pem", "aggregator.key", "ticket.pub"}
        if role != "coordinator":
            assert not files & (secrets_ - {"ca.key"}), role
        if role != "ca":
            assert "ca.key" not in files, role
    keys = {(tmp_path / f"aggregator-{i}" / "aggregator.key").read_bytes() for i in (1, 2, 3)}
    assert len(keys) == 3
    names = {role: certs.load_certificate(tmp_path / role / f"{stem}.pem").subject.rfc4514_string()
             for role, stem in (("coordinator", "coordinator"), ("aggregator-2", "aggregator"))}
    assert names == {"coordinator": "CN=tally-coordinator,O=Tally", "aggregator-2": "CN=tally-aggregator-2,O=Tally"}
    # No secret is shared by every device: they get the CA, nothing else (issue 23, finding 9).
    assert sorted(p.name for p in (tmp_path / "device").iterdir()) == ["ca.pem"]


def test_a_new_output_directory_is_private(tmp_path):
    out = tmp_path / "fresh"
    certs.write_deployment(out)
    assert stat.S_IMODE(out.stat().st_mode) == 0o700


def test_certificate_contents(pki):
    ca = certs.load_certificate(pki / "ca" / "ca.pem")
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    leaf = certs.load_certificate(pki / "aggregator-1" / "aggregator.pem")
    assert leaf.issuer == ca.subject
    san = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    names = set(san.get_values_for_type(x509.DNSName))
    assert {"localhost", "tally-aggregator", "tally-aggregator.prod.svc", "fl.example.org"} <= names
    assert not any("coordinator" in n for n in names)
    assert set(san.get_values_for_type(x509.IPAddress)) >= {
        ipaddress.ip_address("127.0.0.1"), ipaddress.ip_address("10.1.2.3")
    }
    eku = leaf.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(eku) == [ExtendedKeyUsageOID.SERVER_AUTH]
    life = leaf.not_valid_after_utc - leaf.not_valid_before_utc
    assert dt.timedelta(days=30) <= life <= dt.timedelta(days=30, minutes=10)
    coord = certs.load_certificate(pki / "coordinator" / "coordinator.pem")
    assert "tally-coordinator.prod.svc" in coord.extensions.get_extension_for_class(
        x509.SubjectAlternativeName
    ).value.get_values_for_type(x509.DNSName)
    eku = coord.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(eku) == [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]


def test_certs_cli_refuses_overwrite_without_force(tmp_path, capsys):
    out = tmp_path / "pki"
    assert _run_certs(["certs", "--out", str(out)]) == 0
    before = {n: (out / n).read_bytes() for n in certs.deployment_files()}
    assert _run_certs(["certs", "--out", str(out)]) == 1
    assert "--force" in capsys.readouterr().err
    assert {n: (out / n).read_bytes() for n in certs.deployment_files()} == before
    # A single stray file is enough to refuse, and nothing else gets written.
    lone = tmp_path / "lone"
    lone.mkdir()
    (lone / "device").mkdir()
    (lone / "device" / "ca.pem").write_text("mine")
    assert _run_certs(["certs", "--out", str(lone)]) == 1
    assert sorted(str(p.relative_to(lone)) for p in lone.rglob("*")) == ["device", "device/ca.pem"]
    assert _run_certs(["certs", "--out", str(out), "--force"]) == 0
    assert (out / "ca" / "ca.pem").read_bytes() != before["ca/ca.pem"]
    assert stat.S_IMODE((out / "ca" / "ca.key").stat().st_mode) == 0o600
    assert not [p for p in out.rglob("*") if p.name.endswith(".tmp")]


def test_certs_cli_help_and_bad_input(tmp_path, capsys):
    with pytest.raises(SystemExit) as done:
        _run_certs(["certs", "--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--out", "--namespace", "--dns", "--ip", "--days", "--aggregators", "--force"):
        assert flag in text
    with pytest.raises(SystemExit):
        _run_certs(["certs", "--out", str(tmp_path), "--days", "0"])
    assert _run_certs(["certs", "--out", str(tmp_path / "a"), "--ip", "not-an-ip"]) == 1
    assert _run_certs(["certs", "--out", str(tmp_path / "b"), "--dns", "bad_name!"]) == 1
    assert _run_certs(["certs", "--out", str(tmp_path / "c"), "--namespace", "Bad.NS"]) == 1


# -- device tokens -------------------------------------------------------------------------------

SECRET = bytes(range(32))
NOW = 1_700_000_000.0


def test_token_round_trip():
    issuer = TokenIssuer(SECRET)
    token = issuer.issue("device-7", "phones-eu", ttl_s=3600, now=NOW)
    claims = issuer.verify(token, now=NOW + 10)
    assert (claims.device_id, claims.population) == ("device-7", "phones-eu")
    assert claims.issued_at == NOW and claims.expires_at == NOW + 3600
    assert issuer.issue("device-7", "phones-eu", 3600, NOW) != token  # unique token ids
    assert token_from_metadata(bearer_metadata(token)) == token


def test_token_expired_and_not_yet_valid():
    issuer = TokenIssuer(SECRET)
    token = issuer.issue("d", "p", ttl_s=60, now=NOW)
    issuer.verify(token, now=NOW + 59.9)
    for late in (NOW + 60, NOW + 1e6):
        with pytest.raises(AuthError, match="expired") as err:
            issuer.verify(token, now=late)
        assert err.value.status == "UNAUTHENTICATED"
        assert err.value.code == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(AuthError, match="not yet valid"):
        issuer.verify(token, now=NOW - 3600)


def test_token_forged_or_malformed():
    issuer = TokenIssuer(SECRET)
    token = issuer.issue("d", "p", ttl_s=60, now=NOW)
    other = TokenIssuer(bytes(32))
    for bad in [
        other.issue("d", "p", ttl_s=60, now=NOW),  # another coordinator's secret
        "", "x", "a.b", "a.b.c.d", token + ".", token.replace("tly1", "tly2", 1),
        token[:-1], token + "A", token.replace(".", "!", 1), "é" * 10, "A" * 5000,
    ]:
        with pytest.raises(AuthError) as err:
            issuer.verify(bad, now=NOW)
        assert err.value.status == "UNAUTHENTICATED"
    with pytest.raises(AuthError):
        issuer.verify(None, now=NOW)  # type: ignore[arg-type]
    with pytest.raises(AuthError, match="missing"):
        token_from_metadata([("authorization", "Basic abc")])
    with pytest.raises(ValueError):
        TokenIssuer(b"short")
    with pytest.raises(ValueError):
        issuer.issue("", "p", 60, NOW)
    with pytest.raises(ValueError):
        issuer.issue("d", "p", 0, NOW)


def test_token_secret_rotation():
    old, new = TokenIssuer(b"o" * 32), TokenIssuer(b"n" * 32, previous=[b"o" * 32])
    token = old.issue("d", "p", 60, NOW)
    assert new.verify(token, NOW).device_id == "d"
    with pytest.raises(AuthError):
        TokenIssuer(b"n" * 32).verify(token, NOW)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    device_id=st.text(min_size=1, max_size=64),
    population=st.text(min_size=1, max_size=32),
    ttl=st.floats(min_value=0.001, max_value=1e7),
    data=st.data(),
)
def test_token_property(device_id, population, ttl, data):
    issuer = TokenIssuer(SECRET)
    token = issuer.issue(device_id, population, ttl, NOW)
    claims = issuer.verify(token, NOW)
    assert (claims.device_id, claims.population) == (device_id, population)
    # Any single changed character is rejected.
    i = data.draw(st.integers(0, len(token) - 1))
    c = data.draw(st.sampled_from("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_.=+/"))
    tampered = token[:i] + c + token[i + 1 :]
    if tampered != token:
        with pytest.raises(AuthError):
            issuer.verify(tampered, NOW)


# -- session tickets -----------------------------------------------------------------------------


def _ticket(**over) -> SessionTicket:
    base = dict(
        job_id="job-1", round=42, session_id="s-9", sum_ids=("losses", "updates"), cohort_size=250,
        config_digest=config_digest(b"cfg"), aggregator_id="agg-0", expires_at=NOW + 300,
    )
    base.update(over)
    return SessionTicket(**base)


@pytest.fixture(scope="module")
def signer():
    return TicketSigner(ed25519.Ed25519PrivateKey.generate())


def test_ticket_round_trip(signer):
    ticket = _ticket()
    blob = signer.sign(ticket)
    assert signer.verifier().verify(blob, NOW) == ticket
    assert TicketVerifier(signer.public_key).verify(blob, NOW, aggregator_id="agg-0") == ticket
    with pytest.raises(AuthError, match="another aggregator") as err:
        signer.verifier().verify(blob, NOW, aggregator_id="agg-1")
    assert err.value.status == "PERMISSION_DENIED"


def test_ticket_forged_wrong_key_expired_truncated(signer):
    verifier = signer.verifier()
    blob = signer.sign(_ticket())
    wrong = TicketSigner(ed25519.Ed25519PrivateKey.generate())
    cases = {
        "wrong key": wrong.sign(_ticket()),
        "forged signature": blob[:-1] + bytes([blob[-1] ^ 1]),
        "changed job id": blob.replace(b"job-1", b"job-2"),
        "expired": signer.sign(_ticket(expires_at=NOW)),
        "empty": b"",
        "not bytes": "ticket",
    }
    for n in range(0, len(blob), 7):
        cases[f"truncated {n}"] = blob[:n]
    cases["extended"] = blob + b"\0"
    for what, bad in cases.items():
        with pytest.raises(AuthError) as err:
            verifier.verify(bad, NOW)  # type: ignore[arg-type]
        assert err.value.status == "PERMISSION_DENIED", what
        assert err.value.code == grpc.StatusCode.PERMISSION_DENIED
    with pytest.raises(AuthError, match="expired"):
        verifier.verify(blob, NOW + 300)


@settings(max_examples=40, deadline=None)
@given(i=st.integers(min_value=0), bit=st.integers(0, 7))
def test_ticket_any_bit_flip_rejected(signer, i, bit):
    blob = bytearray(signer.sign(_ticket()))
    blob[i % len(blob)] ^= 1 << bit
    with pytest.raises(AuthError):
        signer.verifier().verify(bytes(blob), NOW)


def test_ticket_refuses_invalid_fields(signer):
    for bad in [dict(sum_ids=()), dict(sum_ids=("a", "a")), dict(cohort_size=0), dict(round=-1),
                dict(job_id=""), dict(expires_at=float("inf")), dict(config_digest=b"x" * 70000)]:
        with pytest.raises(ValueError):
            signer.sign(_ticket(**bad))


# -- persistence ---------------------------------------------------------------------------------


def test_key_persistence(tmp_path):
    d = tmp_path / "state"
    secret = load_or_create_token_secret(d)
    assert len(secret) == 32 and load_or_create_token_secret(d) == secret
    key = load_or_create_ticket_key(d)
    again = load_or_create_ticket_key(d)
    blob = TicketSigner(key).sign(_ticket())
    assert TicketVerifier(again.public_key()).verify(blob, NOW).job_id == "job-1"
    assert TicketVerifier(load_ticket_public_key(d / "ticket.pub")).verify(blob, NOW).round == 42
    assert stat.S_IMODE((d / "token.secret").stat().st_mode) == 0o600
    assert stat.S_IMODE((d / "ticket.key").stat().st_mode) == 0o600
    assert not [p for p in d.iterdir() if p.name.endswith(".tmp")]


def test_certs_keys_work_with_persistence_helpers(pki):
    key = load_or_create_ticket_key(pki / "coordinator")  # written by `tally certs`, only read here
    blob = TicketSigner(key).sign(_ticket())
    assert TicketVerifier(load_ticket_public_key(pki / "aggregator-1" / "ticket.pub")).verify(blob, NOW)
    issuer = TokenIssuer(load_or_create_token_secret(pki / "coordinator"))
    assert issuer.verify(issuer.issue("d", "p", 60, NOW), NOW).device_id == "d"
