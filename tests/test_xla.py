"""rlflow.xla and rlflow/XlaPassOrder-v0 on tiny modules: real XLA passes in the crash-isolated worker."""

from __future__ import annotations

import importlib.util
import math
import re

import numpy as np
import pytest

if importlib.util.find_spec("jax") is None or importlib.util.find_spec("xla_plugins.xla_cpu_pjrt") is None:
    pytest.skip("jax / xla-cpu-pjrt not installed", allow_module_level=True)

import gymnasium as gym  # noqa: E402
from gymnasium.utils.env_checker import check_env  # noqa: E402

import rlflow.env  # noqa: E402,F401  (registers the ids)
from rlflow.env.xla_pass_order import DEFAULT_MODULE, XlaPassOrderEnv  # noqa: E402
from rlflow.errors import RLFlowError  # noqa: E402
from rlflow.xla import hlo  # noqa: E402
from rlflow.xla.passes import action_passes, disabled_for, excluded  # noqa: E402
from rlflow.xla.worker import PassWorker, discover_pipeline  # noqa: E402

TINY = """HloModule tiny, is_scheduled=true, entry_computation_layout={(f32[4]{0})->f32[4]{0}}

ENTRY main {
  x = f32[4]{0} parameter(0)
  c = f32[] constant(0)
  b = f32[4]{0} broadcast(c), dimensions={}
  a = f32[4]{0} add(x, b)
  ROOT t = f32[4]{0} tanh(a)
}
"""


@pytest.fixture(scope="module")
def env():
    e = XlaPassOrderEnv(max_steps=4, cache_size=0)  # every step a real compile: the worker tests need that
    yield e
    e.close()


def test_histogram_counts_and_schedule_is_stripped():
    assert "is_scheduled" not in hlo.strip_schedule(TINY).splitlines()[0]
    s = hlo.stats(TINY)
    assert s.histogram == {"parameter": 1, "constant": 1, "broadcast": 1, "add": 1, "tanh": 1}
    assert s.cost["transcendentals"] == 4 and s.cost["flops"] > 0
    with pytest.raises(RLFlowError, match="not a valid HLO module"):
        hlo.parse("HloModule broken\nENTRY {")


def test_action_passes_are_target_independent():
    pipeline = discover_pipeline()
    passes = action_passes(pipeline)
    assert {"algsimp", "cse", "dce", "reshape-mover", "constant_folding", "call-inliner"} <= set(passes)
    assert not [p for p in passes if excluded(p)]
    assert not any(("layout" in p or "fusion" in p or "copy-insertion" in p or "float-normalization" in p)
                   for p in passes)
    # only the chosen pass and its fixed-point pipeline stay enabled
    assert set(pipeline.names) - set(disabled_for(pipeline, "algsimp")) == {"algsimp", "simplification"}


def test_env_checker_and_gym_make():
    e = gym.make("rlflow/XlaPassOrder-v0", max_steps=3)
    try:
        check_env(e.unwrapped, skip_render_check=True)
    finally:
        e.close()


def test_rewards_and_unchanged_pass(env):
    obs, info = env.reset(seed=0)
    n0 = info["op_count"]
    algsimp, dce = env.passes.index("algsimp"), env.passes.index("dce")
    obs, r, term, trunc, info = env.step(algsimp)
    assert info["status"] == "ok" and info["op_count"] < n0
    assert r == pytest.approx(env.reward_scale * (n0 - info["op_count"]) / n0)
    assert obs.sum() >= info["op_count"]  # histogram part sums to the op count (+ cost features)
    _, r, _, _, info = env.step(dce)
    assert r == 0.0 or info["status"] == "ok"  # a pass that changes nothing is free by default
    env.unchanged_penalty = -0.5  # ... and costs a step when asked
    try:
        _, r, _, _, info = env.step(dce)
    finally:
        env.unchanged_penalty = 0.0
    assert info["status"] == "unchanged" and r == -0.5
    _, r, term, trunc, info = env.step(env.stop_action)
    assert term and info["status"] == "stop"


