"""Each committed global model as ONNX, so an application without torch can evaluate and serve
it with ONNX Runtime (the client SDK's inference path).

The graph is torch's own export of the job's ``tally.models`` module with the committed
parameters, so the ONNX model computes exactly what devices trained. The TorchScript exporter (``dynamo=False``)
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
from tally import models
from tally.training import set_params

INPUT_NAME = "input"
OUTPUT_NAME = "logits"
OPSET = 17

_LOCK = threading.Lock()


def export_model(params: Mapping[str, np.ndarray], model: ModelSpec) -> bytes:
    """ONNX bytes of the job's model with ``params``: input ``input`` [batch, inputs] float32,
    output ``logits`` [batch, classes]. Raises ``ValueError`` when the parameters do not fit."""
    if model.kind not in models.kinds():
        raise ValueError(f"no ONNX export for model kind {model.kind!r}: it has no torch module")
    net = models.build(model.kind, model.inputs, model.classes, model.hidden, model.seed)
    set_params(net, params)  # ModelMismatch (a ValueError) when they do not fit
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
