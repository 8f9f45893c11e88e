"""The global model through ONNX Runtime: an application without torch evaluates and serves it.

The coordinator exports each committed model to ONNX (``Device.fetch_onnx``); this module needs
only onnxruntime and numpy. The graph's first input takes a float32 batch of feature rows and
its first output gives one row of class logits per example.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnxruntime as ort


class OnnxModel:
    def __init__(self, session: ort.InferenceSession) -> None:
        self.session = session
        inputs, outputs = session.get_inputs(), session.get_outputs()
        if not inputs or not outputs:
            raise ValueError("the ONNX graph needs at least one input and one output")
        self.input_name = inputs[0].name
        self.output_name = outputs[0].name
        batch = inputs[0].shape[0] if inputs[0].shape else None
        # A graph exported with a fixed batch size is run in slices of that size.
        self._fixed_batch = batch if isinstance(batch, int) and batch > 0 else None

    @classmethod
    def from_bytes(cls, data: bytes, providers: list[str] | None = None) -> OnnxModel:
        """The model from ONNX bytes (``Device.fetch_onnx``); ``providers``: ONNX Runtime's
        execution providers (default: CUDA when ONNX Runtime has it, else the CPU)."""
        return cls(ort.InferenceSession(data, _options(), providers=providers or _providers()))

    @classmethod
    def from_path(cls, path: str | os.PathLike[str], providers: list[str] | None = None) -> OnnxModel:
        """The model from an ONNX file (``tally job model --out``)."""
        return cls.from_bytes(Path(path).read_bytes(), providers)

    def logits(self, X: np.ndarray) -> np.ndarray:
        """Logits ``[batch, classes]`` for float32 inputs ``[batch, inputs]`` (one row: one
        example), scaled as the model was trained (the bundled datasets: [0, 1])."""
        X = np.ascontiguousarray(X, dtype=np.float32)
        if X.ndim == 1:
            X = X[None, :]
        if self._fixed_batch is None:
            return self._run(X)
        step = self._fixed_batch
        parts = []
        for start in range(0, len(X), step):
            batch = X[start : start + step]
            pad = step - len(batch)
            if pad:
                batch = np.concatenate([batch, np.zeros((pad, *batch.shape[1:]), np.float32)])
            parts.append(self._run(batch)[: step - pad])
        return np.concatenate(parts)

    def _run(self, batch: np.ndarray) -> np.ndarray:
        return self.session.run([self.output_name], {self.input_name: batch})[0]

    def predict_proba(self, X: np.ndarray) -> np.ndarray:
        z = self.logits(X).astype(np.float64)
        z -= z.max(axis=1, keepdims=True)
        p = np.exp(z)
        return p / p.sum(axis=1, keepdims=True)

    def predict(self, X: np.ndarray) -> np.ndarray:
        return self.logits(X).argmax(axis=1)

    def evaluate(self, X: np.ndarray, y: np.ndarray) -> tuple[float, float]:
        """(mean cross-entropy, accuracy): the numbers ``TorchTrainer.evaluate`` reports."""
        y = np.asarray(y, dtype=np.int64)
        z = self.logits(X).astype(np.float64)
        shifted = z - z.max(axis=1, keepdims=True)
        log_p = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
        loss = float(-log_p[np.arange(len(y)), y].mean())
        accuracy = float((z.argmax(axis=1) == y).mean())
        return loss, accuracy


def _options() -> ort.SessionOptions:
    options = ort.SessionOptions()
    options.log_severity_level = 3  # errors only: no provider chatter on an edge device's console
    return options


def _providers() -> list[str]:
    """CUDA when this onnxruntime build has it, always with the CPU fallback."""
    available = ort.get_available_providers()
    return [p for p in ("CUDAExecutionProvider", "CPUExecutionProvider") if p in available]