def test_spent_passes_are_flagged_until_the_module_changes():
    e = XlaPassOrderEnv(max_steps=6)
    try:
        obs, _ = e.reset(seed=0)
        flags = slice(len(e.opcodes), len(e.opcodes) + len(e.passes))
        progress = len(e.opcodes) + len(e.passes)
        assert not obs[flags].any() and obs[progress] == 0.0
        algsimp = e.passes.index("algsimp")
        e.step(algsimp)
        obs, _, _, _, info = e.step(algsimp)  # algsimp ran to its fixed point: a second run changes nothing
        assert info["status"] == "unchanged" and obs[flags][algsimp] == 1.0 and obs[flags].sum() == 1.0
        assert obs[progress] == pytest.approx(2 / 6)
        last = slice(len(obs) - len(e.passes), len(obs))
        assert obs[last][algsimp] == 1.0 and obs[last].sum() == 1.0  # algsimp made the last change
        obs, _, _, _, info = e.step(e.passes.index("cse"))
        assert info["status"] == "ok" and not obs[flags].any()  # the module changed: nothing is spent any more
        assert obs[last][e.passes.index("cse")] == 1.0 and obs[last].sum() == 1.0
        obs, _ = e.reset(seed=0)
        assert not obs[last].any()
    finally:
        e.close()


def test_modules_of_the_same_file_name_keep_their_own_stats(tmp_path):
    for model, text in (("a", TINY), ("b", DEFAULT_MODULE.read_text())):
        (tmp_path / model / "xla").mkdir(parents=True)
        (tmp_path / model / "xla" / "module.hlo").write_text(text)
    e = XlaPassOrderEnv([tmp_path / "a/xla/module.hlo", tmp_path / "b/xla/module.hlo"], max_steps=2)
    try:
        counts = {}
        for i in (0, 1):
            info = e.reset(options={"module": i})[1]
            counts[info["module"]] = info["initial_op_count"]
        block = sum(hlo.stats(DEFAULT_MODULE.read_text()).histogram.values())
        assert counts == {"a/xla/module": 5, "b/xla/module": block}
    finally:
        e.close()


def test_transition_cache_repeats_a_step_without_compiling():
    e = XlaPassOrderEnv(max_steps=4, cache_size=8)
    try:
        e.reset(seed=0)
        first = [e.step(e.passes.index(n))[4]["op_count"] for n in ("algsimp", "cse")]
        compiles = e.compiles
        assert compiles == 2
        e.reset(seed=0)
        again = [e.step(e.passes.index(n))[4]["op_count"] for n in ("algsimp", "cse")]
        assert again == first and e.compiles == compiles and e.total_steps == 4
        e.step(e.passes.index("reshape-mover"))
        assert e.compiles == compiles + 1
    finally:
        e.close()


def test_runtime_reward_at_the_episodes_end():
    e = XlaPassOrderEnv(max_steps=2, runtime_reward=1.0, runtime_budget_s=0.3)
    try:
        e.reset(seed=0)
        _, r, _, trunc, info = e.step(e.passes.index("algsimp"))
        assert not trunc and "runtime_ratio" not in info and r == info["op_reward"]  # not the last step
        _, r, _, trunc, info = e.step(e.passes.index("cse"))
        assert trunc and info["runtime_ratio"] > 0
        lo, hi = info["runtime_ci"]
        assert lo <= info["runtime_ratio"] <= hi
        assert r == pytest.approx(info["op_reward"] - e.reward_scale * math.log(info["runtime_ratio"]))
        e.reset(seed=0)
        _, r, term, _, info = e.step(e.stop_action)  # stopping ends the episode too
        assert term and r == pytest.approx(-e.reward_scale * math.log(info["runtime_ratio"]))
        # one timing process for every episode end: the default's module and the first episode's module were
        # compiled at the first end; the unoptimised module (the stop episode) only at the second
        assert e.timer.requests == 2 and info["runtime_compiled"] == 1 and len(e.runtime_costs) == 2
        e.reset(seed=0)
        _, _, term, _, info = e.step(e.stop_action)
        assert info["runtime_compiled"] == 0 and e.timer.requests == 3  # every module from the cache
        assert info["runtime_screened"] in (True, False)
    finally:
        e.close()
    with pytest.raises(RLFlowError, match="runtime_reward"):
        XlaPassOrderEnv(runtime_reward=-1.0)
    with pytest.raises(RLFlowError, match="unchanged_penalty"):
        XlaPassOrderEnv(unchanged_penalty=0.5)
    with pytest.raises(RLFlowError, match="runtime_screen"):
        XlaPassOrderEnv(runtime_reward=1.0, runtime_screen=1.0)


