"""TLS for every gRPC channel, plaintext only on loopback.

A ``TLSConfig`` names PEM files (or says ``insecure=True``). The same type serves both ends:

- on a server, ``cert``/``key`` are the server's certificate and key; ``ca`` (when given) verifies
  client certificates, and ``require_client_auth`` makes one mandatory (mutual TLS);
- on a client, ``ca`` verifies the server (system roots when ``None``) and ``cert``/``key``, when
  given, are presented as the client certificate.

``bind`` and ``open_channel`` refuse plaintext (``ValueError``) unless every address involved is a
loopback address (127.0.0.0/8, ::1, ``localhost``) or a Unix domain socket, so ``--insecure`` can
never expose a service on a network interface by accident.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import serialization

DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024

ChannelOptions = Sequence[tuple[str, Any]]


@dataclass(frozen=True)
class TLSConfig:
    ca: Path | None = None
    cert: Path | None = None
    key: Path | None = None
    insecure: bool = False
    require_client_auth: bool = False
    # Client only: the name to verify in the server certificate instead of the target's host
    # (``grpc.ssl_target_name_override``); for tests and for addressing a server by IP without
    # an IP SAN. Leave unset in production.
    server_name: str | None = None

    def __post_init__(self) -> None:
        for name in ("ca", "cert", "key"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, Path):
                object.__setattr__(self, name, Path(value))
        if self.insecure and (self.ca or self.cert or self.key or self.require_client_auth):
            raise ValueError("an insecure TLSConfig cannot also name certificates")
        if (self.cert is None) != (self.key is None):
            raise ValueError("cert and key must be given together")
        if self.require_client_auth and self.ca is None:
            raise ValueError("require_client_auth needs a ca to verify client certificates")

    @classmethod
    def from_dir(
        cls, directory: str | os.PathLike[str], identity: str | None, *, require_client_auth: bool = False
    ) -> TLSConfig:
        """``ca.pem`` plus ``<identity>.pem``/``<identity>.key`` from one role's directory of
        ``tally certs`` output, e.g. ``(out / "device", "device")`` (``identity`` None: CA only, a
        client that presents no certificate)."""
        d = Path(directory)
        if identity is None:
            return cls(ca=d / "ca.pem", require_client_auth=require_client_auth)
        return cls(
            ca=d / "ca.pem", cert=d / f"{identity}.pem", key=d / f"{identity}.key",
            require_client_auth=require_client_auth,
        )

    @classmethod
    def plaintext(cls) -> TLSConfig:
        """No TLS: accepted by ``bind``/``open_channel`` on loopback only."""
        return cls(insecure=True)


def server_credentials(config: TLSConfig) -> grpc.ServerCredentials:
    """Credentials that follow the files: a renewed certificate (cert-manager rewriting a mounted
    Secret, or ``tally certs`` run again) is served from the next handshake on, without a
    restart; connections already open keep theirs, so no session in flight is cut."""
    if config.insecure:
        raise ValueError("server_credentials called with an insecure TLSConfig")
    if config.cert is None or config.key is None:
        raise ValueError("a TLS server needs cert and key")
    files = ServerCertificateFiles(config)
    return grpc.dynamic_ssl_server_credentials(
        # grpc-stubs want the fetcher to return a configuration; gRPC's contract is "or None for
        # no change", which is what ``changed`` returns between renewals.
        files.current, files.changed,  # type: ignore[arg-type]
        require_client_authentication=config.require_client_auth,
    )


class ServerCertificateFiles:
    """The server's key pair and client CA as they are on disk, re-read when one changes.

    gRPC asks ``changed`` at every handshake: it stats the files and, when they differ from what
    it serves, reads them again. A half-written renewal (the new certificate beside the old key)
    is not served: the pair must match, else the current one stays until the next handshake."""

    def __init__(self, config: TLSConfig) -> None:
        self._config = config
        self._stamp = file_stamps(config)
        self.current = self._configuration()

    def _configuration(self) -> grpc.ServerCertificateConfiguration:
        config = self._config
        assert config.cert is not None and config.key is not None
        key, cert = _read(config.key), _read(config.cert)
        if not _pair_matches(key, cert):
            raise ValueError(f"{config.key} is not the key of {config.cert}")
        return grpc.ssl_server_certificate_configuration(
            [(key, cert)], root_certificates=_read(config.ca) if config.ca is not None else None
        )

    def changed(self) -> grpc.ServerCertificateConfiguration | None:
        """A new configuration when the files changed and make a usable pair, else None."""
        try:
            stamp = file_stamps(self._config)
            if stamp == self._stamp:
                return None
            configuration = self._configuration()
        except (OSError, ValueError):
            return None  # mid-renewal, or a broken file: keep serving what works
        self._stamp, self.current = stamp, configuration
        return configuration


def file_stamps(config: TLSConfig) -> tuple[tuple[int, int], ...]:
    """(mtime, size) of the config's files: what tells a renewal (``OSError`` if one is missing)."""
    paths = [p for p in (config.cert, config.key, config.ca) if p is not None]
    return tuple((s.st_mtime_ns, s.st_size) for s in map(os.stat, paths))


