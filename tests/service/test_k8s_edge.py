"""The edge overlay (k8s/overlays/edge, components/edge-gateway): devices outside the cluster
through one Gateway API Gateway with TLS passthrough, routed by SNI. Rendered, validated against
the Gateway API's own schemas, and the rendered routes run by a real SNI router (HAProxy) in front
of real TLS servers with the deployment's certificates."""

from __future__ import annotations

import asyncio
import re
import runpy
import shutil
from pathlib import Path
from typing import Any

import grpc
import jsonschema
import pytest
import yaml
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from support import tools
from support.deploy import ROOT, free_port
from support.gateway import LOG_LINE, HAProxy, edge_overlay, haproxy_config, routes, validate
from support.manifests import K8S, env_value, find, one, render
from tally.security import TLSConfig, certs
from tally.security.tls import bind, open_aio_channel
from tally.security.tls_failures import tls_failure

COMPONENT = K8S / "components" / "edge-gateway"


@pytest.fixture(scope="module")
def edge() -> list[dict[str, Any]]:
    return render(K8S / "overlays" / "edge")


def _most_aggregators(objects: list[dict[str, Any]]) -> int:
    return one(objects, "HorizontalPodAutoscaler", "tally-aggregator")["spec"]["maxReplicas"]


def _advertised(objects: list[dict[str, Any]], ordinal: int) -> tuple[str, int]:
    """The host and port aggregator pod ``ordinal`` advertises to devices, as its pod expands it."""
    (container,) = one(objects, "StatefulSet", "tally-aggregator")["spec"]["template"]["spec"]["containers"]
    (flag,) = [a for a in container["args"] if a.startswith("--advertise=")]
    env = {"POD_NAME": f"tally-aggregator-{ordinal}"} | {
        name: env_value(container, name) for name in ("EDGE_DOMAIN", "EDGE_PORT")}
    host, port = re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], flag.split("=", 1)[1]).rsplit(":", 1)
    return host, int(port)


def _covers(pattern: str, host: str) -> bool:
    """As gRPC checks a certificate name: equal, or a wildcard for exactly one leftmost label."""
    if pattern.startswith("*."):
        first, _, rest = host.partition(".")
        return bool(first) and rest == pattern[2:] and "." in rest
    return pattern == host


def test_the_edge_overlay_is_prod_behind_one_passthrough_gateway_with_a_route_per_name(
        edge: list[dict[str, Any]]) -> None:
    prod = render(K8S / "overlays" / "prod")
    assert {(o["kind"], o["metadata"]["name"]) for o in prod} < {(o["kind"], o["metadata"]["name"]) for o in edge}
    assert not find(edge, "ConfigMap", "tally-edge"), "the settings are kustomize's, not the cluster's"
    (gateway,) = find(edge, "Gateway")
    (listener,) = gateway["spec"]["listeners"]
    assert (listener["protocol"], listener["tls"]["mode"], listener["port"]) == ("TLS", "Passthrough", 443)
    assert listener["hostname"] == "*.edge.example.org"
    table = routes(edge, "tally-edge", "tls")
    most = _most_aggregators(edge)
    # The coordinator's device API, and every aggregator pod the autoscaler may run, each by the
    # name it advertises and through a Service that selects that pod only.
    assert table.pop("tally-coordinator.edge.example.org") == ("tally-edge-coordinator", 7000)
    for i in range(most):
        host, port = _advertised(edge, i)
        assert port == listener["port"]
        service, service_port = table.pop(host)
        selected = one(edge, "Service", service)["spec"]
        assert selected["selector"] == {"statefulset.kubernetes.io/pod-name": f"tally-aggregator-{i}"}
        assert [p["port"] for p in selected["ports"]] == [service_port] == [7001]
    assert not table, f"routes to no advertised name: {table}"
    # The in-cluster name stays what the coordinator dials for control; devices get the external one.
    (coordinator,) = one(edge, "StatefulSet", "tally-coordinator")["spec"]["template"]["spec"]["containers"]
    assert int(env_value(coordinator, "AGGREGATOR_COUNT")) == most


