"""Cost targets (ort-cpu, torch-eager and cuda measured; sim-v100/a100/h100 simulated; analytic), the device
calibration they use, and the metrics they produce."""

from rlflow.cost.metrics import METRIC_NAMES, Metrics
from rlflow.cost.model import AnalyticCost, CostModel, MeasuredCost, signature
from rlflow.cost.targets import TARGETS, make_cost_model, resolve_target

__all__ = ["METRIC_NAMES", "Metrics", "CostModel", "AnalyticCost", "MeasuredCost", "TARGETS", "make_cost_model",
           "resolve_target", "signature"]
