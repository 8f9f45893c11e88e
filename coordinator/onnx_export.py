"""Each committed global model as ONNX, so an application without torch can evaluate and serve
it with ONNX Runtime (the client SDK's inference path).

The graph is torch's own export of ``tally.training.mlp`` with the committed parameters, so the
ONNX model computes exactly what devices trained. The TorchScript exporter (``dynamo=False``)
needs no extra packages and writes the same bytes for the same parameters, which keeps the
content-addressed store deduplicating; it keeps process-wide state, hence the lock.
"""

from __future__ import annotations

import io
import threading
import warnings
from collections.abc import Mapping

import numpy as np
import torch

from coordinator.jobspec import ModelSpec
from tally.training import mlp, set_params

INPUT_NAME = "input"
OUTPUT_NAME = "logits"
OPSET = 17

_LOCK = threading.Lock()


def export_model(params: Mapping[str, np.ndarray], model: ModelSpec) -> bytes:
    """ONNX bytes of the job's model with ``params``: input ``input`` [batch, inputs] float32,
    output ``logits`` [batch, classes]. Raises ``ValueError`` when the parameters do not fit."""
    if model.kind != "mlp":
        raise ValueError(f"no ONNX export for model kind {model.kind!r}")
    net = mlp(model.inputs, model.classes, model.hidden, model.seed)
    try:
        set_params(net, params)
    except RuntimeError as exc:  # torch reports shape mismatches as RuntimeError
        raise ValueError(f"parameters do not fit the job's model: {exc}") from None
    net.eval()
    out = io.BytesIO()
    with _LOCK, warnings.catch_warnings():
        # The TorchScript exporter announces its deprecation on every call.
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.onnx.export(
            net,
            (torch.zeros(1, model.inputs),),
            out,
            dynamo=False,
            input_names=[INPUT_NAME],
            output_names=[OUTPUT_NAME],
            dynamic_axes={INPUT_NAME: {0: "batch"}, OUTPUT_NAME: {0: "batch"}},
            opset_version=OPSET,
        )
    return out.getvalue()
