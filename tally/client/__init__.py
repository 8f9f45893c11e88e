"""The client SDK: the library an edge application embeds (check-in loop, chunked model
download, local training, the algorithm's client half, the secure-aggregation client), ONNX
Runtime inference on the exported global model. The fleet simulator that load-tests a deployment
is not part of it: it lives in ``tally.loadtest`` and plugs in through ``DeviceHooks``."""

from __future__ import annotations

import importlib
from typing import Any

# Imported on first use (PEP 562): `tally client --help` and any `tally.client.<module>` import
# would otherwise load the whole SDK, gRPC and the algorithms first.
_EXPORTS = {
    "SDK_VERSION": "tally.client.device", "Device": "tally.client.device", "DeviceStats": "tally.client.device",
    "DeviceHooks": "tally.client.hooks", "SessionHooks": "tally.client.hooks",
    "DownloadError": "tally.client.download", "ModelCache": "tally.client.download",
    "ClientMetrics": "tally.client.metrics", "OnnxModel": "tally.client.onnx_model",
    "JobTrainers": "tally.client.contribution",
    "RetryPolicy": "tally.client.retry",
}


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'tally.client' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)


__all__ = [
    "SDK_VERSION",
    "ClientMetrics",
    "Device",
    "DeviceHooks",
    "DeviceStats",
    "DownloadError",
    "JobTrainers",
    "ModelCache",
    "OnnxModel",
    "RetryPolicy",
    "SessionHooks",
]
