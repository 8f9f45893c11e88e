"""FedEvg's device side in torch (``tally.algorithms.fedevg.EnergyDevice``), the energy model it
trains, and what one does with FedEvg's result: a classifier trained only on the synthetic set,
and the set exported as NumPy and as an image grid.

A classifier f is read as an energy-based model with joint energy E(x, y) = -f(x)[y] (JEM). Local
training is cross-entropy on real data, lambda x cross-entropy on the synthetic batch, and the PCD
term f(x~_R)[y~] - f(x)[y] whose negative samples come from one SGLD step on persistent chains
started at the downloaded synthetic set (spec §2.2).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch
from torch import nn

from tally.algorithms.base import Arrays
from tally.algorithms.fedevg import SYNTHETIC_X, SYNTHETIC_Y, FedEvgOptions
from tally.models.params import get_params, set_params
from tally.training import DeviceTensors


class EnergyTrainer(DeviceTensors):
    """One device's data and energy model. Its randomness (batches, SGLD noise) is seeded, so a
    simulation and the same devices through the services train alike."""

    def _draw(self, population: int, size: int) -> torch.Tensor:
        return torch.randint(population, (size,), generator=self.generator).to(self.device)

    def _at_label(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.model(x).gather(1, y[:, None]).squeeze(1)

    def sgld(self, x: torch.Tensor, y: torch.Tensor, options: FedEvgOptions) -> torch.Tensor:
        """One step x + gamma grad_x f(x)[y] + sigma eps (descent on E = -f[y]), the gradient
        clipped as the uploads are."""
        x = x.detach().requires_grad_(True)
        (gradient,) = torch.autograd.grad(self._at_label(x, y).sum(), x)
        noise = torch.randn(x.shape, generator=self.generator).to(self.device)
        moved = x + options.sgld_step * gradient.clamp(-options.gradient_clip, options.gradient_clip) \
            + options.sgld_noise * noise
        if options.input_range is not None:
            moved = moved.clamp(*options.input_range)
        return moved.detach()

    def train_energy(self, params: Mapping[str, np.ndarray], synthetic_x: np.ndarray, synthetic_y: np.ndarray,
                     options: FedEvgOptions) -> Arrays:
        set_params(self.model, params)
        self.model.train()
        optimiser = torch.optim.Adam(self.model.parameters(), lr=options.local_lr)
        chains = torch.as_tensor(synthetic_x, dtype=torch.float32, device=self.device).clone()
        labels = torch.as_tensor(synthetic_y, dtype=torch.long, device=self.device)
        batch = min(options.batch_size, self.num_examples)
        for _ in range(options.local_iterations):
            real = self._draw(self.num_examples, batch)
            fake = self._draw(len(chains), min(options.batch_size, len(chains)))
            start, fake_y = chains[fake], labels[fake]
            sampled = self.sgld(start, fake_y, options)
            x, y = self.features[real], self.labels[real]
            pcd = pcd_loss(self.model, x, y, sampled, fake_y)
            ce = nn.functional.cross_entropy(self.model(x), y) \
                + options.synthetic_weight * nn.functional.cross_entropy(self.model(start), fake_y)
            optimiser.zero_grad()
            (pcd + ce).backward()
            optimiser.step()
            chains[fake] = sampled  # persistent chains
        return get_params(self.model)

    def energy_signals(self, params: Mapping[str, np.ndarray], x: np.ndarray,
                       y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        set_params(self.model, params)
        self.model.eval()
        inputs = torch.as_tensor(x, dtype=torch.float32, device=self.device).requires_grad_(True)
        at_label = self._at_label(inputs, torch.as_tensor(y, dtype=torch.long, device=self.device))
        (gradient,) = torch.autograd.grad(at_label.sum(), inputs)
        return at_label.detach().cpu().numpy().astype(np.float64), -gradient.cpu().numpy().astype(np.float64)


def pcd_loss(model: nn.Module, real_x: torch.Tensor, real_y: torch.Tensor, sampled_x: torch.Tensor,
             sampled_y: torch.Tensor) -> torch.Tensor:
    """E(x, y) - E(x~_R, y~) = f(x~_R)[y~] - f(x)[y], batch means (spec §2.2, reconstructed): its
    descent raises the real samples' logits and lowers the sampled ones'."""
    real = model(real_x).gather(1, real_y[:, None]).mean()
    sampled = model(sampled_x).gather(1, sampled_y[:, None]).mean()
    return sampled - real


def synthetic_classifier_accuracy(synthetic: Mapping[str, np.ndarray], test_x: np.ndarray, test_y: np.ndarray,
                                  *, hidden: int = 64, steps: int = 300, seed: int = 0) -> float:
    """Accuracy on real held-out data of a fresh classifier trained only on the synthetic set
    (Adam, lr 1e-3, full batch): FedEvg's utility measure."""
    x = torch.as_tensor(synthetic[SYNTHETIC_X], dtype=torch.float32)
    y = torch.as_tensor(synthetic[SYNTHETIC_Y], dtype=torch.long)
    torch.manual_seed(seed)
    classifier = nn.Sequential(nn.Linear(x.shape[1], hidden), nn.ReLU(), nn.Linear(hidden, int(y.max()) + 1))
    optimiser = torch.optim.Adam(classifier.parameters(), lr=1e-3)
    for _ in range(steps):
        optimiser.zero_grad()
        nn.functional.cross_entropy(classifier(x), y).backward()
        optimiser.step()
    with torch.no_grad():
        predicted = classifier(torch.as_tensor(test_x, dtype=torch.float32)).argmax(1).numpy()
    return float(np.mean(predicted == np.asarray(test_y)))


def export_synthetic(synthetic: Mapping[str, np.ndarray], directory: Path, image_side: int | None = None) -> list[Path]:
    """``synthetic.npz`` (inputs and labels) and, for images ``image_side`` pixels square, a PNG
    grid with one row per class."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    x, y = np.asarray(synthetic[SYNTHETIC_X]), np.asarray(synthetic[SYNTHETIC_Y])
    written = [directory / "synthetic.npz"]
    np.savez(written[0], x=x, y=y)
    if image_side is not None:
        classes = np.unique(y)
        per_class = max(int(np.sum(y == c)) for c in classes)
        fig, axes = plt.subplots(len(classes), per_class, figsize=(per_class * 0.6, len(classes) * 0.6),
                                 squeeze=False)
        for row, c in enumerate(classes):
            images = x[y == c].reshape(-1, image_side, image_side)
            for col in range(per_class):
                ax = axes[row][col]
                ax.axis("off")
                if col < len(images):
                    ax.imshow(images[col], cmap="gray")
        fig.suptitle("FedEvg synthetic set (one row per class)")
        written.append(directory / "synthetic.png")
        fig.savefig(written[1], dpi=80)
        plt.close(fig)
    return written
