"""Kubernetes Secret manifests from a ``tally certs`` output directory.

The three certificates become ``kubernetes.io/tls`` Secrets (keys ``ca.crt``, ``tls.crt``,
``tls.key``, the shape cert-manager writes, so the workloads mount either source the same way);
the coordinator's secrets, the ticket verification key the aggregators need and the enrolment
key the simulated fleet provisions devices with become Opaque Secrets. Two files: ``tls.yaml``
(skip it when cert-manager issues the certificates) and ``keys.yaml`` (always).
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

from tally.security import certs
from tally.security.enrolment import ENROLMENT_KEY_FILE

# Every aggregator replica mounts the same certificate: it names every pod (tally-aggregator-<i>.tally-aggregator).
AGGREGATOR_DIR = certs.aggregator_dir(1)


def _secret(name: str, namespace: str, kind: str, files: dict[str, Path]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": name, "namespace": namespace,
                     "labels": {"app.kubernetes.io/part-of": "tally"}},
        "type": kind,
        "data": {key: base64.b64encode(path.read_bytes()).decode() for key, path in files.items()},
    }


def _tls(name: str, namespace: str, directory: Path, identity: str) -> dict[str, Any]:
    return _secret(name, namespace, "kubernetes.io/tls", {
        "ca.crt": directory / certs.CA_CERT,
        "tls.crt": directory / f"{identity}.pem",
        "tls.key": directory / f"{identity}.key",
    })


def secret_manifests(deployment: Path, namespace: str) -> dict[str, list[dict[str, Any]]]:
    """File name -> Secrets, read from ``deployment`` (``OSError`` when a file is missing)."""
    coordinator = deployment / "coordinator"
    return {
        "tls.yaml": [
            _tls("tally-coordinator-tls", namespace, coordinator, "coordinator"),
            _tls("tally-aggregator-tls", namespace, deployment / AGGREGATOR_DIR, "aggregator"),
            # Devices get the CA only: no key is shared by every device.
            _secret("tally-device-ca", namespace, "Opaque",
                    {"ca.crt": deployment / certs.DEVICE_ROLE / certs.CA_CERT}),
        ],
        "keys.yaml": [
            _secret("tally-coordinator-keys", namespace, "Opaque", {
                name: coordinator / name
                for name in (certs.TICKET_KEY, certs.TICKET_PUB, certs.TOKEN_SECRET, ENROLMENT_KEY_FILE)
            }),
            _secret("tally-ticket-pub", namespace, "Opaque",
                    {certs.TICKET_PUB: coordinator / certs.TICKET_PUB}),
            _secret("tally-enrolment", namespace, "Opaque",
                    {ENROLMENT_KEY_FILE: coordinator / ENROLMENT_KEY_FILE}),
        ],
    }


def write_secret_manifests(deployment: Path, out: Path, namespace: str) -> list[Path]:
    """Write ``tls.yaml`` and ``keys.yaml`` into ``out`` (0600 in a 0700 directory)."""
    import yaml  # only the operator's machine writes manifests

    out.mkdir(mode=0o700, parents=True, exist_ok=True)
    written = []
    for name, secrets in secret_manifests(deployment, namespace).items():
        text = yaml.safe_dump_all(secrets, sort_keys=False)
        written.append(certs.write_file_atomic(out / name, text.encode(), 0o600))
    return written
