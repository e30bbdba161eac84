"""The output check (max_rel_diff, check_equal) must not pass a rewrite that starts producing NaN or Inf: NaN and
infinite entries must match exactly (position and value), finite entries are compared on their own scale."""

from __future__ import annotations

import numpy as np
import pytest

from rlflow.errors import RLFlowError
from rlflow.graph.builder import GraphBuilder
from rlflow.graph.exec import max_rel_diff
from rlflow.graph.exec.check import check_equal

nan, inf = float("nan"), float("inf")


def diff(a, b) -> float:
    return max_rel_diff([np.array(a, np.float32)], [np.array(b, np.float32)])


def test_nan_where_the_original_is_finite_is_a_difference():
    assert diff([1, 2], [1, nan]) == inf  # was 0.0: max(0.0, nan) is 0.0
    assert diff([1, nan], [1, 2]) == inf
    assert diff([[1, 2], [3, 4]], [[1, 2], [3, nan]]) == inf


def test_nan_in_the_same_positions_is_equal():
    assert diff([1, nan, 3], [1, nan, 3]) == 0.0
    assert diff([nan, nan], [nan, nan]) == 0.0
    # the finite entries are still compared
    assert diff([nan, 2, 4], [nan, 2, 5]) == pytest.approx(1 / 4)


def test_infinities_do_not_hide_the_finite_entries():
    assert diff([1, inf], [5, inf]) == pytest.approx(4.0)  # was 0.0: the scale max|a| was inf
    assert diff([1, -inf], [1, -inf]) == 0.0
    assert diff([1000, inf], [1001, inf]) == pytest.approx(1e-3)  # scale 1000, the finite part's own


def test_nonfinite_values_must_match_exactly():
    assert diff([1, inf], [1, -inf]) == inf
    assert diff([1, inf], [1, nan]) == inf
    assert diff([1, 2], [1, inf]) == inf
    assert diff([1, inf], [1, 2]) == inf


def test_finite_values_on_their_own_scale():
    assert diff([100, 0], [100, 1]) == pytest.approx(0.01)  # relative to max |a| = 100
    assert diff([0.1, 0.2], [0.1, 0.7]) == pytest.approx(0.5)  # scale is at least 1
    assert diff([1, 2], [1, 2]) == 0.0
    # outputs are each taken on their own scale; the worst counts
    assert max_rel_diff([np.array([1000.0, 0]), np.array([1.0])],
                        [np.array([1000.0, 1]), np.array([1.5])]) == pytest.approx(0.5)
    assert max_rel_diff([np.zeros((2, 3))], [np.zeros((3, 2))]) == inf  # shapes differ


def _add_graph(c: np.ndarray):
    """y = x + c, x of shape (2, 4): a stand-in for an original graph and a rewrite of it that changed c."""
    b = GraphBuilder("add")
    return b.build([b.op("Add", [b.input("x", (2, 4)), b.const("c", c.astype(np.float32))], name="add")])


def test_check_equal_rejects_a_rewrite_that_makes_nan():
    zeros = np.zeros((2, 4))
    broken = zeros.copy()
    broken[1, 2] = nan
    assert check_equal(_add_graph(zeros), _add_graph(zeros)) == 0.0
    with pytest.raises(RLFlowError, match=r"output '.*' differs from the original's at 1 entry where one is NaN or "
                                          r"infinite"):
        check_equal(_add_graph(zeros), _add_graph(broken))


def test_check_equal_compares_the_finite_part_next_to_infinities():
    c = np.zeros((2, 4))
    c[0, 0] = inf
    moved = c.copy()
    moved[1, 1] = 4.0  # a finite entry changes; the infinite one stays
    assert check_equal(_add_graph(c), _add_graph(c)) == 0.0
    with pytest.raises(RLFlowError, match=r"differs from the original's by [0-9.]+ \(max"):
        check_equal(_add_graph(c), _add_graph(moved))
    flipped = c.copy()
    flipped[0, 0] = -inf
    with pytest.raises(RLFlowError, match="at 1 entry where one is NaN or infinite"):
        check_equal(_add_graph(c), _add_graph(flipped))