def test_shaping_is_potential_based():
    e = XlaPassOrderEnv(max_steps=3, shaping={"flops": 1.0, "transcendentals": 1.0}, gamma=1.0)
    try:
        e.reset(seed=0)
        total = total_op = 0.0
        for name in ("algsimp", "cse"):
            _, r, _, _, info = e.step(e.passes.index(name))
            total, total_op = total + r, total_op + info["op_reward"]
        phi_end = e.potential(e.stats)
        # with gamma 1 the shaping telescopes: sum = op rewards + Phi(s_T) - Phi(s_0), Phi(s_0) = -2
        assert total == pytest.approx(total_op + phi_end + 2.0)
    finally:
        e.close()


def test_killed_worker_mid_episode_is_restarted(env):
    env.reset(seed=0)
    want = []
    for name in ("algsimp", "cse", "reshape-mover"):
        want.append(env.step(env.passes.index(name))[4]["op_count"])
    env.reset(seed=0)
    got = [env.step(env.passes.index("algsimp"))[4]["op_count"]]
    env.worker.kill()  # as if XLA had aborted the worker
    for name in ("cse", "reshape-mover"):
        _, _, _, _, info = env.step(env.passes.index(name))
        assert info["status"] in ("ok", "unchanged")
        got.append(info["op_count"])
    assert got == want


def test_crash_during_a_request_is_reported_and_recovered():
    worker = PassWorker()
    try:
        assert worker.request("crash")["status"] == "crash"  # the child aborts, as on an XLA CHECK failure
        assert worker.crashes == 1
        pipeline = discover_pipeline()
        result = worker.run_pass(DEFAULT_MODULE.read_text(), disabled_for(pipeline, "algsimp"))
        assert result.status == "ok"
    finally:
        worker.close()


def test_crash_is_an_invalid_action(env, monkeypatch):
    env.reset(seed=0)
    n0 = env.op_count(env.stats)
    monkeypatch.setattr(env.worker, "run_pass", lambda text, disabled: _crashed(env.worker))
    _, r, term, trunc, info = env.step(env.passes.index("algsimp"))
    assert info["status"] == "crash" and r == env.invalid_penalty and info["op_count"] == n0 and not term


def _crashed(worker):
    from rlflow.xla.worker import StepResult

    reply = worker.request("crash")
    return StepResult(reply["status"], message=reply["message"])


def test_replaying_xla_order_reproduces_xla_compile():
    """XLA's own target-independent order, one pass per env step, gives the module XLA's own compile dumps just
    before layout assignment (same opcode counts): the env runs the real passes."""
    pipeline = discover_pipeline()
    text = DEFAULT_MODULE.read_text()
    worker = PassWorker()
    try:
        reference = worker.reference(text)
        assert reference.status == "ok"
        current = text
        for run in pipeline.target_independent:
            result = worker.run_pass(current, disabled_for(pipeline, run.name, run.pipelines))
            assert result.valid, (run, result.message)
            current = result.text
        assert hlo.stats(current).histogram == reference.stats["histogram"]
        assert sum(reference.stats["histogram"].values()) < sum(hlo.stats(text).histogram.values())
    finally:
        worker.close()


def _constant_values(text: str, shape: str) -> np.ndarray:
    """The values of the one constant of type ``shape`` (e.g. ``f32[24,24]``) printed in HLO text."""
    line = next(ln for ln in text.splitlines() if f"= {shape}" in ln and " constant(" in ln)
    literal = line.split(" constant(", 1)[1]
    assert "..." not in literal, f"constant elided: {line[:120]}"
    return np.array([float(v) for v in re.findall(r"-?\d+(?:\.\d+)?(?:e[-+]?\d+)?|-?inf|nan", literal)],
                    np.float32)


