"""End-to-end evaluation (pipeline stage ``evaluate``): the original graph and every method's optimised graph run
on every backend, checked against the original, compared under the measurement protocol; the table, DVC metrics
and headline row.

- :mod:`rlflow.evaluation.memory`  the activation-memory estimate (liveness over the node order)
- :mod:`rlflow.evaluation.traces`  reading a method's ``trace.json`` (cost estimate, rules, seconds, interactions)
- :mod:`rlflow.evaluation.protocol` the measurement protocol: interleaved randomised rounds over several fresh
  sessions per graph, the ratio paired by round with its Student-t interval over the sessions, verdict, A/A control, the never-slower check
- :mod:`rlflow.evaluation.runs`    the output check and the protocol's comparisons per backend
- :mod:`rlflow.evaluation.tables`  ``evaluation.csv`` (its columns), ``metrics.json``, ``summary/<model>.json`` (pandas)
"""

from rlflow.evaluation.memory import activation_memory_bytes, activation_memory_mb
from rlflow.evaluation.runs import Measurement, OutputMismatch, evaluate_graphs
from rlflow.evaluation.tables import COLUMNS, METHOD_ORDER, headline, make_rows, metrics, to_csv
from rlflow.evaluation.traces import TraceSummary, load_trace

__all__ = ["activation_memory_bytes", "activation_memory_mb", "Measurement", "OutputMismatch", "evaluate_graphs",
           "COLUMNS", "METHOD_ORDER", "headline", "make_rows", "metrics", "to_csv", "TraceSummary", "load_trace"]
