"""Tally's own algorithms as entries of the ``tally.algorithms`` entry-point group (its
``pyproject.toml`` names each object below), each with the privacy role of every payload field.

The roles are declared here, beside the halves, so that an algorithm is one object wherever it
comes from; ``tally.privacy.sensitivity`` explains the roles and what a job with a ``privacy:``
section does with each.
"""

from __future__ import annotations

from typing import Any

from tally.algorithms.aaggff import AAggFFClient, AAggFFDOptions, AAggFFDServer, AAggFFSOptions, AAggFFSServer
from tally.algorithms.agnostic_fedavg import AgnosticFedAvgClient, AgnosticFedAvgOptions, AgnosticFedAvgServer
from tally.algorithms.fedavg import FedAvgClient, FedAvgOptions, FedAvgServer
from tally.algorithms.feddar import FedDARClient, FedDAROptions, FedDARSAOptions, FedDARSAServer, FedDARWAServer
from tally.algorithms.fedevg import FedEvgClient, FedEvgOptions, FedEvgServer
from tally.algorithms.lg_fedavg import LGFedAvgClient, LGFedAvgOptions, LGFedAvgServer
from tally.algorithms.packages import DOMAIN_STATISTICS, Algorithm, PrivacyRole
from tally.algorithms.superfed import SuPerFedClient, SuPerFedOptions, SuPerFedServer
from tally.version import VERSION


def _fedavg_weight(options: Any) -> str:
    """With ``example_cap: 1`` every device's weight is 1, so it is counted; otherwise
    (w*delta, w) are clipped jointly, which scales both by one factor and keeps each device's
    mean update (a clipped-weight FedAvg, its denominator noised too)."""
    return "counted" if options.example_cap == 1 else "clipped"


# FedAvg sums w*delta and w; its example count is a report the server half never reads. LG-FedAvg
# and SuPerFed sum FedAvg's payload over the shared part of the model (their personal layers never
# leave the device), with FedAvg's options: FedAvg's declaration holds for them.
_FEDAVG_PRIVACY: dict[str, PrivacyRole] = {"weighted_delta": "clipped", "weight": _fedavg_weight,
                                           "examples": "withheld"}


def _weight_clip(options: Any) -> float:
    """AAggFF's ``scale`` is the device weight the update step bounds by ``weight_clip``; its codec
    clip is 2^16 (room for fixed point, not a bound on the weight), so its bound is declared."""
    return float(options.weight_clip)


# AAggFF-D and separable AAggFF-S: losses, responses, weights and counts are bounded by their codec
# clips (a count is 0 or 1); the weighted update is clipped. AAggFF-S's ONS solver reveals
# responses, which differential privacy refuses.
_AAGGFF_PRIVACY: dict[str, PrivacyRole] = {
    "weighted_update": "clipped", "scale": _weight_clip,
    **dict.fromkeys(("loss", "count", "response", "weighted_response", "weight"), "bounded")}

# FedDAR-WA/-SA: the weighted heads and encoder update are model values, clipped; per-domain counts
# and weights, and SA's Hessians and Hessian-weighted heads, are bounded by their codec clips.
_FEDDAR_PRIVACY: dict[str, PrivacyRole] = {
    "weighted_heads": "clipped", "weighted_delta": "clipped",
    **dict.fromkeys(("counts", "weights", "weight", "hessians", "hessian_heads"), "bounded")}

FEDAVG = Algorithm("fedavg", VERSION, FedAvgOptions, FedAvgServer, FedAvgClient,
                   tuple(_FEDAVG_PRIVACY), _FEDAVG_PRIVACY,
                   summary="federated averaging of weighted model updates")
LG_FEDAVG = Algorithm("lg_fedavg", VERSION, LGFedAvgOptions, LGFedAvgServer, LGFedAvgClient,
                   tuple(_FEDAVG_PRIVACY), _FEDAVG_PRIVACY,
                      summary="FedAvg over the shared layers; the rest stay on each device")
SUPERFED = Algorithm("superfed", VERSION, SuPerFedOptions, SuPerFedServer, SuPerFedClient,
                   tuple(_FEDAVG_PRIVACY), _FEDAVG_PRIVACY,
                     summary="a federated and a personal model mixed in a low-loss subspace")
# AgnosticFedAvg sums beta*update, beta, per-domain loss sums and example counts: the update is
# clipped, the rest bounded by their codec clips (beta <= 1, loss_clip, count_clip).
AGNOSTIC_FEDAVG = Algorithm(
    "agnostic_fedavg", VERSION, AgnosticFedAvgOptions, AgnosticFedAvgServer, AgnosticFedAvgClient,
    ("weighted_update", "beta", "domain_loss", "domain_count"),
    {"weighted_update": "clipped", **dict.fromkeys(("beta", "domain_loss", "domain_count"), "bounded")},
    needs=(DOMAIN_STATISTICS,), summary="FedAvg against the worst mixture of domains")
AAGGFF_D = Algorithm("aaggff_d", VERSION, AAggFFDOptions, AAggFFDServer, AAggFFClient,
                   tuple(_AAGGFF_PRIVACY), _AAGGFF_PRIVACY,
                     summary="fair aggregation by online convex optimisation (cross-device)")
AAGGFF_S = Algorithm("aaggff_s", VERSION, AAggFFSOptions, AAggFFSServer, AAggFFClient,
                   tuple(_AAGGFF_PRIVACY), _AAGGFF_PRIVACY,
                     summary="fair aggregation by online convex optimisation (cross-silo)")
FEDDAR_WA = Algorithm("feddar_wa", VERSION, FedDAROptions, FedDARWAServer, FedDARClient,
                   tuple(_FEDDAR_PRIVACY), _FEDDAR_PRIVACY,
                      needs=(DOMAIN_STATISTICS,), summary="a shared encoder and per-domain heads, weighted average")
FEDDAR_SA = Algorithm("feddar_sa", VERSION, FedDARSAOptions, FedDARSAServer, FedDARClient,
                   tuple(_FEDDAR_PRIVACY), _FEDDAR_PRIVACY,
                      needs=(DOMAIN_STATISTICS,), summary="a shared encoder and per-domain heads, second-order")
# FedEvg's weighted energy gradients at the synthetic samples are clipped, their weights bounded.
FEDEVG = Algorithm("fedevg", VERSION, FedEvgOptions, FedEvgServer, FedEvgClient, ("weighted_gradient", "weight"),
                   {"weighted_gradient": "clipped", "weight": "bounded"},
                   summary="energy-based federated synthesis of a dataset")
