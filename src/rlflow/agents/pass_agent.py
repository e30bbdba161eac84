"""XLA pass ordering (rlflow/XlaPassOrder-v0): PPO agents, the baselines and the paper's metric.

Agents (PPO, the loss and GAE of :mod:`rlflow.agents.ppo`, a flat categorical policy over the passes + stop):

- ``plain``: the op-count reward; policy and value see the log opcode histogram, the spent-pass flags, the
  episode's progress and the pass that made the module's last change;
- ``shaped``: the same with the env's potential-based shaping from the cost features (config ``xla.shaping``);
- ``shaped_costvf``: shaped, and the value function also sees the (log) cost features (the paper's second
  enhancement; the policy still sees the histogram only).

Baselines on one module: XLA's default pipeline (its own compile, dumped before layout assignment), random pass
orders (the mean final op count of ``n`` uniform orders of the horizon's length), greedy (at each step the pass
giving the fewest ops, until none reduces them).

Metric (the paper's): the geometric mean over graphs of (ops_0 - ops_method) / (ops_0 - ops_default).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from rlflow.agents.ppo import PPOConfig, gae, ppo_loss
from rlflow.errors import RLFlowError
from rlflow.xla.metric import geomean_ratio, reduction_ratio  # noqa: F401  (the paper's metric, re-exported)

VARIANTS = ("plain", "shaped", "shaped_costvf")
KIND = "rlflow.xla-pass-agent/3"  # /3: the observation ends with the last changing pass (one hot)


def _features(obs: torch.Tensor, n_opcodes: int, n_passes: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Observations [B, H + N + 1 + C + N] (the env's layout: opcode histogram, spent-pass flags, progress, cost
    features, the last changing pass) -> (the policy's input [B, H + 2N + 1]: log1p histogram, flags, progress,
    last changing pass; log1p cost features [B, C]; the spent flags [B, N] as a bool mask)."""
    hist, rest = obs[..., :n_opcodes], obs[..., n_opcodes:]
    spent, progress = rest[..., :n_passes], rest[..., n_passes:n_passes + 1]
    cost, last = rest[..., n_passes + 1:-n_passes], rest[..., -n_passes:]
    x = torch.cat([torch.log1p(hist.clamp_min(0.0)), spent, progress, last], -1)
    return x, torch.log1p(cost.clamp_min(0.0)), spent > 0.5


class PassPolicy(nn.Module):
    """Categorical policy over ``n_actions`` (the passes, then stop) and a value head; the value also sees the
    cost features when ``value_sees_cost``. Passes the observation flags as spent (they ran on this module and
    changed nothing, so they would change nothing again) are masked out; stop never is."""

    def __init__(self, n_opcodes: int, n_cost: int, n_actions: int, hidden: int = 64,
                 value_sees_cost: bool = False):
        super().__init__()
        self.n_opcodes, self.n_cost, self.n_passes = n_opcodes, n_cost, n_actions - 1
        self.value_sees_cost = value_sees_cost
        self.args = {"n_opcodes": n_opcodes, "n_cost": n_cost, "n_actions": n_actions, "hidden": hidden,
                     "value_sees_cost": value_sees_cost}
        n_in = n_opcodes + 2 * self.n_passes + 1
        self.actor = nn.Sequential(nn.Linear(n_in, hidden), nn.Tanh(), nn.Linear(hidden, n_actions))
        self.critic = nn.Sequential(nn.Linear(n_in + (n_cost if value_sees_cost else 0), hidden), nn.Tanh(),
                                    nn.Linear(hidden, 1))

    def forward(self, obs: torch.Tensor) -> tuple[torch.distributions.Categorical, torch.Tensor]:
        x, cost, spent = _features(obs, self.n_opcodes, self.n_passes)
        value_in = torch.cat([x, cost], -1) if self.value_sees_cost else x
        logits = self.actor(x)
        mask = torch.cat([spent, torch.zeros_like(spent[..., :1])], -1)  # stop stays allowed
        logits = logits.masked_fill(mask, torch.finfo(logits.dtype).min)
        return torch.distributions.Categorical(logits=logits), self.critic(value_in).squeeze(-1)


