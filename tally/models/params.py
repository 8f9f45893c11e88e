"""A torch module's parameters as numpy arrays keyed by state-dict name, and back: how parameters
cross the algorithm boundary, so algorithms stay framework-free and the wire carries plain tensors.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
from torch import nn

from tally.algorithms.base import Arrays, check_fits


def get_params(model: nn.Module) -> Arrays:
    return {k: v.detach().cpu().numpy().copy() for k, v in model.state_dict().items()}


def set_params(model: nn.Module, params: Mapping[str, np.ndarray]) -> None:
    state = model.state_dict()
    check_fits(params, {k: tuple(v.shape) for k, v in state.items()})
    model.load_state_dict({k: torch.as_tensor(np.asarray(params[k]), dtype=state[k].dtype) for k in state})