def _pair_matches(key_pem: bytes, cert_pem: bytes) -> bool:
    public = serialization.PublicFormat.SubjectPublicKeyInfo
    der = serialization.Encoding.DER
    key = serialization.load_pem_private_key(key_pem, password=None)
    cert = x509.load_pem_x509_certificate(cert_pem)
    return key.public_key().public_bytes(der, public) == cert.public_key().public_bytes(der, public)


def channel_credentials(config: TLSConfig) -> grpc.ChannelCredentials:
    if config.insecure:
        raise ValueError("channel_credentials called with an insecure TLSConfig")
    return grpc.ssl_channel_credentials(
        root_certificates=_read(config.ca) if config.ca is not None else None,
        private_key=_read(config.key) if config.key is not None else None,
        certificate_chain=_read(config.cert) if config.cert is not None else None,
    )


def channel_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    """Explicit send/receive size limits, for channels and servers alike (gRPC's defaults are
    unlimited send and 4 MiB receive; services set both on purpose)."""
    limit = _message_limit("max_message_bytes", max_message_bytes)
    return [("grpc.max_send_message_length", limit), ("grpc.max_receive_message_length", limit)]


def _message_limit(name: str, value: int) -> int:
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def server_options(
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, max_request_bytes: int | None = None,
    *, share_port: bool = False,
) -> list[tuple[str, int]]:
    """``channel_options`` plus exclusive ports: gRPC sets SO_REUSEPORT by default, so a second
    service started on a port in use would share it silently, each getting some connections.
    ``share_port`` is for the processes of one service that mean to share it (the coordinator and
    its device fronts).

    ``max_request_bytes`` caps what the server receives below what it sends: a request is read
    whole before any handler can check who sent it, so this bounds what an anonymous peer can make
    the server buffer."""
    options = dict(channel_options(max_message_bytes))
    if max_request_bytes is not None:
        options["grpc.max_receive_message_length"] = _message_limit("max_request_bytes",
                                                                    max_request_bytes)
    return [*options.items(), ("grpc.so_reuseport", int(share_port))]


def check_listen(address: str, config: TLSConfig) -> None:
    """``ValueError`` unless ``address`` is HOST:PORT (or a unix socket) that ``config`` may serve:
    plaintext only on loopback. Commands call it before anything else, so that a refused bind is
    the first thing they say, not a complaint about some other flag."""
    if not address.startswith("unix") and not re.fullmatch(r".*:\d{1,5}", address):
        raise ValueError(f"{address!r} is not HOST:PORT")
    if config.insecure:
        host = _address_host(address)
        if not (host is None or is_loopback_host(host)):
            raise ValueError(
                f"refusing to serve without TLS on {address!r}: --insecure is allowed only on "
                "loopback addresses (127.0.0.0/8, ::1, localhost) or unix: sockets"
            )


