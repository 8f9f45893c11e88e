"""The client SDK: the library an edge application embeds (check-in loop, chunked model
download, local training, the algorithm's client half, the secure-aggregation client), ONNX
Runtime inference on the exported global model, and the fleet simulator for load tests."""

from __future__ import annotations

import importlib
from typing import Any

# Imported on first use (PEP 562): `tally client --help` and any `client_sdk.<module>` import
# would otherwise load the whole SDK, gRPC and the algorithms first.
_EXPORTS = {
    "SDK_VERSION": "client_sdk.device", "Device": "client_sdk.device", "DeviceStats": "client_sdk.device",
    "DownloadError": "client_sdk.download", "ModelCache": "client_sdk.download",
    "DropoutPlan": "client_sdk.dropout", "Fleet": "client_sdk.fleet", "FleetStats": "client_sdk.fleet",
    "ClientMetrics": "client_sdk.metrics", "OnnxModel": "client_sdk.onnx_model", "RetryPolicy": "client_sdk.retry",
}


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'client_sdk' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)


__all__ = [
    "SDK_VERSION",
    "ClientMetrics",
    "Device",
    "DeviceStats",
    "DownloadError",
    "DropoutPlan",
    "Fleet",
    "FleetStats",
    "ModelCache",
    "OnnxModel",
    "RetryPolicy",
]