def test_hlo_of_a_graph_keeps_large_constants_through_passes():
    """hlo_text prints every weight (XLA elides large constants as {...} by default, which parse back as other
    values), and a pass step's output keeps them too."""
    from rlflow.graph.builder import GraphBuilder
    from rlflow.graph.exec.jax_exec import hlo_text

    w = (np.random.default_rng(0).standard_normal((24, 24)) / 3).astype(np.float32)
    b = GraphBuilder("bigconst")
    x = b.input("x", (2, 24))
    y = b.op("Tanh", [b.op("MatMul", [x, b.const("w", w)])])
    text = hlo_text(b.build([y]))
    np.testing.assert_array_equal(_constant_values(text, "f32[24,24]"), w.ravel())
    reparsed = hlo.parse(text).to_string(_full_print_options())
    np.testing.assert_array_equal(_constant_values(reparsed, "f32[24,24]"), w.ravel())
    pipeline = discover_pipeline()
    worker = PassWorker()
    try:
        result = worker.run_pass(text, disabled_for(pipeline, "algsimp"))
        assert result.valid, result.message
        np.testing.assert_array_equal(_constant_values(result.text, "f32[24,24]"), w.ravel())
        ref = worker.reference(text)
        np.testing.assert_array_equal(_constant_values(ref.text, "f32[24,24]"), w.ravel())
    finally:
        worker.close()


def test_hlo_with_weights_as_parameters():
    """xla.weights=parameters: a weight becomes an entry parameter after the inputs (not a printed constant);
    small constants stay constants; the computation is the same."""
    from rlflow.graph.builder import GraphBuilder
    from rlflow.graph.exec.jax_exec import hlo_text, weight_parameters

    rng = np.random.default_rng(0)
    b = GraphBuilder("params")
    x = b.input("x", (2, 24))
    h = b.op("MatMul", [x, b.const("w", rng.standard_normal((24, 24)).astype(np.float32))])
    y = b.op("Add", [h, b.const("bias", rng.standard_normal((24,)).astype(np.float32))])  # 24 < 64: a constant
    g = b.build([y])
    assert weight_parameters(g) == ("w",)
    text_p, text_c = hlo_text(g, "parameters"), hlo_text(g, "constants")
    hp, hc = hlo.histogram(hlo.parse(text_p)), hlo.histogram(hlo.parse(text_c))
    assert hp["parameter"] == hc["parameter"] + 1 and hp.get("constant", 0) == hc["constant"] - 1
    assert {k: v for k, v in hp.items() if k not in ("parameter", "constant")} == \
        {k: v for k, v in hc.items() if k not in ("parameter", "constant")}
    assert "f32[24,24]{1,0} constant" not in text_p and "f32[24,24]{1,0} constant" in text_c
    assert "f32[24,24]{1,0} parameter(1)" in text_p and "f32[1,24]{1,0} constant" in text_p  # the bias
    with pytest.raises(RLFlowError, match="weights must be"):
        hlo_text(g, "inline")


def test_a_compile_stopped_after_the_hlo_passes_dumps_what_a_full_compile_does(tmp_path):
    """The worker kills its compiling fork once XLA has dumped the module after the passes: that dump is the one
    a compile left to finish writes (code generation changes no HLO). In a fresh process: the worker's own."""
    import subprocess
    import sys

    script = """
import sys, tempfile
from pathlib import Path
import jax, jax.numpy as jnp
from rlflow.xla import hlo
from rlflow.xla.passes import disabled_for
from rlflow.xla.pjrt import CpuCompiler
from rlflow.xla.worker import _after_optimizations, _compile, _compile_options, discover_pipeline

def f(x, w):
    for _ in range(6):
        x = jnp.tanh(x @ w) + jnp.tanh(x @ w) + jax.nn.relu(x)  # cse merges the repeated dot and tanh
    return x.sum()

text = jax.jit(f).lower(jnp.ones((8, 8)), jnp.ones((8, 8))).compiler_ir("hlo").as_hlo_text()
proto = hlo.parse(text).as_serialized_hlo_module_proto()
compiler, outs = CpuCompiler(client=False), []
for stop in (True, False):
    folder = Path(tempfile.mkdtemp(dir=sys.argv[1]))
    options = _compile_options({"xla_disable_hlo_passes": ",".join(disabled_for(discover_pipeline(), "cse")),
                                "xla_dump_to": str(folder), "xla_dump_hlo_as_text": True,
                                "xla_cpu_parallel_codegen_split_count": 0})
    message, cpu_s = _compile(compiler, proto, options, folder if stop else None)
    assert cpu_s > 0
    outs.append(_after_optimizations(folder))
assert outs[0] is not None and outs[0] == outs[1]
print("SAME", hlo.stats(outs[0]).histogram != hlo.stats(text).histogram)
"""
    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["SAME", "True"]  # and cse did change the module


def _full_print_options():
    from jax._src.lib import hlo as xla_hlo

    options = xla_hlo.HloPrintOptions()
    options.print_large_constants, options.print_metadata = True, False
    return options
