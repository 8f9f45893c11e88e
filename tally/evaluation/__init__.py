"""Federated evaluation: model quality as secure sums (docs/evaluation.md).

``EvaluationPlan`` says what a round measures; ``EvaluatedServer`` and ``EvaluatedClient`` wrap
any algorithm's halves to carry it in the round's last sum; ``quality`` turns the totals into the
figures a person reads. No device's own metric is ever released: only sums and histograms of
one-hot counts.
"""

from tally.evaluation.client import EvaluatedClient, held_out_views
from tally.evaluation.plan import BUILT_IN, DEFAULT_METRICS, CustomMetric, EvaluationError, EvaluationPlan
from tally.evaluation.server import EvaluatedServer
from tally.evaluation.summary import is_quality, quality, worst_decile

__all__ = ["BUILT_IN", "DEFAULT_METRICS", "CustomMetric", "EvaluatedClient", "EvaluatedServer", "EvaluationError",
           "EvaluationPlan", "held_out_views", "is_quality", "quality", "worst_decile"]