@dataclass
class Trained:
    """A trained pass agent: the policy, its variant and the pass names it chooses from."""

    policy: PassPolicy
    variant: str
    passes: tuple[str, ...]
    returns: list[float]
    max_steps: int | None = None
    """The horizon it was trained with (the observation's progress is step / horizon); None: not recorded."""

    def state(self) -> dict:
        return {"kind": KIND, "variant": self.variant, "passes": list(self.passes), "args": self.policy.args,
                "model": self.policy.state_dict(), "returns": self.returns, "max_steps": self.max_steps}


def load_pass_agent(path) -> Trained:
    """A pass agent saved by the train_pass_agent stage (``torch.save`` of :meth:`Trained.state`)."""
    state = torch.load(path, weights_only=True)
    if not isinstance(state, dict) or state.get("kind") != KIND:
        raise RLFlowError(f"{path}: not an XLA pass agent checkpoint ({KIND})")
    policy = PassPolicy(**state["args"])
    policy.load_state_dict(state["model"])
    return Trained(policy, state["variant"], tuple(state["passes"]), list(state["returns"]), state.get("max_steps"))


def train_ppo(env, variant: str, cfg: PPOConfig, updates: int, seed: int = 0, shaping: dict | None = None,
              hidden: int = 64, log=None) -> Trained:
    """PPO on ``env`` (an XlaPassOrderEnv over the training modules) for ``updates`` rounds of
    ``cfg.steps_per_update`` env steps. ``shaping``: the env's shaping weights for the shaped variants. ``log``
    (a callable on str) gets one progress line per update."""
    if variant not in VARIANTS:
        raise RLFlowError(f"pass agent: unknown variant {variant!r} (one of {', '.join(VARIANTS)})")
    env.shaping = dict(shaping or {}) if variant != "plain" else {}
    if variant != "plain" and not env.shaping:
        raise RLFlowError(f"pass agent: variant {variant} needs shaping weights (config xla.shaping)")
    env.gamma = cfg.gamma
    torch.manual_seed(seed)
    from rlflow.xla.hlo import COST_FEATURES

    n_cost = len(COST_FEATURES)
    policy = PassPolicy(len(env.opcodes), n_cost, int(env.action_space.n), hidden,
                        value_sees_cost=variant == "shaped_costvf")
    optimizer = torch.optim.Adam(policy.parameters(), lr=cfg.lr)
    obs, _ = env.reset(seed=seed)
    returns, episode_return = [], 0.0
    for update in range(1, updates + 1):
        buf = {k: [] for k in ("obs", "action", "logp", "value", "reward", "done")}
        for _ in range(cfg.steps_per_update):
            o = torch.as_tensor(obs)
            with torch.no_grad():
                dist, value = policy(o)
                action = dist.sample()
            obs, reward, term, trunc, _ = env.step(int(action))
            episode_return += reward
            for k, v in (("obs", o), ("action", action), ("logp", dist.log_prob(action)), ("value", value),
                         ("reward", torch.tensor(reward, dtype=torch.float32)),
                         ("done", torch.tensor(float(term or trunc)))):
                buf[k].append(v)
            if term or trunc:
                returns.append(float(episode_return))
                episode_return = 0.0
                obs, _ = env.reset()
        batch = {k: torch.stack(v) for k, v in buf.items()}
        with torch.no_grad():
            last_value = policy(torch.as_tensor(obs))[1]
        adv, ret = gae(batch["reward"], batch["value"], batch["done"], last_value, cfg.gamma, cfg.gae_lambda)
        for _ in range(cfg.update_epochs):
            for idx in torch.randperm(len(adv)).split(cfg.minibatch):
                dist, value = policy(batch["obs"][idx])
                a = adv[idx]
                a = (a - a.mean()) / (a.std() + 1e-8) if len(idx) > 1 else a
                loss, _ = ppo_loss(dist.log_prob(batch["action"][idx]), batch["logp"][idx], a, value, ret[idx],
                                   dist.entropy(), cfg.clip, cfg.c1, cfg.c2)
                optimizer.zero_grad()
                loss.backward()
                nn.utils.clip_grad_norm_(policy.parameters(), cfg.max_grad_norm)
                optimizer.step()
        if log is not None:
            recent = f"{np.mean(returns[-10:]):.2f}" if returns else "n/a"
            log(f"update {update}/{updates}: {env.total_steps} env steps ({env.compiles} XLA compiles), "
                f"{len(returns)} episodes, mean return of the last 10 {recent}")
    return Trained(policy, variant, tuple(env.passes), returns, env.max_steps)


