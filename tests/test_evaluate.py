"""The evaluate stage (rlflow.evaluation, rlflow.stages.evaluate): the activation-memory estimate, interleaved
timing, the output check that refuses wrong graphs, unsupported backends, bad input, and the three outputs."""

from __future__ import annotations

import csv
import json
import shlex
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from rlflow.cli import main
from rlflow.errors import RLFlowError
from rlflow.evaluation import COLUMNS, activation_memory_bytes, activation_memory_mb, evaluate_graphs, load_trace
from rlflow.evaluation.traces import TRACE_FORMAT
from rlflow.graph.ir import Constant, Graph, Node, TensorType
from rlflow.pipeline.registry import MACHINE_AGENT_METHODS, MACHINE_METHODS, METHODS, STAGES

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ["--config", str(ROOT / "config.yaml"), "--config", str(ROOT / "tests/configs/tiny.yaml")]
RL_METHODS = ("model_free", "rlflow")
#: the device figures the module's calibration cache holds (so the roofline measures nothing): 1 GFLOP/s GEMM
#: and a bandwidth so high that every bound is compute-bound
GEMM, BANDWIDTH = 1e9, 1e18


@pytest.fixture(autouse=True)
def _calibration(tmp_path_factory, monkeypatch):
    from rlflow.cost import calibration
    from rlflow.cost.model import describe_hardware

    cache = tmp_path_factory.getbasetemp() / "evaluate-cache"
    monkeypatch.setenv("RLFLOW_CACHE_DIR", str(cache))
    path = calibration.default_path("cpu")
    if not path.exists():
        calibration.write(path, {"ort": calibration.Calibration("ort", "cpu", describe_hardware("cpu"), GEMM,
                                                                 BANDWIDTH, 1e-6)})


# ====================================================================================== the roofline
def test_roofline_bound_by_hand():
    from rlflow.evaluation.roofline import DeviceLimits, bound_ms, essential_bytes, graph_flops, headroom

    g = _liveness_graph("n_a")
    # must move: x and y (1 KiB each), W (read by n_a) and the folded W^T (read by n_y), 256 KiB each; not a, b,
    # c, d (intermediates), not W twice
    assert essential_bytes(g) == 2 * 256 * 4 + 2 * 256 * 256 * 4
    flops = graph_flops(g)
    assert flops >= 2 * (2 * 256 * 256)  # the two MatMuls; the transpose is folded and counts nothing
    compute = DeviceLimits(1e9, 1e18, "test")
    memory = DeviceLimits(1e18, 1e9, "test")
    assert bound_ms(g, compute) == pytest.approx(flops / 1e9 * 1e3)
    assert bound_ms(g, memory) == pytest.approx(essential_bytes(g) / 1e9 * 1e3)
    assert headroom(2.0, 8.0) == pytest.approx(0.75) and headroom(None, 8.0) is None and headroom(2.0, None) is None


def test_device_limits_are_the_best_calibrated_figures(tmp_path):
    from rlflow.cost import calibration
    from rlflow.evaluation.roofline import device_limits

    cals = {"ort": calibration.Calibration("ort", "cpu", "x", 300e9, 20e9, 1e-6),
            "torch": calibration.Calibration("torch", "cpu", "x", 200e9, 30e9, 1e-5)}
    path = tmp_path / "costs.json"
    calibration.write(path, cals)
    lim = device_limits("cpu", path)
    assert (lim.gemm_flops_per_s, lim.bandwidth_bytes_per_s) == (300e9, 30e9)
    assert "ort" in lim.source and "torch" in lim.source
    assert device_limits("cuda", path) is None  # CPU figures say nothing of a GPU


# ====================================================================================== activation memory
def _liveness_graph(dead_after: str) -> Graph:
    """x[1,256] -> a = x @ W -> b = relu(a) -> c = a + b -> y = c @ W^T, plus a dead value d = relu(x)[1,768]
    computed right after node ``dead_after``; W^T is a weight-only node (256 KiB: must not count)."""
    f = 4  # bytes per float32
    types = {"x": TensorType((1, 256)), "W": TensorType((256, 256)), "wt": TensorType((256, 256)),
             "a": TensorType((1, 256)), "b": TensorType((1, 256)), "c": TensorType((1, 256)),
             "y": TensorType((1, 256)), "d": TensorType((1, 768))}
    assert types["a"].nbytes == 256 * f and types["d"].nbytes == 768 * f
    chain = [Node("n_a", "MatMul", ("x", "W"), ("a",)), Node("n_wt", "Transpose", ("W",), ("wt",), {"perm": (1, 0)}),
             Node("n_b", "Relu", ("a",), ("b",)), Node("n_c", "Add", ("a", "b"), ("c",)),
             Node("n_y", "MatMul", ("c", "wt"), ("y",))]
    dead = Node("n_d", "Relu", ("x",), ("d",))
    k = [n.name for n in chain].index(dead_after) + 1
    nodes = chain[:k] + [dead] + chain[k:]
    return Graph(inputs=["x"], outputs=["y"], nodes=nodes, types=types,
                 constants={"W": Constant(np.zeros((256, 256), np.float32))})


