"""The Python API (rlflow.optimize, estimate_cost, load, save): docs/api.md's session runs as written, the API
returns the kind of model it was given, bad input is an RLFlowError with one line, and `rlflow optimize` runs
through it. Also `rlflow --help`'s command list."""

from __future__ import annotations

import doctest
import re
from pathlib import Path

import onnx
import pytest

import onnx_models
import rlflow
from rlflow.cli import STAGE_COMMANDS, USER_COMMANDS, build_parser, main
from rlflow.errors import RLFlowError
from rlflow.graph.exec.check import check_equal
from rlflow.graph.ir import Graph

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def mlp(tmp_path, monkeypatch) -> Path:
    """model.onnx (tests/onnx_models.shared_input_mlp) in an otherwise empty working folder."""
    monkeypatch.chdir(tmp_path)
    onnx.save(onnx_models.shared_input_mlp(), "model.onnx")
    return tmp_path / "model.onnx"


def test_api_page_runs_as_written(mlp):
    result = doctest.testfile(str(ROOT / "docs/api.md"), module_relative=False, optionflags=doctest.ELLIPSIS)
    assert result.attempted >= 10 and result.failed == 0
    assert (mlp.parent / "fast.onnx").is_file()


def test_optimize_returns_the_kind_it_was_given_and_computes_the_same(mlp):
    original = rlflow.load(mlp)
    as_graph = rlflow.optimize(original, target="sim-h100")
    assert isinstance(as_graph, Graph) and len(as_graph.nodes) < 6
    for given in (mlp, str(mlp), mlp.read_bytes(), onnx.load(mlp)):
        fast = rlflow.optimize(given, target="analytic", speed_check=False)
        assert isinstance(fast, onnx.ModelProto)
        assert check_equal(original, rlflow.load(fast)) < 1e-5
    assert rlflow.estimate_cost(as_graph, target="sim-h100")["runtime_ms"] < \
        rlflow.estimate_cost(original, target="sim-h100")["runtime_ms"]


@pytest.mark.parametrize("call, message", [
    (lambda m: rlflow.optimize(42), "expected a path, ONNX bytes, an onnx.ModelProto or an rlflow Graph, got int"),
    (lambda m: rlflow.optimize(m.parent / "none.onnx"), "none.onnx: no such file"),
    (lambda m: rlflow.optimize(m, method="annealing"), "unknown method 'annealing'"),
    (lambda m: rlflow.optimize(m, rules=m.parent / "none.json"), "none.json: rules file not found"),
    (lambda m: rlflow.optimize(m, method="rlflow"), "--method rlflow needs --agent CKPT"),
    (lambda m: rlflow.estimate_cost(m, target="tpu"), "tpu"),
    (lambda m: rlflow.load(m, input_shapes={"nope": (1, 64)}), "nope"),
])
def test_bad_input_is_one_line(mlp, call, message):
    with pytest.raises(RLFlowError) as e:
        call(mlp)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_the_command_line_runs_the_api(mlp, monkeypatch, capsys):
    seen = []
    real = rlflow.api.Optimiser.run

    def spy(self, graph, **kw):
        seen.append((self.method, self.kind, kw["model_name"]))
        return real(self, graph, **kw)

    monkeypatch.setattr(rlflow.api.Optimiser, "run", spy)
    assert main(["optimize", "model.onnx", "--out", "fast.onnx", "--target", "sim-h100", "--no-progress"]) == 0
    assert seen == [("eqsat", "sim-h100", "model.onnx")]
    assert "wrote fast.onnx" in capsys.readouterr().out
    assert len(rlflow.load("fast.onnx").nodes) < 6


def test_help_lists_user_commands_then_stages_each_once():
    parser = build_parser()
    text = parser.format_help()
    users, stages = text.index("user commands:"), text.index("pipeline stages")
    assert users < stages
    commands = parser._subparsers._group_actions[0].choices
    listed = [line.split()[0] for line in text[users:].splitlines() if re.match(r"  \S", line)]
    assert len(listed) == len(set(listed)) == len(USER_COMMANDS) + len(STAGE_COMMANDS)  # each listed once
    assert set(listed) == set(commands) - {"rollouts"}  # collect-rollouts' alias is listed beside it
    assert listed.index("optimize") < listed.index("export-model")
    assert "generate-rules" in commands  # the stage's command; `rules generate` was a second name for it
    with pytest.raises(SystemExit):
        parser.parse_args(["rules", "generate", "--out", "x.json"])
