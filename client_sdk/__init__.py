"""The client SDK: the library an edge application embeds (check-in loop, chunked model
download, local training, the algorithm's client half, the secure-aggregation client), ONNX
Runtime inference on the exported global model, and the fleet simulator for load tests."""

from client_sdk.device import SDK_VERSION, Device, DeviceStats
from client_sdk.download import DownloadError, ModelCache
from client_sdk.dropout import DropoutPlan
from client_sdk.fleet import Fleet, FleetStats
from client_sdk.metrics import ClientMetrics
from client_sdk.onnx_model import OnnxModel
from client_sdk.retry import RetryPolicy

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
