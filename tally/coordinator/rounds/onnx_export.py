"""Each committed global model as ONNX, so an application without torch can evaluate and serve
it with ONNX Runtime (the client SDK's inference path). The graph is torch's own export of the
job's ``tally.models`` module with the committed parameters, so the ONNX model computes exactly
what devices trained."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from tally import models
from tally.coordinator.spec.jobspec import ModelSpec
from tally.models.onnx import export_onnx


def export_model(params: Mapping[str, np.ndarray], model: ModelSpec) -> bytes:
    """ONNX bytes of the job's model with ``params``. Raises ``ValueError`` when the model has no
    torch module or the parameters do not fit it."""
    if model.kind not in models.kinds():
        raise ValueError(f"no ONNX export for model kind {model.kind!r}: it has no torch module")
    net = models.build(model.kind, model.inputs, model.classes, model.hidden, model.seed)
    return export_onnx(net, params, model.inputs)
