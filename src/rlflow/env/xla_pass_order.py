"""``rlflow/XlaPassOrder-v0``: choose XLA's target-independent HLO passes one at a time (XLA Gym).

Action ``k < N`` runs pass ``passes[k]`` (:func:`rlflow.xla.passes.action_passes`, N of them) on the current HLO
module in the crash-isolated worker (:mod:`rlflow.xla.worker`); ``k == N`` stops the episode. A pass that crashes
XLA or fails is an invalid action: it earns ``invalid_penalty`` and leaves the module unchanged (the worker is
restarted); a pass that changes nothing earns ``unchanged_penalty`` (default 0; below 0 it costs a step). After
``max_steps`` steps the episode is truncated.

Observation: float32 [opcode histogram (every opcode of the installed XLA, :func:`rlflow.xla.hlo.opcodes`),
N flags "this pass already ran on the current module and changed nothing (or failed)", the episode's progress
(step / max_steps), flops, transcendentals, bytes accessed (XLA's own cost analysis), N flags "this pass made the
last change to the module" (one hot, none at the start: what the module's last change came from, so a policy can
learn what a pass enables, e.g. reshape-mover, then algsimp, then cse)]. Passes are deterministic,
so a flagged pass would change nothing again: the flags tell the agent which actions are spent until the module
changes (:mod:`rlflow.agents.pass_agent` masks them), and without them a state where a pass did nothing looks
exactly like the state before it.

Passes are deterministic, so the env also keeps the last ``cache_size`` transitions (module text, pass) ->
result: an episode that repeats a known prefix costs no compile. A cached step is still a step (it counts in
``total_steps``); ``compiles`` counts the real XLA compiles.

Reward: ``reward_scale`` x (op count before - op count after) / the episode's initial op count, plus, when
``shaping`` weights are given, the potential-based term ``gamma x Phi(s') - Phi(s)`` with
``Phi(s) = -(w_flops x flops(s) / flops(s_0) + w_transcendentals x transcendentals(s) / transcendentals(s_0))``
(Ng et al.: the optimal policies are unchanged). With ``runtime_reward`` w > 0, the last step of an episode (stop
or truncation) also earns ``w x reward_scale x -ln(r)``, r the XLA CPU latency ratio of the episode's module to
XLA's default pipeline's module of the same graph (:mod:`rlflow.xla.timing`: both compiled without the agents'
passes, timed with the project's protocol in ``runtime_budget_s`` seconds, 2 sessions); a module whose outputs
differ from the default's by more than ``tolerance`` earns ``invalid_penalty`` instead. ``info`` then has
``runtime_ratio`` (and ``runtime_ci``; a module whose one call takes more than ``runtime_screen`` times the
default's is not timed further: its ratio is that call's, ``runtime_screened`` true), ``runtime_s`` (the
measurement's seconds, also kept in ``runtime_costs``) and ``runtime_compiled`` (modules compiled for it). The timing runs in one persistent process
(:class:`rlflow.xla.timing.TimingWorker`, compiled modules cached by fingerprint): the default's module is compiled
once per graph, an episode's module once. ``info`` has ``op_count``, ``op_reward`` (the reward without
shaping), ``status`` (ok | unchanged | crash | error | stop), ``pass``, the cost features and ``step``.
``last_cpu_ms`` holds the pass worker's CPU time of the last step (XLA's compile, the rest; empty when the step
came from the cache): not in ``info``, which is deterministic.

Several modules: ``modules`` is a list; each reset picks one (uniformly with the env's seed, or
``options={"module": i}``). With none the env runs :data:`DEFAULT_MODULE`, a small attention block lowered by JAX.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import hashlib
import math
import time
from collections import OrderedDict

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from rlflow.errors import RLFlowError
from rlflow.xla.hlo import COST_FEATURES

F32_MAX = float(np.finfo(np.float32).max)
DEFAULT_MAX_STEPS = 20  # the horizon when none is given (config.yaml's xla.max_steps)
#: the module of an env made without one: one attention block with layer norm, 16 x 32, lowered by JAX
DEFAULT_MODULE = Path(__file__).parent / "data" / "tiny-block.hlo"


def read_module(source: str | Path) -> tuple[str, str]:
    """(name, HLO text) of a module given as a file path (name: the file's stem) or as HLO text (its name)."""
    text = str(source)
    if not text.lstrip().startswith("HloModule"):
        path = Path(source)
        if not path.is_file():
            raise RLFlowError(f"{path}: no such HLO module file")
        return path.stem, path.read_text()
    return text.split(None, 2)[1].rstrip(","), text


def _unique_names(modules: list[tuple[str, str]], sources) -> list[tuple[str, str]]:
    """The modules, names made unique: files of the same name (the pipeline's results/<model>/xla/module.hlo)
    are named by as many of their last folders as it takes (``bert/xla/module``)."""
    names = [n for n, _ in modules]
    if len(set(names)) == len(names):
        return modules
    parts = [Path(str(s)).with_suffix("").parts if not str(s).lstrip().startswith("HloModule") else (n,)
             for s, (n, _) in zip(sources, modules)]
    for k in range(2, max(len(p) for p in parts) + 1):
        names = ["/".join(p[-k:]) for p in parts]
        if len(set(names)) == len(names):
            break
    return [(n, text) for n, (_, text) in zip(names, modules)]


class XlaPassOrderEnv(gym.Env):
    metadata = {"render_modes": ["ansi"], "render_fps": 4}

    def __init__(self, modules: Sequence[str | Path] | str | Path | None = None, max_steps: int = DEFAULT_MAX_STEPS,
                 reward_scale: float = 100.0, invalid_penalty: float = -1.0, unchanged_penalty: float = 0.0,
                 shaping: dict[str, float] | None = None, gamma: float = 0.99, step_timeout_s: float = 120.0,
                 cache_size: int = 256, runtime_reward: float = 0.0, runtime_budget_s: float = 2.0,
                 runtime_screen: float = 2.0, tolerance: float = 1e-4, render_mode: str | None = None):
        from rlflow.xla.passes import action_passes, disabled_for
        from rlflow.xla.hlo import opcodes
        from rlflow.xla.worker import PassWorker, discover_pipeline

        if modules is None:
            modules = [DEFAULT_MODULE]
        elif isinstance(modules, (str, Path)):
            modules = [modules]
        if not modules:
            raise RLFlowError("XlaPassOrder: no HLO module given")
        if max_steps < 1:
            raise RLFlowError(f"XlaPassOrder: max_steps must be >= 1, got {max_steps}")
        self.modules = _unique_names([read_module(m) for m in modules], modules)
        self.pipeline = discover_pipeline()
        self.passes = action_passes(self.pipeline)
        self.disabled = [disabled_for(self.pipeline, name) for name in self.passes]  # per action, made once
        self.opcodes = opcodes()
        self.max_steps, self.reward_scale, self.invalid_penalty = max_steps, reward_scale, invalid_penalty
        if unchanged_penalty > 0:
            raise RLFlowError(f"XlaPassOrder: unchanged_penalty must be <= 0, got {unchanged_penalty}")
        self.unchanged_penalty = float(unchanged_penalty)
        self.shaping = {k: float(v) for k, v in (shaping or {}).items() if v}
        unknown = set(self.shaping) - {"flops", "transcendentals"}
        if unknown:
            raise RLFlowError(f"XlaPassOrder: unknown shaping feature(s) {sorted(unknown)}")
        self.gamma, self.render_mode = gamma, render_mode
        self.worker = PassWorker(step_timeout_s)
        self.action_space = spaces.Discrete(len(self.passes) + 1)
        n_obs = len(self.opcodes) + len(self.passes) + 1 + len(COST_FEATURES) + len(self.passes)
        self.observation_space = spaces.Box(0.0, F32_MAX, (n_obs,), np.float32)
        self.cache_size = int(cache_size)
        if runtime_reward < 0 or not runtime_budget_s > 0 or not runtime_screen > 1:
            raise RLFlowError("XlaPassOrder: runtime_reward must be >= 0, runtime_budget_s > 0 and runtime_screen > 1")
        self.runtime_screen = float(runtime_screen)
        self.runtime_reward, self.runtime_budget_s, self.tolerance = runtime_reward, runtime_budget_s, tolerance
        self._default_text: dict[int, str] = {}  # module index -> XLA's default pipeline's module (runtime reward)
        self.timer = None  # the persistent timing process of the runtime reward (started at the first episode end)
        self.runtime_costs: list[float] = []  # seconds of each episode end's runtime measurement
        self._cache: OrderedDict[tuple[bytes, int], Any] = OrderedDict()  # (module digest, pass) -> StepResult
        self.compiles = 0
        self._initial: dict[int, dict] = {}  # module index -> its stats (computed once)
        self.total_steps = 0
        self.last_cpu_ms: dict[str, float] = {}
        self.index, self.text, self.stats, self.start, self.steps = 0, "", {}, {}, 0
        self.actions: list[int] = []
        self.spent: set[int] = set()  # passes that ran on the current module and left it as it is
        self.last_changed: int | None = None  # the last pass that changed the module (what it may have enabled)

    # ------------------------------------------------------------------------------------------------ helpers
    @property
    def stop_action(self) -> int:
        return len(self.passes)

    def observation(self, stats: dict) -> np.ndarray:
        hist = stats["histogram"]
        spent = [1.0 if a in self.spent else 0.0 for a in range(len(self.passes))]
        last = [1.0 if a == self.last_changed else 0.0 for a in range(len(self.passes))]
        vec = ([hist.get(op, 0) for op in self.opcodes] + spent + [self.steps / self.max_steps]
               + [stats["cost"].get(k, 0.0) for k in COST_FEATURES] + last)
        return np.clip(np.asarray(vec, np.float32), 0.0, F32_MAX)

    def transition(self, text: str, action: int):
        """Pass ``action``'s result (a :class:`rlflow.xla.worker.StepResult`) on module ``text``, from the
        transition cache or a real XLA compile."""
        key = (hashlib.blake2b(text.encode(), digest_size=16).digest(), action)
        found = self._cache.get(key)
        if found is not None:
            self._cache.move_to_end(key)
            self.last_cpu_ms = {}
            return found
        result = self.worker.run_pass(text, self.disabled[action])
        self.compiles += 1
        self.last_cpu_ms = result.cpu
        if self.cache_size > 0 and result.status != "crash":  # a crash may be the machine's, not the pass's
            self._cache[key] = result
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return result

    @staticmethod
    def op_count(stats: dict) -> int:
        return int(sum(stats["histogram"].values()))

    def potential(self, stats: dict) -> float:
        phi = 0.0
        for k, w in self.shaping.items():
            base = self.start["cost"].get(k, 0.0)
            phi -= w * (stats["cost"].get(k, 0.0) / base if base else 0.0)
        return phi

    def _info(self, status: str, name: str | None, op_reward: float) -> dict[str, Any]:
        return {"op_count": self.op_count(self.stats), "initial_op_count": self.op_count(self.start),
                "op_reward": op_reward, "status": status, "pass": name, "step": self.steps,
                "module": self.modules[self.index][0], **{k: self.stats["cost"].get(k, 0.0) for k in COST_FEATURES}}

    # ------------------------------------------------------------------------------------------------ gym API
    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        options = options or {}
        if "module" in options:
            self.index = int(options["module"])
            if not 0 <= self.index < len(self.modules):
                raise RLFlowError(f"XlaPassOrder: module {self.index} of {len(self.modules)}")
        else:
            self.index = int(self.np_random.integers(len(self.modules))) if len(self.modules) > 1 else 0
        self.text = self.modules[self.index][1]
        if self.index not in self._initial:
            self._initial[self.index] = self.worker.stats(self.text)
        self.stats = self.start = self._initial[self.index]
        self.steps, self.actions, self.spent, self.last_changed = 0, [], set(), None
        return self.observation(self.stats), self._info("reset", None, 0.0)

    def step(self, action):
        action = int(action)
        if not self.action_space.contains(action):
            raise RLFlowError(f"XlaPassOrder: action {action} outside 0..{self.stop_action}")
        self.steps += 1
        self.total_steps += 1
        self.actions.append(action)
        if action == self.stop_action:
            info = self._info("stop", None, 0.0)
            return self.observation(self.stats), self._runtime_term(info), True, False, info
        name = self.passes[action]
        result = self.transition(self.text, action)
        if result.status == "ok":
            self.spent, self.last_changed = set(), action
        else:
            self.spent.add(action)
        if result.valid:
            before = self.op_count(self.stats)
            phi = self.potential(self.stats)
            self.text, self.stats = result.text, result.stats
            op_reward = self.reward_scale * (before - self.op_count(self.stats)) / max(self.op_count(self.start), 1)
            reward = op_reward + (self.gamma * self.potential(self.stats) - phi if self.shaping else 0.0)
            if result.status == "unchanged":
                reward += self.unchanged_penalty
        else:
            op_reward = reward = float(self.invalid_penalty)
        truncated = self.steps >= self.max_steps
        info = self._info(result.status, name, op_reward)
        if not result.valid:
            info["message"] = result.message
        if truncated:
            reward += self._runtime_term(info)
        return self.observation(self.stats), float(reward), False, truncated, info

    def _runtime_term(self, info: dict) -> float:
        """The end-of-episode runtime reward (0 when ``runtime_reward`` is 0); fills ``info``."""
        if not self.runtime_reward:
            return 0.0
        from rlflow.evaluation.protocol import Protocol
        from rlflow.xla.timing import TimingWorker, timing_disabled

        name = self.modules[self.index][0]
        if self.index not in self._default_text:
            ref = self.worker.reference(self.modules[self.index][1])
            if not ref.valid:
                raise RLFlowError(f"XlaPassOrder: XLA's default pipeline failed on {name}: {ref.message}")
            self._default_text[self.index] = ref.text
        protocol = Protocol(sessions=2, warmup=1, budget_s=self.runtime_budget_s, min_rounds=3,
                            seed=self.total_steps)
        if self.timer is None:
            self.timer = TimingWorker()
        t0 = time.perf_counter()
        result = self.timer.time([("xla_default", self._default_text[self.index]), ("episode", self.text)],
                                 protocol, timing_disabled(self.pipeline), screen=self.runtime_screen)
        self.runtime_costs.append(time.perf_counter() - t0)
        info["runtime_s"], info["runtime_compiled"] = self.runtime_costs[-1], result["compiled"]
        info["runtime_screened"] = "episode" in result["screened"]
        est = result["estimates"]["episode"]
        info["runtime_ratio"], info["runtime_ci"] = est["ratio"], (est["ci_low"], est["ci_high"])
        if not result["max_rel_diff"]["episode"] <= self.tolerance:
            info["runtime_message"] = "outputs differ from XLA's default pipeline's module"
            return float(self.invalid_penalty)
        return -self.runtime_reward * self.reward_scale * math.log(est["ratio"])

    def render(self):
        if self.render_mode == "ansi":
            names = [self.passes[a] if a < self.stop_action else "STOP" for a in self.actions]
            return f"{self.modules[self.index][0]}: {self.op_count(self.stats)} ops after {names}"
        return None

    def close(self):
        self.worker.close()
        if self.timer is not None:
            self.timer.close()


def make_xla_env(config: dict, modules, shaping: bool = False, runtime_reward: bool = False) -> XlaPassOrderEnv:
    """The env as ``config`` describes it (the ``xla`` section; ``ppo.gamma`` for the shaping term). Shaping and
    the runtime reward (``xla.runtime_reward``) only where asked for: they are training signals, and the
    evaluation's env must not spend time on them."""
    x = config.get("xla", {})
    return XlaPassOrderEnv(modules, max_steps=x.get("max_steps", DEFAULT_MAX_STEPS),
                           reward_scale=x.get("reward_scale", 100.0),
                           invalid_penalty=x.get("invalid_penalty", -1.0),
                           unchanged_penalty=x.get("unchanged_penalty", 0.0),
                           shaping=x.get("shaping") if shaping else None,
                           gamma=config.get("ppo", {}).get("gamma", 0.99), step_timeout_s=x.get("step_timeout_s", 120),
                           cache_size=x.get("cache_size", 256),
                           runtime_reward=x.get("runtime_reward", 0.0) if runtime_reward else 0.0,
                           runtime_budget_s=x.get("runtime_budget_s", 2.0),
                           runtime_screen=x.get("runtime_screen", 2.0),
                           tolerance=config.get("evaluate", {}).get("tolerance", 1e-4))
