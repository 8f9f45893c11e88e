"""The minibatch SGD loop every torch trainer shares: one place that decides how a device's
examples are shuffled and cut into batches, so two trainers given the same seed visit the same
examples in the same order, and a change to the loop cannot reach one trainer and miss another.

A trainer that draws more from its generator during a batch (SuPerFed's λ) stays reproducible:
the next epoch's permutation is drawn only once the last batch of this one has been taken.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import torch


def minibatches(n: int, epochs: int, batch_size: int, generator: torch.Generator,
                device: torch.device | None = None) -> Iterator[torch.Tensor]:
    """The example indices of each batch: a fresh permutation of ``range(n)`` from ``generator``
    every epoch, cut into runs of ``batch_size`` (the last one shorter), on ``device`` when given."""
    for _ in range(epochs):
        order = torch.randperm(n, generator=generator)
        if device is not None:
            order = order.to(device)
        for start in range(0, n, batch_size):
            yield order[start : start + batch_size]


def sgd_epochs(optimiser: torch.optim.Optimizer, loss_of_batch: Callable[[torch.Tensor], torch.Tensor], n: int,
               epochs: int, batch_size: int, generator: torch.Generator, device: torch.device | None = None) -> float:
    """One ``optimiser`` step on ``loss_of_batch(indices)`` for each of ``minibatches``; the mean
    batch loss (what a trainer reports as its training loss). The losses stay on the device until
    the loop ends: one copy to the host, not a synchronisation per batch on a GPU."""
    losses = []
    for indices in minibatches(n, epochs, batch_size, generator, device):
        optimiser.zero_grad()
        loss = loss_of_batch(indices)
        loss.backward()
        optimiser.step()
        losses.append(loss.detach())
    return mean_loss(torch.stack(losses).cpu().tolist() if losses else [])


def mean_loss(losses: list[float]) -> float:
    """The mean of the batch losses; 0 when there were none (no examples, or no epochs)."""
    return float(np.mean(losses)) if losses else 0.0