def test_certificates_cover_the_external_names_and_no_aggregator_covers_the_coordinators(
        edge: list[dict[str, Any]]) -> None:
    names = {c["metadata"]["name"]: c["spec"].get("dnsNames", []) for c in find(edge, "Certificate")}
    for i in range(_most_aggregators(edge) + 4):  # pods past the maximum too: a wildcard, no edit
        host, _ = _advertised(edge, i)
        assert any(_covers(n, host) for n in names["tally-aggregator"]), host
        assert not any(_covers(n, host) for n in names["tally-coordinator"]), host
    assert "tally-coordinator.edge.example.org" in names["tally-coordinator"]
    assert not any(_covers(n, "tally-coordinator.edge.example.org") for n in names["tally-aggregator"])
    # The in-cluster names stay: the coordinator dials aggregators' control ports by them.
    assert "tally-aggregator-0.tally-aggregator" in names["tally-aggregator"]


def test_servers_behind_the_gateway_cap_no_source_since_every_device_comes_from_the_gateway(
        edge: list[dict[str, Any]]) -> None:
    """Through a passthrough gateway every connection's source is the gateway: a per-source cap
    (the servers' default, an eighth of their connections) held the measured 4,000 to 3,503."""
    for name in ("tally-coordinator", "tally-aggregator"):
        [server] = [s for s in find(edge, "StatefulSet") if s["metadata"]["name"] == name]
        assert "--max-connections-per-source=0" in server["spec"]["template"]["spec"]["containers"][0]["args"]


def test_the_coordinator_behind_the_gateway_rate_limits_its_one_source_as_a_fleet(
        edge: list[dict[str, Any]]) -> None:
    """The per-source rate limits see the gateway as the only source: at their defaults the
    whole outside fleet would share one device's allowance of check-ins and registrations. The
    coordinator's own parser reads the raised limits."""
    from tally.cli import build_parser
    from tally.coordinator.faces.ratelimit import DEFAULT_CHECKIN_LIMIT, DEFAULT_REGISTER_LIMIT

    [server] = [s for s in find(edge, "StatefulSet") if s["metadata"]["name"] == "tally-coordinator"]
    given = server["spec"]["template"]["spec"]["containers"][0]["args"]
    # Kubernetes expands $(VAR) from the pod's environment; a count stands in for it here.
    args = build_parser().parse_args(["coordinator", *(a.replace("$(AGGREGATOR_COUNT)", "2") for a in given)])
    assert args.checkin_limit.rate_per_s >= 10 * DEFAULT_CHECKIN_LIMIT.rate_per_s >= args.checkin_rate
    assert args.register_limit.rate_per_s >= 10 * DEFAULT_REGISTER_LIMIT.rate_per_s


def test_prod_keeps_the_source_cap_since_its_services_keep_the_devices_addresses() -> None:
    """Without the gateway, devices reach prod's pods through a ClusterIP Service (kube-proxy
    rewrites the destination only) and a headless one (they dial the pods): no LoadBalancer or
    NodePort SNATs them to a node's address, so each arrives as itself and the cap stays on."""
    prod = render(K8S / "overlays" / "prod")
    assert {s["spec"].get("type", "ClusterIP") for s in find(prod, "Service")} == {"ClusterIP"}
    for server in find(prod, "StatefulSet"):
        (container,) = server["spec"]["template"]["spec"]["containers"]
        assert not [a for a in container["args"] if a.startswith("--max-connections-per-source")]


def test_routes_yaml_is_the_generators_output_for_prods_autoscaler_maximum(edge: list[dict[str, Any]]) -> None:
    generator = runpy.run_path(str(COMPONENT / "routes.py"), run_name="tally_edge_routes")
    assert generator["AGGREGATORS"] == _most_aggregators(edge), "routes.py's AGGREGATORS is the HPA's maxReplicas"
    written = [d for d in yaml.safe_load_all((COMPONENT / "routes.yaml").read_text()) if d]
    assert written == generator["objects"](), \
        "regenerate: python k8s/components/edge-gateway/routes.py > k8s/components/edge-gateway/routes.yaml"


