"""Tally's own model kinds as entries of the ``tally.models`` entry-point group (its
``pyproject.toml`` names each object below), versioned with tally: a device declares them at
check-in as it declares a package's."""

from __future__ import annotations

from tally.models import Model, imported
from tally.version import VERSION

MLP = Model("mlp", VERSION, imported("tally.models.mlp", "mlp"), summary="one hidden ReLU layer")
CNN = Model("cnn", VERSION, imported("tally.models.cnn", "digits_cnn"),
            summary="two convolutions and a linear head, for square grey images (8x8 digits)")
ENERGY_MLP = Model("energy_mlp", VERSION, imported("tally.models.energy", "energy_mlp"),
                   summary="FedEvg's energy model: SiLU layers, a spectral-normed head")
