"""The edge overlay's Gateway API objects: checked against the official schemas, and run by a
real SNI router.

Gateway API kinds are custom resources, which kubernetes-validate does not know: ``validate``
checks them against the ``openAPIV3Schema`` of the Gateway API release's own CRDs (vendored in
``gateway_api/``), strictly (a field the schema does not declare is an error, as ``kubectl
--validate=strict`` makes it; the CEL rules are an API server's and are not run here).

``haproxy_config`` is what a Gateway API controller does with a ``Gateway`` whose TLS listener is
in Passthrough mode and the ``TLSRoute``s attached to it, written for HAProxy (Debian's) in TCP
mode: one frontend per listener, the ClientHello's SNI (``req.ssl_sni``) chooses the backend, the
bytes pass through untouched, and a name no route claims is refused.
"""

from __future__ import annotations

import copy
import fnmatch
import json
import os
import re
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import yaml

SCHEMAS = Path(__file__).parent / "gateway_api"
GROUP = "gateway.networking.k8s.io/"
RING = "gatewaylog"
# Each log line says who connected, the SNI, where it went, bytes each way and how it ended:
# nothing of what the connection carried.
LOG_FORMAT = "%ci:%cp [%t] %ft %b/%s sni=%[capture.req.hdr(0)] up=%U down=%B %Tw/%Tc/%Tt %ts"
LOG_LINE = re.compile(
    r"^<\d+>\w{3} +\d+ [\d:]+ \S+ haproxy\[\d+\]: "  # the syslog header of the ring's lines
    r"[\d.]+:\d+ \[[^]]+\] \w+ [\w<>]+/[\w<>]+ sni=[\w.*-]* up=\d+ down=\d+ -?\d+/-?\d+/\d+ [\w-]{2,4}$")


def edge_overlay(directory: Path, base: Path, domain: str, port: int, gateway_class: str = "test") -> Path:
    """A kustomization in ``directory`` as an operator composes the edge overlay: ``base`` (an
    overlay), the tally-edge settings (``domain``, ``port``) and components/edge-gateway."""
    directory.mkdir(parents=True, exist_ok=True)
    k8s = base.parents[1]
    settings = yaml.safe_load((k8s / "overlays" / "edge" / "edge.yaml").read_text())
    settings["data"] = {"domain": domain, "port": str(port), "gatewayClassName": gateway_class}
    (directory / "edge.yaml").write_text(yaml.safe_dump(settings))
    relative = Path(os.path.relpath(k8s, directory))  # kustomize takes no absolute paths
    (directory / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", "namespace": "tally",
        "resources": [str(relative / base.relative_to(k8s)), "edge.yaml"],
        "components": [str(relative / "components" / "edge-gateway")],
    }))
    return directory


@cache
@cache
def _schema(kind: str) -> dict[str, Any]:
    schema = json.loads((SCHEMAS / f"{kind.lower()}-v1.json").read_text())
    return _strict(schema)


def _strict(schema: dict[str, Any]) -> dict[str, Any]:
    """Every object schema that lists its properties admits no others (unknown fields fail)."""
    schema = copy.deepcopy(schema)

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if "properties" in node and "additionalProperties" not in node:
                node["additionalProperties"] = False
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    # metadata is ObjectMeta, left open in a CRD's schema.
    schema["properties"]["metadata"]["additionalProperties"] = True
    return schema


def validate(obj: dict[str, Any]) -> None:
    """Raises jsonschema.ValidationError unless ``obj`` (a v1 Gateway or TLSRoute) fits its schema."""
    assert obj["apiVersion"] == f"{GROUP}v1", f"{obj['kind']}: only v1 is vendored, not {obj['apiVersion']}"
    jsonschema.validate(obj, _schema(obj["kind"]), cls=jsonschema.Draft7Validator)


def _matches(listener_host: str | None, host: str) -> bool:
    """Gateway API's rule: ``*.example.org`` matches any name with more labels under example.org."""
    return listener_host is None or fnmatch.fnmatchcase(host, listener_host)


def routes(objects: list[dict[str, Any]], gateway: str, listener: str) -> dict[str, tuple[str, int]]:
    """hostname -> (Service, port) of the TLSRoutes attached to ``gateway``'s ``listener``, whose
    hostnames the listener's hostname admits (as a controller attaches them)."""
    (gw,) = [o for o in objects if o["kind"] == "Gateway" and o["metadata"]["name"] == gateway]
    (spec,) = [li for li in gw["spec"]["listeners"] if li["name"] == listener]
    assert spec["protocol"] == "TLS" and spec["tls"]["mode"] == "Passthrough", spec
    out = {}
    for route in (o for o in objects if o["kind"] == "TLSRoute"):
        parents = route["spec"]["parentRefs"]
        if not any(p["name"] == gateway and p.get("sectionName", listener) == listener for p in parents):
            continue
        (rule,) = route["spec"]["rules"]
        (backend,) = rule["backendRefs"]
        for host in route["spec"]["hostnames"]:
            if _matches(spec.get("hostname"), host):
                assert host not in out, f"two routes claim {host}"
                out[host] = (backend["name"], backend["port"])
    return out