def test_gateway_objects_pass_the_gateway_api_schemas_and_a_wrong_one_fails(edge: list[dict[str, Any]]) -> None:
    checked = [o for o in edge if o["apiVersion"].startswith("gateway.networking.k8s.io/")]
    assert len(checked) == 2 + _most_aggregators(edge)  # the Gateway, the coordinator's route, a route per pod
    for obj in checked:
        validate(obj)
    gateway = yaml.safe_load(yaml.safe_dump(find(edge, "Gateway")[0]))
    gateway["spec"]["listeners"][0]["tls"]["mode"] = "Passthru"
    with pytest.raises(jsonschema.ValidationError, match="Passthru"):
        validate(gateway)
    route = yaml.safe_load(yaml.safe_dump(find(edge, "TLSRoute")[0]))
    route["spec"]["hostname"] = route["spec"].pop("hostnames")[0]  # a misspelt field is refused (strict)
    with pytest.raises(jsonschema.ValidationError, match="hostname"):
        validate(route)


def test_the_domain_and_port_are_set_once(tmp_path: Path) -> None:
    """Another domain and port in the overlay's settings reach every name and port that needs them."""
    objects = render(edge_overlay(tmp_path / "edge", K8S / "overlays" / "prod", "devices.example.net", 8443))
    text = yaml.safe_dump_all(objects)
    assert "example.org" not in text
    (listener,) = one(objects, "Gateway", "tally-edge")["spec"]["listeners"]
    assert listener["port"] == 8443 and listener["hostname"] == "*.devices.example.net"
    assert _advertised(objects, 3) == ("tally-aggregator-3.aggregators.devices.example.net", 8443)
    assert one(objects, "Gateway", "tally-edge")["spec"]["gatewayClassName"] == "test"


# -- the routes run by a real SNI router ----------------------------------------------------------


async def _health_server(tls: TLSConfig, name: str) -> tuple[grpc.aio.Server, int]:
    """A TLS server whose health service answers SERVING for ``name`` only."""
    server = grpc.aio.server()
    servicer = health.aio.HealthServicer()
    await servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = bind(server, "127.0.0.1:0", tls)
    await server.start()
    return server, port


async def _through(gateway: int, name: str, ca: Path, service: str) -> str:
    """A device's health check for ``service`` through the gateway by ``name`` (its SNI and the
    name it verifies): the status, or the error as the SDK names it."""
    channel = open_aio_channel(f"127.0.0.1:{gateway}", TLSConfig(ca=ca, server_name=name))
    try:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=10)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    except grpc.aio.AioRpcError as exc:
        return tls_failure(exc.details() or "") or f"{exc.code().name}: {exc.details()}"
    finally:
        await channel.close()


