"""XLA CPU runtime of HLO modules (rlflow.xla.timing): compiled without the agents' passes, outputs checked
against the reference's, timed with the project's protocol in a child process."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

if importlib.util.find_spec("jax") is None or importlib.util.find_spec("xla_plugins.xla_cpu_pjrt") is None:
    pytest.skip("jax / xla-cpu-pjrt not installed", allow_module_level=True)

from rlflow.errors import RLFlowError  # noqa: E402
from rlflow.evaluation.protocol import FASTER, SAME, SLOWER, Protocol  # noqa: E402
from rlflow.xla.passes import action_passes  # noqa: E402
from rlflow.xla.timing import (REQUIRED, TimingWorker, module_inputs, parameter_shapes,  # noqa: E402
                               time_modules, timing_disabled)
from rlflow.xla.worker import discover_pipeline  # noqa: E402

HEADER = "HloModule m, entry_computation_layout={(f32[64,64]{1,0}, s64[3]{0})->f32[64,64]{1,0}}\n\n"
BODY = """ENTRY main {
  x = f32[64,64]{1,0} parameter(0)
  i = s64[3]{0} parameter(1)
  d = f32[64,64]{1,0} dot(x, x), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT t = f32[64,64]{1,0} %s(d)
}
"""
TANH, EXP = HEADER + BODY % "tanh", HEADER + BODY % "exponential"


def test_parameter_shapes_and_inputs():
    assert parameter_shapes(TANH) == [("float32", (64, 64)), ("int64", (3,))]
    x, i = module_inputs(TANH, seed=1)
    assert x.dtype == np.float32 and i.dtype == np.int64 and set(np.unique(i)) <= {0, 1}
    assert np.array_equal(x, module_inputs(TANH, seed=1)[0])
    with pytest.raises(RLFlowError, match="entry_computation_layout"):
        parameter_shapes("HloModule m\n")


def test_timing_compile_leaves_out_the_agents_passes_but_what_codegen_needs():
    pipeline = discover_pipeline()
    disabled = set(timing_disabled(pipeline))
    assert disabled == set(action_passes(pipeline)) - set(REQUIRED)
    assert {"algsimp", "cse", "reshape-mover"} <= disabled and not disabled & set(REQUIRED)


def test_time_modules_gives_ratios_verdicts_and_output_differences():
    protocol = Protocol(sessions=2, warmup=1, budget_s=0.5, min_rounds=3)
    r = time_modules([("ref", TANH), ("aa", TANH), ("other", EXP)], protocol,
                     timing_disabled(discover_pipeline()))
    assert r["max_rel_diff"]["ref"] == 0.0 and r["max_rel_diff"]["aa"] == 0.0
    assert r["max_rel_diff"]["other"] > 1e-3  # exp is not tanh: the check sees it
    est = r["estimates"]
    assert est["ref"]["verdict"] == "reference" and est["ref"]["ratio"] == 1.0
    for name in ("aa", "other"):
        assert est[name]["verdict"] in (FASTER, SLOWER, SAME)
        assert est[name]["ci_low"] <= est[name]["ratio"] <= est[name]["ci_high"]
        assert len(est[name]["times_ms"]) == 2 and all(len(s) >= 3 for s in est[name]["times_ms"])


def test_a_module_xla_cannot_compile_is_a_one_line_error():
    broken = TANH.replace("dot(x, x)", "dot(x, i)")
    with pytest.raises(RLFlowError, match="XLA CPU timing"):
        time_modules([("ref", TANH), ("bad", broken)], Protocol(sessions=2, budget_s=0.2),
                     timing_disabled(discover_pipeline()))


def test_the_timing_worker_persists_and_compiles_each_module_once():
    protocol = Protocol(sessions=2, warmup=1, budget_s=0.2, min_rounds=3)
    disabled = timing_disabled(discover_pipeline())
    renamed = TANH.replace("HloModule m,", "HloModule other_name,")  # same computation: same fingerprint
    with TimingWorker() as worker:
        first = worker.time([("ref", TANH), ("other", EXP)], protocol, disabled)
        pid = worker._proc.pid
        again = worker.time([("ref", renamed), ("other", EXP)], protocol, disabled)
        assert (first["compiled"], first["cached"]) == (2, 0)
        assert (again["compiled"], again["cached"]) == (0, 2)  # one process, both modules from its cache
        with pytest.raises(RLFlowError, match="XLA CPU timing"):  # an error reply: the process lives on
            worker.time([("ref", TANH), ("bad", TANH.replace("dot(x, x)", "dot(x, i)"))], protocol, disabled)
        assert worker.time([("ref", TANH), ("other", EXP)], protocol, disabled)["cached"] == 2
        assert worker._proc.pid == pid
        worker._proc.kill()  # a death: the next request starts a fresh process
        worker._proc.wait()
        assert worker.time([("ref", TANH), ("other", EXP)], protocol, disabled)["compiled"] == 2
        assert worker._proc.pid != pid


def test_a_far_slower_module_is_screened_by_one_call_instead_of_the_protocol():
    # 1024 wide: the three products take tens of ms, so one call of each stays over 2x apart even when a busy
    # machine preempts the cheap module's call (at 256 wide a CI run beside `make run` saw them within 2x)
    head = "HloModule s, entry_computation_layout={(f32[1024,1024]{1,0})->f32[1024,1024]{1,0}}\n\nENTRY main {\n"
    x = "  x = f32[1024,1024]{1,0} parameter(0)\n"
    dot = "f32[1024,1024]{1,0} dot(%s, x), lhs_contracting_dims={1}, rhs_contracting_dims={0}\n"
    cheap = head + x + "  ROOT t = f32[1024,1024]{1,0} negate(x)\n}\n"
    heavy = head + x + "  a = " + dot % "x" + "  b = " + dot % "a" + "  ROOT t = " + dot % "b" + "}\n"
    protocol = Protocol(sessions=2, warmup=1, budget_s=0.2, min_rounds=3)
    disabled = timing_disabled(discover_pipeline())
    with TimingWorker() as worker:
        r = worker.time([("ref", cheap), ("heavy", heavy)], protocol, disabled, screen=2.0)
        est = r["estimates"]["heavy"]
        assert r["screened"] == ["heavy"] and est["screened"] and est["verdict"] == SLOWER
        assert est["ratio"] > 2.0 and est["ci_low"] == est["ratio"] == est["ci_high"]
        assert r["rounds"] == [] and r["estimates"]["ref"]["verdict"] == "reference"
        again = worker.time([("ref", cheap), ("heavy", heavy)], protocol, disabled, screen=2.0)
        assert again["estimates"]["heavy"]["ratio"] == est["ratio"]  # screened once per pair
        timed = worker.time([("ref", cheap), ("heavy", heavy)], protocol, disabled)  # no screen: the protocol
        assert timed["screened"] == [] and len(timed["rounds"]) == 2
        with pytest.raises(RLFlowError, match="screen"):
            worker.time([("ref", cheap), ("heavy", heavy)], protocol, disabled, screen=0.5)