def bind(server: grpc.Server | grpc.aio.Server, address: str, config: TLSConfig) -> int:
    """Add a listening port to ``server``; returns the bound port (useful with ``:0``).

    Plaintext only on loopback; anything else raises ``ValueError`` before binding."""
    check_listen(address, config)
    add: Callable[[str], int]
    if config.insecure:
        add = server.add_insecure_port
    else:
        credentials = server_credentials(config)
        add = lambda a: server.add_secure_port(a, credentials)  # noqa: E731
    try:
        port = add(address)
    except RuntimeError:
        port = 0
    if port == 0 and not address.startswith("unix"):
        raise RuntimeError(f"could not bind {address!r}: is another service listening on it?")
    return port


def open_channel(
    target: str, config: TLSConfig, options: ChannelOptions | None = None
) -> grpc.Channel:
    """A channel to ``target`` with TLS, or plaintext when ``config.insecure`` and the target is a
    loopback address (``ValueError`` otherwise)."""
    return _channel(grpc, target, config, options)


def open_aio_channel(
    target: str, config: TLSConfig, options: ChannelOptions | None = None
) -> grpc.aio.Channel:
    """The asyncio twin of ``open_channel``, under the same loopback-only rule for plaintext."""
    return _channel(grpc.aio, target, config, options)


C = TypeVar("C", grpc.Channel, grpc.aio.Channel)
C_co = TypeVar("C_co", covariant=True)


class _Channels(Protocol[C_co]):
    """What ``_channel`` needs of its ``kind``: the module ``grpc`` or ``grpc.aio``."""

    def insecure_channel(self, target: str, options: ChannelOptions | None = None) -> C_co: ...

    def secure_channel(self, target: str, credentials: grpc.ChannelCredentials,
                       options: ChannelOptions | None = None) -> C_co: ...


def _channel(kind: _Channels[C], target: str, config: TLSConfig, options: ChannelOptions | None) -> C:
    """``kind`` is ``grpc`` or ``grpc.aio``: one rule for both, so they cannot drift apart."""
    opts = list(options or [])
    if config.insecure:
        hosts = target_hosts(target)
        if not hosts or not all(h is None or is_loopback_host(h) for h in hosts):
            raise ValueError(
                f"refusing a plaintext channel to {target!r}: --insecure is loopback only "
                "(127.0.0.0/8, ::1, localhost or unix: sockets)"
            )
        return kind.insecure_channel(target, options=opts)
    if config.server_name:
        opts.append(("grpc.ssl_target_name_override", config.server_name))
    return kind.secure_channel(target, channel_credentials(config), options=opts)


def is_loopback_host(host: str) -> bool:
    """True for ``localhost`` and for loopback IP literals (brackets and IPv6 zones allowed)."""
    h = host.strip()
    if h.startswith("[") and h.endswith("]"):
        h = h[1:-1]
    h = h.split("%", 1)[0].rstrip(".").lower()
    if h == "localhost":
        return True
    try:
        addr = ipaddress.ip_address(h)
    except ValueError:
        return False
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return addr.is_loopback


def target_hosts(target: str) -> list[str | None]:
    """The host part of each address a gRPC target names (``None`` for a Unix socket).

    Understands ``host:port``, ``[v6]:port``, ``dns:[//authority/]host[:port]``,
    ``ipv4:a:p,b:p``, ``ipv6:[a]:p,...`` and ``unix:``/``unix-abstract:``."""
    t = target.strip()
    scheme, sep, rest = t.partition(":")
    scheme = scheme.lower()
    if sep and scheme in ("unix", "unix-abstract"):
        return [None]
    if sep and scheme == "dns":
        if rest.startswith("//"):
            rest = rest[2:].split("/", 1)[1] if "/" in rest[2:] else ""
        return [_address_host(rest)]
    if sep and scheme in ("ipv4", "ipv6"):
        return [_address_host(a) for a in rest.split(",") if a]
    return [_address_host(t)]