def test_haproxy_configured_from_the_routes_passes_tls_through_by_sni_and_refuses_other_names(tmp_path: Path) -> None:
    """The coordinator's name reaches the coordinator's server, an aggregator's name that pod's
    server (each ends TLS with its own certificate), a name no route claims is refused at the
    gateway with a named TLS error, and the gateway's log holds routing facts only."""
    tools.require("haproxy", "Debian's haproxy: `make test-tools` installs it")
    port = free_port()
    objects = render(edge_overlay(tmp_path / "edge", K8S / "overlays" / "prod", "edge.test", port))
    deployment = certs.write_deployment(tmp_path / "pki", aggregators=2,
                                        dns=["tally-coordinator.edge.test", "*.aggregators.edge.test"])
    pki = deployment.directory

    async def main() -> tuple[dict[str, str], list[str], list[dict[str, str]]]:
        servers = {name: await _health_server(TLSConfig.from_dir(pki / directory, identity), name)
                   for name, directory, identity in (("coordinator", "coordinator", "coordinator"),
                                                     ("aggregator-0", "aggregator-1", "aggregator"),
                                                     ("aggregator-1", "aggregator-2", "aggregator"))}
        pods = {"tally-edge-coordinator": "coordinator", "tally-edge-aggregator-0": "aggregator-0",
                "tally-edge-aggregator-1": "aggregator-1"}

        def endpoints(service: str, _port: int) -> list[str]:  # pods 2..7 are not running
            return [f"127.0.0.1:{servers[pods[service]][1]}"] if service in pods else []

        ca = pki / "device" / "ca.pem"
        gateway = None
        try:
            gateway = HAProxy(tmp_path / "haproxy", haproxy_config(objects, "tally-edge", "tls", f"127.0.0.1:{port}",
                                                                    endpoints))
            seen = {
                "coordinator": await _through(port, "tally-coordinator.edge.test", ca, "coordinator"),
                "aggregator-1": await _through(port, "tally-aggregator-1.aggregators.edge.test", ca, "aggregator-1"),
                "aggregator-1 asked for 0": await _through(port, "tally-aggregator-1.aggregators.edge.test", ca,
                                                           "aggregator-0"),
                "aggregator-0": await _through(port, "tally-aggregator-0.aggregators.edge.test", ca, "aggregator-0"),
                "no pod": await _through(port, "tally-aggregator-5.aggregators.edge.test", ca, "aggregator-5"),
                "not routed": await _through(port, "tally-aggregator-0.tally-aggregator", ca, "aggregator-0"),
                "wrong domain": await _through(port, "tally-coordinator.elsewhere.test", ca, "coordinator"),
            }
            return seen, gateway.log(connections=len(seen)), gateway.stats()
        finally:
            if gateway is not None:
                gateway.stop()
            for server, _ in servers.values():
                await server.stop(0)

    seen, log, stats = asyncio.run(main())
    assert seen["coordinator"] == seen["aggregator-0"] == seen["aggregator-1"] == "SERVING", seen
    assert seen["aggregator-1 asked for 0"].startswith("NOT_FOUND"), "routed to pod 1, not 0"
    for case in ("not routed", "wrong domain", "no pod"):
        assert seen[case].startswith("TLS: "), (case, seen[case])
        assert "gateway" in seen[case], (case, seen[case])
    connections = [line for line in log if " sni=" in line]
    # A line per connection, and nothing in it but who, which name, where to, how many bytes, how long.
    assert len(connections) >= 7 and all(LOG_LINE.match(line) for line in connections), log
    refused = [line for line in connections if "sni=tally-aggregator-0.tally-aggregator" in line]
    assert refused and all("/<NOSRV> " in line and line.endswith(" PR") for line in refused), refused
    served = {row["pxname"]: int(row["stot"]) for row in stats if row["svname"] == "BACKEND"}
    assert served["tally_edge_coordinator_7000"] >= 1 and served["tally_edge_aggregator_1_7001"] >= 2


def test_the_pages_loadbalancer_alternative_renders_a_load_balancer_per_name_and_no_gateway_api(
        edge: list[dict[str, Any]], tmp_path: Path) -> None:
    page = (ROOT / "docs" / "kubernetes.md").read_text()
    block = re.search(r"^Without Gateway API.*?```yaml\n(.*?)```", page, re.M | re.S)
    assert block, "the page's LoadBalancer alternative"
    shutil.copytree(K8S, tmp_path / "k8s")
    (tmp_path / "wrap").mkdir()
    (tmp_path / "wrap" / "kustomization.yaml").write_text(block.group(1))
    objects = render(tmp_path / "wrap")
    assert not [o for o in objects if o["apiVersion"].startswith("gateway.networking.k8s.io/")]
    balanced = {o["metadata"]["name"]: o["spec"] for o in find(objects, "Service")
                if o["spec"].get("type") == "LoadBalancer"}
    # One per name the Gateway would have routed, each on 443 to the same pods as its route.
    assert set(balanced) == {service for service, _ in routes(edge, "tally-edge", "tls").values()}
    assert all([p["port"] for p in spec["ports"]] == [443] for spec in balanced.values())
    # No SNAT to a node's address: the servers' per-source limits still see each device.
    assert all(spec.get("externalTrafficPolicy") == "Local" for spec in balanced.values())
    pod_3 = {"statefulset.kubernetes.io/pod-name": "tally-aggregator-3"}
    assert balanced["tally-edge-aggregator-3"]["selector"] == pod_3
