"""The one minibatch loop (tally.training.sgd) that every torch trainer shuffles and steps
through: its batches are the seeded generator's permutation, and a trainer built on it takes
exactly the steps of the plain loop it replaced, to the bit, for the same seed."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from tally.models.params import get_params
from tally.training import TorchTrainer
from tally.training.sgd import mean_loss, minibatches

pytestmark = pytest.mark.usefixtures("one_thread")


def test_each_epoch_is_one_permutation_of_the_generator_cut_into_batches():
    batches = [b.tolist() for b in minibatches(10, 2, 4, torch.Generator().manual_seed(7))]
    reference = torch.Generator().manual_seed(7)
    first, second = torch.randperm(10, generator=reference).tolist(), torch.randperm(10, generator=reference).tolist()
    assert batches == [first[:4], first[4:8], first[8:], second[:4], second[4:8], second[8:]]
    assert first != second


def test_the_next_epochs_permutation_is_drawn_after_the_last_batch_is_taken():
    """A trainer that draws from the same generator inside a batch (SuPerFed's λ) sees the
    values it saw when each trainer had its own loop."""
    generator = torch.Generator().manual_seed(3)
    drawn = [float(torch.rand((), generator=generator)) for _ in minibatches(5, 2, 5, generator)]
    reference = torch.Generator().manual_seed(3)
    expected = []
    for _ in range(2):
        torch.randperm(5, generator=reference)
        expected.append(float(torch.rand((), generator=reference)))
    assert drawn == expected


def test_the_trainer_takes_the_steps_of_a_plain_sgd_loop_to_the_bit():
    rng = np.random.default_rng(0)
    features, labels = rng.normal(size=(23, 4)).astype(np.float32), rng.integers(0, 3, 23)

    def factory() -> nn.Module:
        torch.manual_seed(1)
        return nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))

    start = get_params(factory())
    trained, loss = TorchTrainer(factory, features, labels, seed=5, device=torch.device("cpu")).train(start, 3, 0.2, 5)

    model, generator = factory(), torch.Generator().manual_seed(5)
    x, y = torch.as_tensor(features), torch.as_tensor(labels, dtype=torch.long)
    optimiser = torch.optim.SGD(model.parameters(), lr=0.2)
    losses = []
    for _ in range(3):
        order = torch.randperm(23, generator=generator)
        for begin in range(0, 23, 5):
            idx = order[begin : begin + 5]
            optimiser.zero_grad()
            batch_loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
            batch_loss.backward()
            optimiser.step()
            losses.append(batch_loss.item())
    expected = get_params(model)
    assert all(np.array_equal(trained[k], expected[k]) for k in expected)
    assert loss == mean_loss(losses) == float(np.mean(losses))
    assert not np.array_equal(trained["0.weight"], start["0.weight"])


def test_no_batches_mean_a_zero_loss():
    assert list(minibatches(0, 3, 4, torch.Generator())) == []
    assert mean_loss([]) == 0.0
