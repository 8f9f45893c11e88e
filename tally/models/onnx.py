"""A torch module with given parameters as ONNX bytes, for ``tally.client.OnnxModel``: the one export
the coordinator (every committed round) and the SDK (a locally adapted model) share.

Input ``input`` [batch, inputs] float32, output ``logits`` [batch, classes]. The TorchScript
exporter (``dynamo=False``) needs no extra packages and writes the same bytes for the same
parameters, which keeps the coordinator's content-addressed store deduplicating; it keeps
process-wide state, hence the lock.
"""

from __future__ import annotations

import io
import threading
import warnings
from collections.abc import Mapping

import numpy as np
import torch
from torch import nn

from tally.models.params import set_params

INPUT_NAME = "input"
OUTPUT_NAME = "logits"
OPSET = 17

_LOCK = threading.Lock()


def export_onnx(module: nn.Module, params: Mapping[str, np.ndarray], inputs: int) -> bytes:
    """Raises ``ModelMismatch`` (a ValueError) when ``params`` do not fit ``module``."""
    set_params(module, params)
    module.eval()
    out = io.BytesIO()
    with _LOCK, warnings.catch_warnings():
        # The TorchScript exporter announces its deprecation on every call.
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.onnx.export(
            module,
            (torch.zeros(1, inputs),),
            out,
            dynamo=False,
            input_names=[INPUT_NAME],
            output_names=[OUTPUT_NAME],
            dynamic_axes={INPUT_NAME: {0: "batch"}, OUTPUT_NAME: {0: "batch"}},
            opset_version=OPSET,
        )
    return out.getvalue()