def test_activation_memory_by_hand():
    # by hand, sizes in KiB (a, b, c, y: 1 each; d: 3; x is an input and W, W^T weights: not counted):
    #   d right after n_a:  n_a {a}=1 | n_d {a,d}=4, d dead -> {a} | n_b {a,b}=2 | n_c {a,b,c}=3 -> {c} | n_y {c,y}=2
    #   d right after n_b:  n_a 1 | n_b {a,b}=2 | n_d {a,b,d}=5 -> {a,b} | n_c 3 -> {c} | n_y 2
    #   d right after n_y:  ... n_c 3 | n_y {c,y}=2 -> {y} | n_d {y,d}=4
    assert activation_memory_bytes(_liveness_graph("n_a")) == 4 * 1024
    assert activation_memory_bytes(_liveness_graph("n_b")) == 5 * 1024
    assert activation_memory_bytes(_liveness_graph("n_y")) == 4 * 1024
    assert activation_memory_mb(_liveness_graph("n_b")) == 5 * 1024 / 2**20


def test_activation_memory_bounds_on_a_real_graph(tiny):
    from rlflow.evaluation.memory import weight_values
    from rlflow.graph.onnx_io import load_onnx

    g = load_onnx(tiny["onnx"])
    weights = weight_values(g)
    acts = [g.types[v].nbytes for n in g.nodes for v in n.outputs if v not in weights]
    peak = activation_memory_bytes(g)
    # at least the largest single intermediate plus its producer's input, at most everything at once
    assert max(acts) < peak < sum(acts)


# ====================================================================================== the protocol's timing
class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


class _FakeRunner:
    """Returns ``value`` everywhere; each call is logged and advances the fake clock by ``ms``."""

    def __init__(self, name: str, log: list, value: float, clock: _Clock | None = None, ms: float = 1.0):
        self.name, self.log, self.value, self.clock, self.ms = name, log, value, clock, ms
        self.ran_on, self.device_note = "cpu", ""

    def __call__(self, feeds):
        self.log.append(self.name)
        if self.clock is not None:
            self.clock.now += self.ms * (1 + 0.01 * np.sin(len(self.log))) / 1e3
        return [np.full((2, 3), self.value, np.float32)]


def _fake_graphs(ops: dict[str, str]) -> list[tuple[str, Graph]]:
    """method -> a one-op graph named after the method (equal ops: equal graphs, which share a check)."""
    types = {"x": TensorType((2, 3)), "y": TensorType((2, 3))}
    return [(m, Graph(inputs=["x"], outputs=["y"], nodes=[Node("n", op, ("x",), ("y",))], types=types, name=m))
            for m, op in ops.items()]


def _fake_runs(monkeypatch, log: list, built: list | None = None, values: dict | None = None,
               clock: _Clock | None = None, ms: dict | None = None, sessions: list | None = None) -> None:
    """first_run (the check) and new_runner (the protocol's sessions) build _FakeRunners named after their graph
    (first_run's recorded in ``built``, new_runner's in ``sessions``); outputs ``values[name]``; calls take
    ``ms[name]`` milliseconds of ``clock``; the A/A control is the original's graph renamed."""
    import rlflow.evaluation.runs as runs

    def first_run(g, backend, device, feeds, fresh=None):
        if built is not None:
            built.append((g.name, backend))
        v = (values or {}).get(g.name, 1.0)
        return _FakeRunner(g.name, [], v), [np.full((2, 3), v, np.float32)], None

    def new_runner(g, backend, device, fresh=None):
        if sessions is not None:
            sessions.append((g.name, backend))
        return _FakeRunner(g.name, log, 1.0, clock, (ms or {}).get(g.name, 1.0))

    def aa_copy(g):
        c = g.copy()
        c.name = runs.AA
        return c

    monkeypatch.setattr(runs, "reference_outputs", lambda g, feeds: [np.ones((2, 3), np.float32)])
    monkeypatch.setattr(runs, "first_run", first_run)
    monkeypatch.setattr(runs, "new_runner", new_runner)
    monkeypatch.setattr(runs, "aa_copy", aa_copy)


def _protocol(**kw):
    from rlflow.evaluation.protocol import Protocol

    return Protocol(**{"sessions": 2, "warmup": 1, "budget_s": 10.0, "min_rounds": 3, "max_rounds": 3,
                       **kw})