# ------------------------------------------------------------------------------------------------ evaluation


@dataclass
class Outcome:
    """One method on one module: final op count and the passes it ran."""

    ops: float
    passes: list[str]
    text: str | None = None
    last: tuple[float, list[str], str] | None = None
    """The agent's last module (op count, passes, text), where it differs from the best one (run_agent)."""


def run_agent(env, agent: Trained, module: int) -> Outcome:
    """The agent's most likely pass at each step on ``env``'s module ``module``, until it stops or the horizon;
    the result is the best module seen on the way (op count)."""
    if tuple(env.passes) != agent.passes:
        raise RLFlowError("pass agent: trained on another XLA pass list (another XLA version?)")
    obs, info = env.reset(options={"module": module})
    best = Outcome(info["op_count"], [], env.text)
    chosen: list[str] = []
    while True:
        with torch.no_grad():
            action = int(agent.policy(torch.as_tensor(obs))[0].probs.argmax())
        obs, _, term, trunc, info = env.step(action)
        if info["pass"] is not None:
            chosen.append(info["pass"])
        if info["op_count"] < best.ops:
            best = Outcome(info["op_count"], list(chosen), env.text)
        if term or trunc:
            if env.text != best.text:
                best.last = (info["op_count"], list(chosen), env.text)
            return best


def latency_candidates(env, outcome: Outcome) -> list[dict]:
    """The modules an agent's run offers the final choice by measured latency: ``best`` (fewest ops), ``last``
    (its last module, where it differs; neither when it is the unoptimised module) and ``best+default`` (XLA's
    default pipeline run after the agent's passes on the best module: the agent's order as a prefix of XLA's own),
    each ``{name, ops, passes, text}``, distinct texts only. XLA's default pipeline's own module is always added by
    the chooser (:func:`rlflow.xla.timing.choose_by_latency`)."""
    out = []
    if outcome.passes:  # not the unoptimised module: XLA CPU runs it far slower than any pass order
        out.append({"name": "best", "ops": outcome.ops, "passes": list(outcome.passes), "text": outcome.text})
    if outcome.last is not None and outcome.last[1]:
        out.append({"name": "last", "ops": outcome.last[0], "passes": outcome.last[1], "text": outcome.last[2]})
    then = env.worker.reference(outcome.text)
    if then.valid:
        out.append({"name": "best+default", "ops": float(sum(then.stats["histogram"].values())),
                    "passes": [*outcome.passes, "<XLA default pipeline>"], "text": then.text})
    seen: set[str] = set()
    return [c for c in out if not (c["text"] in seen or seen.add(c["text"]))]


def default_pipeline(env, module: int) -> Outcome:
    """XLA's own target-independent pipeline on module ``module``."""
    result = env.worker.reference(env.modules[module][1])
    if not result.valid:
        raise RLFlowError(f"XLA's default pipeline failed on {env.modules[module][0]}: {result.message}")
    return Outcome(sum(result.stats["histogram"].values()), ["<XLA default pipeline>"], result.text)


def random_orders(env, module: int, n: int, rng: np.random.Generator) -> Outcome:
    """The mean final op count of ``n`` uniform random orders of ``env.max_steps`` passes (no stop)."""
    finals = []
    for _ in range(n):
        env.reset(options={"module": module})
        for _ in range(env.max_steps):
            _, _, term, trunc, info = env.step(int(rng.integers(env.stop_action)))
            if term or trunc:
                break
        finals.append(info["op_count"])
    return Outcome(float(np.mean(finals)), [f"<mean of {n} random orders>"])


def greedy(env, module: int, max_steps: int | None = None) -> Outcome:
    """At each step every pass is tried on the current module and the one with the fewest ops is kept; stops
    when no pass reduces the op count (or after ``max_steps``, default the env's horizon)."""
    env.reset(options={"module": module})
    text, ops = env.text, env.op_count(env.stats)
    chosen: list[str] = []
    for _ in range(max_steps or env.max_steps):
        best = None
        for a, name in enumerate(env.passes):
            result = env.transition(text, a)
            if result.status == "ok":
                n = sum(result.stats["histogram"].values())
                if n < ops and (best is None or n < best[0]):
                    best = (n, name, result.text)
        if best is None:
            break
        ops, text = best[0], best[2]
        chosen.append(best[1])
    return Outcome(ops, chosen, text)