def _backend(service: str, port: int) -> str:
    return f"{service}_{port}".replace("-", "_")


def haproxy_config(objects: list[dict[str, Any]], gateway: str, listener: str, bind: str,
                   endpoints: Callable[[str, int], list[str]], max_connections: int = 4096) -> str:
    """An HAProxy configuration for ``gateway``'s TLS passthrough ``listener``, listening on
    ``bind`` (``127.0.0.1:PORT``); ``endpoints(service, port)`` gives the ``ip:port`` of the
    pods behind a Service port (none: the route's connections are refused)."""
    table = routes(objects, gateway, listener)
    lines = [
        # The log in a ring buffer that the runtime API reads (HAProxy.log).
        f"ring {RING}",
        "    format rfc3164",
        "    maxlen 1024",
        "    size 8388608",
        "global",
        f"    log ring@{RING} local0 info",
        f"    maxconn {max_connections}",
        "defaults",
        "    mode tcp",
        f"    maxconn {max_connections}",
        "    log global",
        f'    log-format "{LOG_FORMAT}"',
        "    timeout connect 5s",
        # Idle gRPC connections live long: devices keep theirs between calls.
        "    timeout client 1h",
        "    timeout server 1h",
        f"frontend {gateway}_{listener}".replace("-", "_"),
        f"    bind {bind}",
        # Wait for the ClientHello; anything that is not one is closed.
        "    tcp-request inspect-delay 5s",
        "    tcp-request content capture req.ssl_sni len 253",
        "    tcp-request content reject unless { req.ssl_hello_type 1 }",
    ]
    # A name no route claims is refused here, before any backend.
    lines.append(f"    acl routed req.ssl_sni -i {' '.join(sorted(table))}")
    lines.append("    tcp-request content reject unless routed")
    for host, (service, port) in sorted(table.items()):
        lines.append(f"    use_backend {_backend(service, port)} if {{ req.ssl_sni -i {host} }}")
    for service, port in sorted(set(table.values())):
        lines.append(f"backend {_backend(service, port)}")
        for i, address in enumerate(endpoints(service, port)):
            lines.append(f"    server pod{i} {address}")
    return "\n".join(lines) + "\n"


class HAProxy:
    """Debian's haproxy with ``config``, as a daemon: it returns once its listeners are bound
    (``-D``), so nothing waits on a guess. Its log goes to a ring buffer read through its runtime
    API (a Unix socket), which also gives the connection counts per backend."""

    def __init__(self, directory: Path, config: str) -> None:
        self.directory, self.socket, self.pidfile = directory, directory / "haproxy.sock", directory / "haproxy.pid"
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / "haproxy.cfg"
        path.write_text(config.replace("global\n", f"global\n    stats socket {self.socket} mode 600 level admin\n", 1))
        checked = subprocess.run(["haproxy", "-c", "-f", str(path)], capture_output=True, text=True, timeout=30)
        assert checked.returncode == 0, f"haproxy -c:\n{checked.stdout}{checked.stderr}\n{path.read_text()}"
        started = subprocess.run(["haproxy", "-D", "-p", str(self.pidfile), "-f", str(path)], capture_output=True,
                                 text=True, timeout=60)
        assert started.returncode == 0, f"haproxy: {started.stderr}"

    def _ask(self, command: str) -> str:
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(str(self.socket))
            s.sendall(command.encode() + b"\n")
            data = b""
            while chunk := s.recv(65536):
                data += chunk
        return data.decode()

    def log(self, connections: int = 0, deadline_s: float = 30) -> list[str]:
        """Every log line so far, once it holds at least ``connections`` connection lines (HAProxy
        writes a connection's line after the connection closes, which the client may see first)."""
        end = time.monotonic() + deadline_s
        while True:
            lines = [line for line in self._ask(f"show events {RING}").splitlines() if line.strip()]
            if sum(" sni=" in line for line in lines) >= connections or time.monotonic() > end:
                return lines
            time.sleep(0.1)  # polling the runtime API: nothing to wait on but HAProxy's next line

    def stats(self) -> list[dict[str, str]]:
        """``show stat``: one row per frontend, server and backend (scur, smax, stot, ...)."""
        header, *rows = self._ask("show stat").lstrip("# ").splitlines()
        return [dict(zip(header.split(","), row.split(","), strict=False)) for row in rows if row]

    def stop(self) -> None:
        if self.pidfile.exists():
            os.kill(int(self.pidfile.read_text().split()[0]), signal.SIGTERM)
            self.pidfile.unlink()
