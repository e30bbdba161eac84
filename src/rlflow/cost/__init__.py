"""Cost models (analytic roofline; measured per op with a cache) and the metrics they produce."""

from rlflow.cost.metrics import METRIC_NAMES, Metrics
from rlflow.cost.model import AnalyticCost, CostModel, MeasuredCost, make_cost_model, signature

__all__ = ["METRIC_NAMES", "Metrics", "CostModel", "AnalyticCost", "MeasuredCost", "make_cost_model", "signature"]