def test_timing_is_interleaved_in_random_rounds_over_fresh_sessions(monkeypatch):
    log, built, sessions = [], [], []
    _fake_runs(monkeypatch, log, built, sessions=sessions)
    graphs = _fake_graphs({"original": "Relu", "taso": "Sigmoid", "greedy": "Tanh"})
    res = evaluate_graphs(graphs, ["ort", "tf"], "cpu", _protocol(), aa=False, progress=False, log=lambda s: None)
    assert [(r.method, r.backend, r.status) for r in res] == [
        (m, b, "ok") for m in ("original", "taso", "greedy") for b in ("ort", "tf")]
    assert built == [(m, b) for b in ("ort", "tf") for m in ("original", "taso", "greedy")]  # checked once each
    # per backend, 2 blocks of fresh runners, one per graph each (built in a random order per block)
    blocks = [sorted(sessions[k:k + 3]) for k in range(0, len(sessions), 3)]
    assert blocks == [sorted((m, b) for m in ("original", "taso", "greedy")) for b in ("ort", "tf") for _ in range(2)]
    per_backend = 2 * 3 * (1 + 3)  # 2 sessions x 3 graphs x (1 warm-up + 3 timed rounds)
    assert len(log) == 2 * per_backend
    rounds = [log[3 * k: 3 * k + 3] for k in range(len(log) // 3)]
    assert all(sorted(r) == ["greedy", "original", "taso"] for r in rounds)  # every graph once per round
    assert len({tuple(r) for r in rounds}) > 1  # in random orders
    for r in res:
        assert [len(s) for s in r.times_ms] == [3, 3] and r.median_ms is not None
        assert (r.verdict == "reference") == (r.method == "original")
        assert r.method == "original" or r.ci_low <= r.ratio <= r.ci_high


def test_equal_graphs_share_one_check_and_one_estimate(monkeypatch):
    log, built, sessions = [], [], []
    _fake_runs(monkeypatch, log, built, sessions=sessions)
    graphs = _fake_graphs({"original": "Relu", "taso": "Tanh", "greedy": "Tanh", "model_free": "Relu"})
    res = evaluate_graphs(graphs, ["ort"], "cpu", _protocol(), aa=False, progress=False, log=lambda s: None)
    assert built == [("original", "ort"), ("taso", "ort")]  # greedy = taso's graph, model_free = the original
    # greedy shares taso's estimate; model_free (the original's graph, but a method) gets sessions of its own
    assert sorted(set(sessions)) == [("model_free", "ort"), ("original", "ort"), ("taso", "ort")]
    by = {r.method: r for r in res}
    assert by["greedy"].times_ms is by["taso"].times_ms and by["greedy"].ratio == by["taso"].ratio
    assert all(r.status == "ok" and len(r.times_ms) == 2 for r in res)


def test_the_aa_control_is_timed_and_a_failed_one_marks_the_backend_too_noisy(monkeypatch):
    clock = _Clock()
    log, sessions = [], []
    _fake_runs(monkeypatch, log, sessions=sessions, clock=clock, ms={"original": 10.0, "original-aa": 10.0,
                                                                     "taso": 8.0})
    graphs = _fake_graphs({"original": "Relu", "taso": "Tanh"})
    p = _protocol(sessions=4, max_rounds=20)
    res = evaluate_graphs(graphs, ["ort"], "cpu", p, progress=False, log=lambda s: None, clock=clock)
    by = {r.method: r for r in res}
    assert [r.method for r in res] == ["original", "original-aa", "taso"]
    assert ("original-aa", "ort") in sessions  # its own sessions, although it is the original's graph
    assert by["original-aa"].ci_low <= 1.0 <= by["original-aa"].ci_high and not by["taso"].too_noisy
    assert by["taso"].verdict == "faster" and by["taso"].ratio == pytest.approx(0.8, rel=0.02)
    # a method that kept the original graph shares the A/A control's estimate (no sessions of its own)
    sessions.clear()
    graphs3 = _fake_graphs({"original": "Relu", "taso": "Tanh", "greedy": "Relu"})
    res = evaluate_graphs(graphs3, ["ort"], "cpu", p, progress=False, log=lambda s: None, clock=clock)
    by = {r.method: r for r in res}
    assert ("greedy", "ort") not in sessions and by["greedy"].times_ms is by["original-aa"].times_ms
    assert by["greedy"].ratio == by["original-aa"].ratio
    # the A/A control running 10% slower than the original: the backend is too noisy, on every row
    clock2 = _Clock()
    _fake_runs(monkeypatch, [], clock=clock2, ms={"original": 10.0, "original-aa": 11.0, "taso": 8.0})
    lines = []
    res = evaluate_graphs(graphs, ["ort"], "cpu", p, progress=False, log=lines.append, clock=clock2)
    assert all(r.too_noisy for r in res) and res[1].verdict == "slower"
    assert "TOO NOISY" in lines[-1]
    from rlflow.evaluation.tables import finding

    assert finding(res[2].verdict, res[2].too_noisy) == "too noisy"


def test_every_ratio_gets_a_two_graph_comparisons_rounds_however_many_graphs_are_timed(monkeypatch):
    """timing.budget_s is a two-graph comparison's budget: six graphs timed together get three times as much, so
    each session runs as many rounds as when one method is compared with the original (the old shared budget gave
    them a third of the rounds)."""
    rounds = {}
    for ops in ({"original": "Relu", "taso": "Tanh"},
                {"original": "Relu", "taso": "Tanh", "greedy": "Sigmoid", "eqsat": "Neg", "rlflow": "Abs",
                 "model_free": "Exp"}):
        clock = _Clock()
        _fake_runs(monkeypatch, [], clock=clock, ms={m: 10.0 for m in ops})
        p = _protocol(budget_s=1.0, min_rounds=1, max_rounds=500)
        res = evaluate_graphs(_fake_graphs(ops), ["ort"], "cpu", p, aa=False, progress=False, log=lambda s: None,
                              clock=clock)
        rounds[len(ops)] = [len(t) for t in res[0].times_ms]
    assert all(k >= 20 for k in rounds[2]), rounds  # 0.5 s per session at 20 ms a round, less the warm-up
    assert all(abs(a - b) <= 1 for a, b in zip(rounds[2], rounds[6])), rounds


def test_comparisons_split_when_memory_is_short(monkeypatch):
    """With room for two runners at a time, each method is compared with the original on its own; the
    original's latency pools the sessions of every comparison."""
    import rlflow.evaluation.runs as runs

    log, built, sessions = [], [], []
    _fake_runs(monkeypatch, log, built, sessions=sessions)
    monkeypatch.setattr(runs, "batch_capacity", lambda footprint: 2)
    lines = []
    graphs = _fake_graphs({"original": "Relu", "taso": "Sigmoid", "greedy": "Tanh", "rlflow": "Tanh"})
    res = evaluate_graphs(graphs, ["ort"], "cpu", _protocol(), aa=False, progress=False, log=lines.append)
    assert built == [("original", "ort"), ("taso", "ort"), ("greedy", "ort")]  # rlflow = greedy's graph
    blocks = [sorted(sessions[k:k + 2]) for k in range(0, len(sessions), 2)]  # (built in a random order per block)
    assert blocks == [[("original", "ort"), ("taso", "ort")]] * 2 + [[("greedy", "ort"), ("original", "ort")]] * 2
    assert [len(r.times_ms) for r in res] == [4, 2, 2, 2]  # the original: 2 sessions in each of 2 comparisons
    assert "2 comparisons" in lines[-1]


def test_mismatch_of_an_optimised_graph_stops_before_timing(monkeypatch):
    import rlflow.evaluation.runs as runs

    log: list[str] = []
    values = {"original": 1.0, "taso": 1.0 + 2e-4}
    _fake_runs(monkeypatch, log, values=values)
    graphs = _fake_graphs({"original": "Relu", "taso": "Tanh"})
    with pytest.raises(runs.OutputMismatch) as err:
        evaluate_graphs(graphs, ["ort"], "cpu", _protocol(), tolerance=1e-4, progress=False)
    assert err.value.exit_code == 1 and "taso on ort" in str(err.value) and "0.0002" in str(err.value)
    assert log == []  # nothing timed (the checked first runs are the fake first_run's, not logged)
    # within the tolerance it passes
    values["taso"] = 1.0 + 5e-5
    res = evaluate_graphs(graphs, ["ort"], "cpu", _protocol(), tolerance=1e-4, aa=False, progress=False)
    assert [r.status for r in res] == ["ok", "ok"] and res[1].max_rel_diff == pytest.approx(5e-5, rel=1e-2)


# ====================================================================================== end to end on tiny graphs
def _write_trace(src: Path, dst: Path, method: str) -> None:
    """An RL method's trace: a search trace plus training seconds and real interactions."""
    doc = json.loads(src.read_text())
    doc.update(method=method, training_seconds=12.5, real_interactions={"training": 100, "evaluation": 7, "total": 107})
    dst.write_text(json.dumps(doc))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, tiny_zoo) -> dict:
    """Tiny bert and each method's graph and trace: taso, greedy, eqsat and eqsat-rl (its tree search, two leaves;
    both at tiny.yaml's 5,000 e-nodes: at the default 50,000 eqsat took 30 s on tiny bert) by
    the real searches (builtin rules, analytic cost; verified and written by rlflow.search.output), the RL methods as copies of greedy's graph with
    traces that add training_seconds and real_interactions."""
    from rlflow.cost import make_cost_model
    from rlflow.cost.platform import resolve_platform
    from rlflow.graph.onnx_io import load_onnx
    from rlflow.rewrite.builtin import verified_builtin_rules
    from rlflow.search.output import run_method, verify_and_write

    d = tmp_path_factory.mktemp("evaluate")
    paths = {"onnx": d / "model.onnx"}
    shutil.copyfile(tiny_zoo["bert"], paths["onnx"])
    g = load_onnx(paths["onnx"])
    rules, cost = verified_builtin_rules(), make_cost_model({}, "cpu", kind="analytic")
    platform = resolve_platform({"device": "cpu"}, "analytic").as_dict()  # what the stages record
    for m in ("taso", "greedy", "eqsat", "eqsat_rl"):
        paths[m], paths[f"{m}_trace"] = d / m / "model.onnx", d / m / "trace.json"
        eqsat = {"node_limit": 5000, "rl_leaves": 2} if m == "eqsat_rl" else {"node_limit": 5000}
        verify_and_write(g, run_method(m.replace("_", "-"), g, rules, cost, budget=20, eqsat=eqsat), paths[m],
                         paths[f"{m}_trace"], {"model": "r", "platform": platform})
    for m in RL_METHODS:
        (d / m).mkdir()
        paths[m], paths[f"{m}_trace"] = d / m / "model.onnx", d / m / "trace.json"
        paths[m].write_bytes(paths["greedy"].read_bytes())
        _write_trace(paths["greedy_trace"], paths[f"{m}_trace"], m)
    return paths


def _outputs(folder: Path) -> dict[str, Path]:
    return {"out": folder / "evaluation.csv", "metrics": folder / "metrics.json",
            "headline": folder / "summary" / "bert.json"}


def _argv(paths: dict, out: dict, methods=tuple(m for m in METHODS if m not in MACHINE_METHODS
                                                 and m not in MACHINE_AGENT_METHODS), sets=()
          ) -> list[str]:
    argv = ["evaluate", *CONFIGS, "--model", "bert", "--onnx", str(paths["onnx"]), "--no-progress"]
    for m in methods:
        flag = "--" + m.replace("_", "-")
        argv += [flag, str(paths[m]), flag + "-trace", str(paths[f"{m}_trace"])]
    for k, v in out.items():
        argv += [f"--{k}", str(v)]
    for s in sets:
        argv += ["--set", s]
    return argv


def _read_csv(path: Path) -> tuple[list[str], list[dict]]:
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    return rows[0], [dict(zip(rows[0], r)) for r in rows[1:]]


def test_the_table_orders_every_method_the_pipeline_evaluates():
    from rlflow.evaluation import METHOD_ORDER

    assert METHOD_ORDER == ("original", "original-aa", *METHODS) and {"eqsat", "eqsat_rl"} <= set(METHODS)


def test_registry_command_line_parses():
    from rlflow.cli import build_parser

    cmd = STAGES["evaluate"].dvc_cmd().replace("${item}", "bert")
    args = build_parser().parse_args(shlex.split(cmd)[1:])
    assert args.model == "bert" and str(args.onnx) == "results/bert/model.onnx"
    for m, folder in METHODS.items():
        if m in MACHINE_AGENT_METHODS:  # machine.agents is off in config.yaml: not passed
            assert getattr(args, m) is None and getattr(args, f"{m}_trace") is None
            continue
        assert str(getattr(args, m)) == f"results/bert/{folder}/model.onnx"
        assert str(getattr(args, f"{m}_trace")) == f"results/bert/{folder}/trace.json"
    assert str(args.headline) == "results/summary/bert.json"


def test_the_machine_agents_are_read_where_their_switch_is_on():
    """machine.agents on (configs/paper.yaml): evaluate's rule reads their graphs and traces and passes them."""
    from rlflow.config import load_config

    on = load_config([ROOT / "config.yaml", ROOT / "configs" / "paper.yaml"])
    st = STAGES["evaluate"]
    paths = st.input_paths(on, model="bert", device="cuda")
    shell = st.snakemake_shell(on)
    for m, folder in MACHINE_AGENT_METHODS.items():
        assert paths[f"{m}_onnx"] == f"results/bert/{folder}/model.onnx"
        assert f"--{m.replace('_', '-')} {{input.{m}_onnx:q}}" in shell
        assert m not in STAGES["evaluate"].input_paths(model="bert") and f"--{m.replace('_', '-')} " not in \
            STAGES["evaluate"].snakemake_shell()
    # the chain they come from: the machine track's own rollouts, encoder and world model
    ctl = STAGES["train_controller_machine"].input_paths(on, model="bert", device="cpu")
    assert ctl["world_model"] == "results/bert/machine/world_model/world_model.pt"
    assert ctl["costs"] == "results/costs/cpu/machine/bert.json"
    merge = STAGES["merge_rollouts_machine"]
    assert ("--shards-dir", "results/{model}/machine/rollouts") in merge.args
    assert merge.input_paths(on, model="bert")["shards"][0] == "results/bert/machine/rollouts/shard-0.json"


def test_all_methods_on_all_four_backends(tiny, tmp_path, capsys):
    out = _outputs(tmp_path)
    assert main(_argv(tiny, out, sets=["timing.budget_s=0.5", "timing.sessions=2", "timing.warmup=1",
                                       "evaluate.backends=[ort, torch, tf, tf-xla]"])) == 0
    header, rows = _read_csv(out["out"])
    assert tuple(header) == COLUMNS
    backends = ["ort", "torch", "tf", "tf-xla"]
    assert [(r["method"], r["backend"]) for r in rows] == [
        (m, b) for m in ("original", "original-aa", "taso", "greedy", "eqsat", "eqsat_rl", "model_free", "rlflow")
        for b in backends]
    for r in rows:
        assert r["model"] == "bert" and r["device"] == "cpu" and r["status"] == "ok", r
        assert float(r["latency_ms_median"]) > 0 and float(r["latency_ms_iqr"]) >= 0
        assert r["peak_memory_mb"] == ""  # the CPU backends cannot tell
        assert float(r["max_rel_diff"]) <= 1e-4
        assert float(r["activation_memory_mb"]) > 0 and int(r["nodes"]) > 0
        assert float(r["cost_ms"]) > 0 and float(r["flops"]) > 0 and float(r["bytes"]) > 0
        assert int(r["sessions"]) == 2 and int(r["runs"]) >= 2 * 3 and r["too_noisy"] in ("True", "False")
        if r["method"] == "original":
            assert (r["ratio"], r["ci_low"], r["verdict"]) == ("1", "", "reference")
        else:
            assert float(r["ci_low"]) <= float(r["ratio"]) <= float(r["ci_high"])
            assert r["verdict"] in ("faster", "slower", "no detectable difference")
            assert r["verdict"] == ("faster" if float(r["ci_high"]) < 1 else "slower" if float(r["ci_low"]) > 1
                                    else "no detectable difference")
            assert float(r["detectable_effect"]) > 0
    for r in rows:  # the roofline at the cached calibration: compute-bound, flops / 1 GFLOP/s. The CSV's 6
        # significant digits of each: near a headroom of 0 the recomputed one is off by up to about 1e-6 absolute
        assert float(r["headroom"]) == pytest.approx(1 - float(r["roofline_ms"]) / float(r["latency_ms_median"]),
                                                     rel=1e-4, abs=1e-5)
        if r["method"] in ("original", "original-aa"):
            assert float(r["roofline_ms"]) == pytest.approx(float(r["flops"]) / GEMM * 1e3, rel=1e-5)
    nodes = {r["method"]: int(r["nodes"]) for r in rows}
    assert nodes["greedy"] == nodes["original"] - 1  # tiny bert: greedy folds one constant add (a real rewrite)
    assert nodes["original-aa"] == nodes["original"]
    greedy_trace, taso_trace = load_trace(tiny["greedy_trace"]), load_trace(tiny["taso_trace"])
    for r in rows:
        if r["method"] in ("original", "original-aa"):
            assert r["optimisation_s"] == r["rules_applied"] == r["training_s"] == r["real_interactions"] == ""
            assert float(r["cost_ms"]) == pytest.approx(taso_trace.initial["runtime_ms"], rel=1e-5)
            assert r["backend"] != "ort" or float(r["max_rel_diff"]) == 0.0  # the reference itself
        else:
            t = load_trace(tiny[f"{r['method']}_trace"])
            assert float(r["cost_ms"]) == pytest.approx(t.final["runtime_ms"], rel=1e-5)
            if r["method"] in ("eqsat", "eqsat_rl"):  # no sequence of rewrites: they extract from an e-graph
                assert r["rules_applied"] == "" and t.rules_applied is None
            else:
                # TASO may reach its graph by more rewrites than greedy's one: it tries every operand order of
                # the commutative ops, so ties of cost come by other routes
                assert int(r["rules_applied"]) == t.rules_applied >= greedy_trace.rules_applied
            assert float(r["optimisation_s"]) == pytest.approx(t.optimisation_s, rel=1e-5)
            rl = r["method"] in RL_METHODS
            assert (r["training_s"], r["real_interactions"]) == (("12.5", "107") if rl else ("", ""))
    by = {(r["method"], r["backend"]): r for r in rows}
    metrics = json.loads(out["metrics"].read_text())
    assert metrics["max_rel_diff"] == pytest.approx(max(float(r["max_rel_diff"]) for r in rows), rel=1e-5)
    assert set(metrics["too_noisy"]) == set(backends)
    for m in ("original-aa", "taso", "greedy", "eqsat", "eqsat_rl", "model_free", "rlflow"):
        for b in backends:
            got = metrics["ratio"][m][b]
            assert got["ratio"] == pytest.approx(float(by[(m, b)]["ratio"]), rel=1e-5)
            assert got["ci_low"] == pytest.approx(float(by[(m, b)]["ci_low"]), rel=1e-5)
            assert got["verdict"] == by[(m, b)]["verdict"]
        if m != "original-aa":  # improvement vs TF: the method on tf against the original on tf, same comparison
            tf = metrics["improvement_vs_tf"][m]
            assert tf["ratio"] == metrics["ratio"][m]["tf"]["ratio"]
            assert tf["pct"] == pytest.approx(100 * (1 - tf["ratio"]))
            assert tf["pct_low"] == pytest.approx(100 * (1 - tf["ci_high"]))
    assert metrics["real_interactions"] == {"model_free": 107, "rlflow": 107}
    assert metrics["roofline"]["gemm_gflops"] == pytest.approx(GEMM / 1e9)
    assert metrics["roofline"]["bound_ms"]["taso"] == pytest.approx(float(by[("taso", "ort")]["roofline_ms"]), rel=1e-5)
    assert metrics["roofline"]["headroom"]["greedy"]["tf"] == pytest.approx(float(by[("greedy", "tf")]["headroom"]),
                                                                           rel=1e-5)
    head = json.loads(out["headline"].read_text())
    assert head["model"] == "bert" and head["device"] == "cpu" and head["backends"] == backends
    assert head["format"] == "rlflow.evaluation-headline/3"
    for m, h in head["methods"].items():
        assert "best_backend" not in h and set(h["backends"]) == set(backends)
        for b, e in h["backends"].items():
            assert e["latency_ms"] == pytest.approx(float(by[(m, b)]["latency_ms_median"]), rel=1e-5)
            assert e["finding"] == ("too noisy" if head["too_noisy"][b] and m != "original" else e["verdict"])
    assert head["methods"]["rlflow"]["real_interactions"] == 107 and head["methods"]["taso"]["training_s"] is None
    printed = capsys.readouterr().out
    assert "evaluate: wrote" in printed and "original-aa" in printed


def _altered_copy(src: Path, dst: Path, scale: float) -> None:
    """The same model with its first weight scaled: it computes something else."""
    model = onnx.load(str(src))
    init = max(model.graph.initializer, key=lambda t: int(np.prod(t.dims)))
    arr = onnx.numpy_helper.to_array(init) * np.float32(scale)
    init.CopyFrom(onnx.numpy_helper.from_array(arr.astype(np.float32), init.name))
    onnx.save(model, str(dst))


def test_a_wrong_graph_fails_and_writes_nothing(tiny, tmp_path, capsys):
    paths = dict(tiny, greedy=tmp_path / "wrong.onnx")
    _altered_copy(tiny["greedy"], paths["greedy"], 1.5)
    out = _outputs(tmp_path / "out")
    code = main(_argv(paths, out, methods=("taso", "greedy"),
                      sets=["evaluate.backends=[torch, ort]", "timing.budget_s=0.5"]))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1
    assert len(err) == 1 and err[0].startswith("rlflow: error: greedy on torch:"), err
    assert "tolerance 0.0001" in err[0]
    assert not any(p.exists() for p in out.values()) and not (tmp_path / "out").exists()


def test_same_as_original_says_which_methods_graph_is_the_original(tiny, tmp_path):
    """A method whose ONNX file is the original's (it found nothing, or its stage kept the original) is marked
    same_as_original in evaluation.csv and in the headline, with its trace's platform and estimates; a method
    with a graph of its own is not."""
    paths = dict(tiny, taso=tiny["onnx"])  # TASO delivers the original graph
    platforms = {"taso": {"target": "sim-h100", "label": "simulated H100", "device": "cuda", "backend": None,
                          "verifiable": False},
                 "greedy": {"target": "ort-cpu", "label": "onnxruntime CPU", "device": "cpu", "backend": "ort",
                            "verifiable": True}}
    for m, platform in platforms.items():
        doc = json.loads(Path(tiny[f"{m}_trace"]).read_text())
        doc.update(platform=platform, format=TRACE_FORMAT)
        paths[f"{m}_trace"] = tmp_path / f"{m}-trace.json"
        paths[f"{m}_trace"].write_text(json.dumps(doc))
    trace = json.loads(paths["greedy_trace"].read_text())
    out = _outputs(tmp_path / "out")
    assert main(_argv(paths, out, methods=("taso", "greedy"),
                      sets=["evaluate.backends=[ort]", "timing.budget_s=0.5", "timing.sessions=2"])) == 0
    header, rows = _read_csv(out["out"])
    assert header[-1] == "same_as_original"
    assert {r["method"]: r["same_as_original"] for r in rows} == {
        "original": "True", "original-aa": "True", "taso": "True", "greedy": "False"}
    head = json.loads(out["headline"].read_text())
    assert head["format"] == "rlflow.evaluation-headline/3"
    taso, greedy = head["methods"]["taso"], head["methods"]["greedy"]
    assert (taso["same_as_original"], greedy["same_as_original"]) == (True, False)
    assert greedy["platform"]["target"] == "ort-cpu" and greedy["platform"]["verifiable"] is True
    assert taso["platform"] == platforms["taso"]
    assert greedy["estimate_ms"] == pytest.approx(trace["final"]["runtime_ms"])
    assert greedy["original_estimate_ms"] == pytest.approx(trace["initial"]["runtime_ms"])


def test_unsupported_backend_is_a_row_not_a_failure(tmp_path, capsys):
    """tf-xla refuses an opaque op: its rows say 'unsupported' with no latency; onnxruntime's rows are measured."""
    paths, out = _opaque_case(tmp_path)
    code = main(_argv(paths, out, methods=("greedy",),
                      sets=["evaluate.backends=[ort, tf-xla]", "timing.budget_s=0.5", "timing.sessions=2"]))
    printed = capsys.readouterr().out
    assert code == 0
    _, rows = _read_csv(out["out"])
    assert [(r["method"], r["backend"], r["status"]) for r in rows] == [
        ("original", "ort", "ok"), ("original", "tf-xla", "unsupported"),
        ("original-aa", "ort", "ok"), ("original-aa", "tf-xla", "unsupported"),
        ("greedy", "ort", "ok"), ("greedy", "tf-xla", "unsupported")]
    for r in rows:
        assert (r["latency_ms_median"] == "") == (r["status"] == "unsupported")
        assert r["rules_applied"] == ("0" if r["method"] == "greedy" else "")
    lines = [s for s in printed.splitlines() if "tf-xla cannot run" in s]
    assert len(lines) == 3 and "opaque op Elu" in lines[0]
    head = json.loads(out["headline"].read_text())
    assert set(head["methods"]["greedy"]["backends"]) == {"ort"}
    assert head["methods"]["greedy"]["improvement_vs_tf"] is None  # tf was not run


def _opaque_case(tmp_path) -> tuple[dict, dict]:
    """An ONNX model with an opaque op (Elu), evaluated as the original and as greedy's graph."""
    from onnx_models import with_opaque_op

    src = tmp_path / "opaque.onnx"
    onnx.save(with_opaque_op(), str(src))
    trace = {"format": TRACE_FORMAT, "method": "greedy", "steps": [], "seconds": 0.5,
             "platform": {"target": "ort-cpu", "label": "onnxruntime CPU (kernels timed)", "device": "cpu",
                          "backend": "ort", "verifiable": True},
             "initial": {"nodes": 4, "runtime_ms": 1.0, "flops": 10, "bytes": 20, "launches": 4},
             "final": {"nodes": 4, "runtime_ms": 1.0, "flops": 10, "bytes": 20, "launches": 4}}
    (tmp_path / "trace.json").write_text(json.dumps(trace))
    return {"onnx": src, "greedy": src, "greedy_trace": tmp_path / "trace.json"}, _outputs(tmp_path / "out")


def test_unsupported_is_decided_before_running(monkeypatch):
    """'unsupported' comes from the graph alone (tf-xla and an opaque op; an op without a TF lowering): the
    backend's runner is never built for it."""
    import rlflow.evaluation.runs as runs

    log, built = [], []
    _fake_runs(monkeypatch, log, built)
    graphs = _fake_graphs({"original": "Relu", "taso": "Tanh"})
    opaque = Node("o", "Opaque", ("x",), ("y",), {"op_type": "Elu", "domain": ""})
    graphs[1] = ("taso", Graph(inputs=["x"], outputs=["y"], nodes=[opaque], types=graphs[1][1].types, name="taso"))
    assert runs.unsupported_reason(graphs[1][1], "tf") is None and runs.unsupported_reason(graphs[1][1], "ort") is None
    lines = []
    res = evaluate_graphs(graphs, ["ort", "tf-xla"], "cpu", _protocol(), aa=False, progress=False,
                          log=lines.append)
    assert [(r.method, r.backend, r.status) for r in res] == [
        ("original", "ort", "ok"), ("original", "tf-xla", "ok"), ("taso", "ort", "ok"),
        ("taso", "tf-xla", "unsupported")]
    assert ("taso", "tf-xla") not in built and ("taso", "ort") in built
    assert "opaque op Elu" in res[3].reason and res[3].median_ms is None
    # an op the tf backends have no lowering for, named
    import dataclasses

    from rlflow.graph.ops import OPS

    monkeypatch.setitem(OPS, "Tanh", dataclasses.replace(OPS["Tanh"], tf=None))
    assert runs.unsupported_reason(_fake_graphs({"m": "Tanh"})[0][1], "tf") == \
        "the tf backend has no lowering for op(s) Tanh"


def test_a_backend_crash_fails_the_stage(monkeypatch):
    """An exception while a runner is built or run is a failure naming method, backend and cause, not a row."""
    import rlflow.evaluation.runs as runs

    log: list[str] = []
    _fake_runs(monkeypatch, log)
    fake = runs.first_run

    def crashing(g, backend, device, feeds, fresh=None):
        if g.name == "greedy" and backend == "torch":
            raise RuntimeError("CUDA error: an illegal memory access was encountered\nmore detail")
        return fake(g, backend, device, feeds)

    monkeypatch.setattr(runs, "first_run", crashing)
    graphs = _fake_graphs({"original": "Relu", "taso": "Tanh", "greedy": "Sigmoid"})
    with pytest.raises(runs.BackendFailure) as err:
        evaluate_graphs(graphs, ["ort", "torch"], "cpu", _protocol(), progress=False, log=lambda s: None)
    msg = str(err.value)
    assert err.value.exit_code == 2 and "\n" not in msg
    assert msg.startswith("greedy on torch (cpu): the backend failed") and "RuntimeError: CUDA error: an illegal" in msg


def test_a_backend_crash_writes_nothing(tmp_path, capsys, monkeypatch):
    """The stage: a backend raising on a graph is one line naming method, backend and cause; exit 2; no files."""
    import rlflow.evaluation.runs as runs

    real = runs.first_run

    def crashing(g, backend, device, feeds, fresh=None):
        if backend == "torch":
            raise ValueError("boom in the torch runner")
        return real(g, backend, device, feeds)

    monkeypatch.setattr(runs, "first_run", crashing)
    paths, out = _opaque_case(tmp_path)
    code = main(_argv(paths, out, methods=("greedy",), sets=["evaluate.backends=[ort, torch]",
                                                              "timing.budget_s=0.5"]))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    device = "cuda" if torch.cuda.is_available() else "cpu"  # config.yaml's device: auto
    assert err == [f"rlflow: error: original on torch ({device}): the backend failed while building or running the graph: "
                   "ValueError: boom in the torch runner; nothing written"], err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("damage", ["missing_onnx", "corrupt_onnx", "missing_trace", "bad_json", "wrong_format",
                                    "no_final", "half_a_method", "other_model"])
def test_bad_input_is_one_line_exit_2_and_no_output(tiny, tmp_path, capsys, damage):
    paths = dict(tiny)
    methods = ("greedy",)
    if damage == "missing_onnx":
        paths["greedy"] = tmp_path / "absent.onnx"
    elif damage == "corrupt_onnx":
        paths["greedy"] = tmp_path / "corrupt.onnx"
        paths["greedy"].write_bytes(tiny["greedy"].read_bytes()[:1000])
    elif damage == "other_model":  # a graph with other inputs: not an optimised version of this model
        from onnx_models import with_opaque_op

        paths["greedy"] = tmp_path / "other.onnx"
        onnx.save(with_opaque_op(), str(paths["greedy"]))
    elif damage == "half_a_method":
        paths["taso_trace"] = None
        methods = ("greedy", "taso")
    else:
        paths["greedy_trace"] = tmp_path / "trace.json"
        if damage == "bad_json":
            paths["greedy_trace"].write_text("{not json")
        elif damage == "wrong_format":
            paths["greedy_trace"].write_text(json.dumps({"format": "something/1"}))
        elif damage == "no_final":
            doc = json.loads(tiny["greedy_trace"].read_text())
            del doc["final"]["runtime_ms"]
            paths["greedy_trace"].write_text(json.dumps(doc))
    out = _outputs(tmp_path / "out")
    argv = _argv({k: v for k, v in paths.items()}, out, methods=methods, sets=["evaluate.backends=[ort]"])
    argv = [a for i, a in enumerate(argv) if not (a == "None" or (i + 1 < len(argv) and argv[i + 1] == "None"))]
    code = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("rlflow: error: "), err
    expect = {"missing_onnx": "absent.onnx", "corrupt_onnx": "corrupt.onnx", "missing_trace": "trace file not found",
              "bad_json": "not valid JSON", "wrong_format": "something/1", "no_final": "final.runtime_ms",
              "half_a_method": "--taso-trace", "other_model": "greedy's graph: inputs ['x']"}[damage]
    assert expect in err[0], err
    assert not (tmp_path / "out").exists()


def test_load_trace_reads_rl_fields(tmp_path, tiny):
    t = load_trace(tiny["rlflow_trace"])
    assert t.training_s == 12.5 and t.real_interactions == 107
    s = load_trace(tiny["taso_trace"])
    assert s.training_s is None and s.real_interactions is None and s.rules_applied == len(
        json.loads(tiny["taso_trace"].read_text())["steps"])
    doc = json.loads(tiny["rlflow_trace"].read_text())
    doc["real_interactions"] = {"training": 3}
    (tmp_path / "t.json").write_text(json.dumps(doc))
    with pytest.raises(RLFlowError, match="real_interactions' has no 'total'"):
        load_trace(tmp_path / "t.json")