def _address_host(address: str) -> str | None:
    """Host of ``host:port`` / ``[v6]:port`` / bare host; None for unix sockets; "" for ``:port``
    (all interfaces)."""
    a = address.strip()
    if a.lower().startswith(("unix:", "unix-abstract:")):
        return None
    if a.startswith("["):
        end = a.find("]")
        return a[1:end] if end > 0 else a
    if a.count(":") > 1:  # bare IPv6 literal without port
        return a
    return a.rsplit(":", 1)[0] if ":" in a else a


def peer_identity(context: grpc.ServicerContext | grpc.aio.ServicerContext[Any, Any]) -> str | None:
    """The verified client certificate's common name on a mutual-TLS connection, else None."""
    # grpc-stubs type the blocking context's auth_context as str -> bytes; gRPC documents (and
    # returns) an iterable of bytes per property, as the stubs of grpc.aio say.
    auth: Mapping[str, Iterable[bytes]] = context.auth_context() or {}  # type: ignore[assignment]
    names = list(auth.get("x509_common_name") or [])
    return names[0].decode() if names else None


# -- command-line flags shared by the services ---------------------------------------------------


def add_tls_arguments(parser: argparse.ArgumentParser, identity: str | None, *, server: bool = False) -> None:
    """``--tls-dir``, ``--ca``, ``--cert``, ``--key`` and ``--insecure``; a ``server`` also
    ``--require-client-cert``, a client ``--server-name``. Each side gets only the flag that means
    something to it: a server dials its peers by the names in their certificates, and one name
    overriding them all would break every channel. ``identity`` is the default certificate name in
    ``--tls-dir``."""
    g = parser.add_argument_group("TLS")
    g.add_argument("--tls-dir", type=Path, help="this role's directory of `tally certs` output")
    g.add_argument("--ca", type=Path, help="CA certificate (overrides --tls-dir)")
    g.add_argument("--cert", type=Path, help="certificate (overrides --tls-dir)")
    g.add_argument("--key", type=Path, help="private key (overrides --tls-dir)")
    if identity is not None:
        g.set_defaults(tls_identity=identity)
    if not server:
        g.add_argument(
            "--server-name", metavar="NAME",
            help="the name to verify in the server's certificate (default: the host dialled); for a "
            "server reached by IP or through a port-forward",
        )
    g.add_argument(
        "--insecure", action="store_true", help="plaintext gRPC; refused unless on loopback"
    )
    if server:
        g.add_argument("--require-client-cert", action="store_true", help="demand mutual TLS")


def tls_config_from_args(args: argparse.Namespace) -> TLSConfig:
    if getattr(args, "insecure", False):
        if args.tls_dir or args.ca or args.cert or args.key:
            raise ValueError("--insecure cannot be combined with certificate options")
        return TLSConfig.plaintext()
    identity = getattr(args, "tls_identity", None)
    base = args.tls_dir
    ca = args.ca or (base / "ca.pem" if base else None)
    cert = args.cert or (base / f"{identity}.pem" if base and identity else None)
    key = args.key or (base / f"{identity}.key" if base and identity else None)
    for flag, given, path in (("--ca", args.ca, ca), ("--cert", args.cert, cert), ("--key", args.key, key)):
        if path is not None and not path.is_file():  # named here, not as a raw [Errno 2] at start-up
            if given:
                raise ValueError(f"{flag}: no such file {path}")
            raise ValueError(f"--tls-dir: {base} has no {path.name} (is it this role's directory of "
                             "`tally certs` output?)")
    return TLSConfig(
        ca=ca, cert=cert, key=key, require_client_auth=getattr(args, "require_client_cert", False),
        server_name=getattr(args, "server_name", None),
    )


def _read(path: Path) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror}") from exc
