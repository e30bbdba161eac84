"""Checkpoints of the training stages: resume after being killed, and the final file with its config.

A training loop saves its state every so often to ``<final>.partial`` (atomically: temp file + rename), tagged
with a fingerprint of everything that determines the run (config values, input file digests). On a rerun the
partial file is resumed only if its fingerprint matches; otherwise it is ignored and training starts over. A
partial file that cannot be read (damaged, or not an rlflow checkpoint) is a one-line error naming it: it is
never dropped silently, and deleting it starts over. The final checkpoint is written atomically and the partial
file removed::

    ckpt = Checkpointer(out, fingerprint(config_values, input_paths))
    state = ckpt.load()            # None, or the last saved dict
    ... ckpt.save({"epoch": e, "model": net.state_dict(), ...}) ...
    ckpt.finish({"model": net.state_dict(), "config": config_values, ...})

Checkpoints are torch state dicts with the config they were trained with (``torch.load(weights_only=True)``
loads them: only tensors and plain Python values inside).

The final checkpoints of train_controller and train_model_free are whole agents (:class:`Agent`, kinds
``rlflow.controller/2`` and ``rlflow.model-free/2``): the policy, the encoder and (the controller) the world
model, each as a state dict with its constructor arguments, the rule set's fingerprint (count + hash of the
ids) and the env settings, so that ``rlflow optimize --method rlflow --agent CKPT`` (:func:`load_agent`,
:meth:`Agent.optimise`) needs no other file.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Iterable, Mapping

from rlflow.errors import RLFlowError


def file_digest(path: str | Path, chunk: int = 1 << 20) -> str:
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        while True:
            b = f.read(chunk)
            if not b:
                break
            h.update(b)
    return h.hexdigest()


def fingerprint(values: Mapping[str, Any], inputs: Iterable[str | Path] = ()) -> str:
    """A digest of config values (JSON) and the contents of input files."""
    h = hashlib.blake2b(digest_size=16)
    h.update(json.dumps(values, sort_keys=True, default=str).encode())
    for p in inputs:
        h.update(file_digest(p).encode())
    return h.hexdigest()


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0][:200]}" if lines else type(e).__name__


def _atomic_torch_save(obj: Any, path: Path) -> None:
    import torch

    from rlflow.atomic import atomic_path

    with atomic_path(path) as tmp:
        torch.save(obj, tmp)


class Checkpointer:
    def __init__(self, final: str | Path, fp: str):
        self.final = Path(final)
        self.partial = self.final.with_name(self.final.name + ".partial")
        self.fp = fp

    def load(self) -> dict | None:
        """The last saved state of a run with the same fingerprint, or None."""
        if not self.partial.is_file():
            return None
        import torch

        try:
            state = torch.load(self.partial, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 -- any reason it cannot be read: never dropped silently
            raise self._damaged(_first_line(e)) from None
        if not isinstance(state, dict) or "fingerprint" not in state:
            raise self._damaged("not an rlflow partial checkpoint")
        if state["fingerprint"] != self.fp:
            return None  # another run's (config or inputs changed): start over
        return state

    def _damaged(self, why: str) -> RLFlowError:
        return RLFlowError(f"{self.partial}: the resumable checkpoint of an interrupted run cannot be read ({why}); "
                           f"delete it to start over")

    def save(self, state: dict) -> None:
        _atomic_torch_save({**state, "fingerprint": self.fp}, self.partial)

    def finish(self, payload: dict) -> None:
        _atomic_torch_save(payload, self.final)
        if self.partial.exists():
            os.unlink(self.partial)


def load_checkpoint(path: str | Path) -> dict:
    """A final checkpoint; a missing or unreadable file is a one-line error."""
    import torch

    p = Path(path)
    if not p.is_file():
        raise RLFlowError(f"{p}: no such checkpoint")
    try:
        data = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as e:
        raise RLFlowError(f"{p}: not a readable checkpoint ({e.__class__.__name__})") from None
    if not isinstance(data, dict):
        raise RLFlowError(f"{p}: not an rlflow checkpoint")
    return data


def check_node_features(encoder_config: dict, what: str) -> None:
    """Refuse, in one line, an encoder that reads another number of node features than this rlflow's observations
    have (one per node type: an IR op added or removed since it was trained shifts every column)."""
    from rlflow.env.observation import NODE_FEATURES

    got = encoder_config.get("node_features")
    if got != NODE_FEATURES:
        raise RLFlowError(f"{what} of another rlflow version: its encoder reads {got} node features, this rlflow's "
                          f"observations have {NODE_FEATURES} (the IR's op types changed); train it again "
                          "(train_encoder and the stages after it)")


def load_encoder(path: str | Path, device: str = "cpu"):
    """The trained GraphEncoder of a ``train_encoder`` checkpoint (eval mode, on ``device``), with the checkpoint's
    ``rollout_steps`` (the real steps it learned from) as ``encoder.rollout_steps``."""
    from rlflow.nn.encoder import GraphEncoder

    data = load_checkpoint(path)
    if data.get("kind") != "rlflow.encoder/1":
        raise RLFlowError(f"{path}: not an encoder checkpoint")
    if "rollout_steps" not in data:
        raise RLFlowError(f"{path}: an encoder checkpoint of an older rlflow without its rollout step count; rerun "
                          "train_encoder")
    check_node_features(data["encoder_config"], f"{path}: an encoder checkpoint")
    model = GraphEncoder(**data["encoder_config"])
    model.load_state_dict(data["state_dict"])
    model.rollout_steps = int(data["rollout_steps"])
    return model.to(device).eval()


# ============================================================================================ agent checkpoints
#: ``kind`` of the final checkpoints that hold a whole agent (what ``rlflow optimize --method rlflow --agent``
#: reads), by method; version 1 held only the policy
AGENT_KINDS = {"rlflow": "rlflow.controller/2", "model_free": "rlflow.model-free/2"}
_OLD_AGENT_KINDS = {"rlflow.controller/1": "train_controller", "rlflow.model-free/1": "train_model_free"}
_OTHER_KINDS = {"rlflow.encoder/1": "an encoder checkpoint (train_encoder)",
                "rlflow-world-model/1": "a world-model checkpoint (train_world_model)"}


def rules_fingerprint(rules) -> dict:
    """{count, digest}: the number of rules and a hash of their ids in order (the policy's rule head is indexed by
    position, so an agent only runs with the very rule list it was trained with)."""
    from rlflow.agents.rollouts import rules_digest

    return rules_digest(rules)


def _plan_setting(value) -> float | None:
    """An agent's ``plan_min_saving`` (None: it does not plan; checkpoints from before planning have none)."""
    return None if value is None else float(value)


class Agent:
    """A trained agent, everything needed to run it on any graph: the policy (hierarchical heads), the graph
    encoder, the world model (the controller only: its LSTM state h is half of the policy's input), the
    fingerprint of the rule set it was trained with, and the environment settings (horizon, locations, and the
    real episodes of a run: ``controller.eval_episodes`` / ``model_free.eval_episodes``, or 1 where the stage kept
    the best of its policy snapshots (``eval_policies: snapshots``), the first greedy, the
    others sampled with a fixed seed; ``no_revisit``: config ``env.no_revisit``, False in checkpoints from before it;
    ``plan_min_saving``: the controller plans one step with its world model (config ``controller.plan``, see
    :mod:`rlflow.agents.controller`), None where it does not and for the model-free agent).

    Built by the training stages from their networks (then :meth:`payload` is the final checkpoint) and by
    :func:`load_agent` from such a checkpoint. :meth:`optimise` runs it greedily in the real environment."""

    def __init__(self, method: str, policy, policy_args: dict, encoder, rules: dict, env: dict,
                 world_model=None, config: dict | None = None, info: dict | None = None):
        if method not in AGENT_KINDS:
            raise ValueError(f"unknown agent method {method!r}")
        if (world_model is None) != (method == "model_free"):
            raise ValueError("the controller needs its world model; the model-free agent has none")
        self.method, self.policy, self.policy_args = method, policy, dict(policy_args)
        self.encoder, self.world_model = encoder, world_model
        self.rules = dict(rules)
        self.env = {"max_steps": int(env["max_steps"]), "max_locations": int(env["max_locations"]),
                    "episodes": int(env.get("episodes", 1)), "no_revisit": bool(env.get("no_revisit", False)),
                    "plan_min_saving": _plan_setting(env.get("plan_min_saving"))}
        if self.env["episodes"] < 1:
            raise ValueError("episodes: at least 1")
        self.config, self.info = dict(config or {}), dict(info or {})

    @property
    def kind(self) -> str:
        return AGENT_KINDS[self.method]

    def payload(self) -> dict:
        """The final checkpoint (plain values and tensors: loads with ``torch.load(weights_only=True)``)."""
        cpu = lambda m: {k: v.detach().cpu() for k, v in m.state_dict().items()}  # noqa: E731
        out = {"kind": self.kind, "method": self.method,
               "policy": {"state_dict": cpu(self.policy), "args": self.policy_args},
               "encoder": {"state_dict": cpu(self.encoder), "config": dict(self.encoder.config)},
               "rules": self.rules, "env": self.env, "config": self.config, "info": self.info}
        if self.world_model is not None:
            out["world_model"] = {"state_dict": cpu(self.world_model), "model_args": dict(self.world_model.config)}
        return out

    def check_rules(self, rules, source: str = "the rules file") -> None:
        """One-line error unless ``rules`` is the rule set the agent was trained with."""
        got = rules_fingerprint(rules)
        want = self.rules
        if got["count"] != want.get("count"):
            raise RLFlowError(f"rule set mismatch: the agent was trained with {want.get('count')} rules, {source} "
                              f"has {got['count']}; use the rules file it was trained with")
        if got["digest"] != want.get("digest"):
            raise RLFlowError(f"rule set mismatch: the agent was trained with {want.get('count')} other rules "
                              f"(rule ids digest {want.get('digest')}, {source}: {got['digest']}); use the rules "
                              "file it was trained with")

    def optimise(self, graph, rules, cost, device: str = "cpu", method_label: str | None = None,
                 snapshots: list[dict] | None = None):
        """The agent's real episodes from ``graph`` (``env["episodes"]``: the first greedy, the others sampled,
        seeded: deterministic); the best graph seen, folded, as a :class:`rlflow.search.result.SearchResult`
        (trace up to the best step of the best episode; ``expansions`` = the real steps of all episodes) and the
        episode (:func:`rlflow.agents.real_env.run_episode`'s result).

        ``snapshots`` (policy state dicts taken during training; config ``eval_policies: snapshots``): instead,
        one greedy episode of each snapshot, the best kept as above; the policy is left holding the snapshot
        whose episode found the best graph (so that :meth:`payload` saves it).

        ``result.seconds`` is the optimisation time: building the environment (the rules' matches on the
        graph), the episodes (encoder, policy, world model and real environment every step) and the folding."""
        import time

        from rlflow.agents.real_env import best_run, search_result
        from rlflow.env.graph_rewrite import GraphRewriteEnv
        from rlflow.search.common import finish

        t0 = time.perf_counter()
        env = GraphRewriteEnv(graph, rules, cost, "delta", max_steps=self.env["max_steps"],
                              max_locations=self.env["max_locations"])
        if snapshots:
            runs = []
            for state in snapshots:
                self.policy.load_state_dict(state)
                runs.append(self._episodes(env, device, 1))
            run = best_run(runs)
            self.policy.load_state_dict(snapshots[run["best_episode"]])
        else:
            run = self._episodes(env, device, self.env["episodes"])
        folded, final = finish(run["best_graph"], cost)
        seconds = time.perf_counter() - t0
        how = {"snapshots": len(snapshots), "snapshot_kept": run["best_episode"]} if snapshots else \
            {"first_episode_greedy": True}
        result = search_result(method_label or self.method, graph, rules, cost, run, folded, final, seconds,
                               settings={**self.env, **how})
        return result, run

    def _episodes(self, env, device: str, episodes: int) -> dict:
        """``episodes`` real episodes of the policy as it is now (the first greedy, the others sampled)."""
        if self.method == "rlflow":
            from rlflow.agents.controller import run_in_real_env

            return run_in_real_env(self.policy, self.encoder, self.world_model, env, device, episodes=episodes,
                                   no_revisit=self.env["no_revisit"], plan_min_saving=self.env["plan_min_saving"])
        from rlflow.agents.model_free import run_model_free

        return run_model_free(self.policy, self.encoder, env, device, episodes=episodes,
                              no_revisit=self.env["no_revisit"])


def load_agent(path: str | Path, device: str = "cpu") -> Agent:
    """The agent of a ``train_controller`` or ``train_model_free`` checkpoint (networks in eval mode; the encoder
    on ``device``, the policy and world model on the CPU, where :mod:`rlflow.agents.controller` runs them).
    Missing, unreadable, wrong-kind or damaged files are one-line errors."""
    data = load_checkpoint(path)
    kind = data.get("kind", data.get("format"))
    if kind in _OLD_AGENT_KINDS:
        raise RLFlowError(f"{path}: an agent checkpoint of an older rlflow (kind {kind}) without its encoder and "
                          f"world model; rerun {_OLD_AGENT_KINDS[kind]} to get a self-contained one")
    if kind in _OTHER_KINDS:
        raise RLFlowError(f"{path}: {_OTHER_KINDS[kind]}, not an agent; give the controller.pt of "
                          "train_controller or the model_free.pt of train_model_free")
    methods = {v: k for k, v in AGENT_KINDS.items()}
    if kind not in methods:
        what = "a training run's partial checkpoint" if "fingerprint" in data else f"kind {kind!r}"
        raise RLFlowError(f"{path}: not an agent checkpoint ({what}); give the controller.pt of "
                          "train_controller or the model_free.pt of train_model_free")
    method = methods[kind]
    try:
        return _build_agent(method, data, device)
    except RLFlowError as e:
        raise RLFlowError(f"{path}: {e}") from None
    except Exception as e:  # missing keys, shapes that do not fit: one line
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise RLFlowError(f"{path}: damaged agent checkpoint ({e.__class__.__name__}: {first[:200]})") from None


def _build_agent(method: str, data: dict, device: str) -> Agent:
    from rlflow.nn.encoder import GraphEncoder
    from rlflow.nn.policy import HierarchicalPolicy

    check_node_features(data["encoder"]["config"], "an agent")
    enc = GraphEncoder(**data["encoder"]["config"])
    enc.load_state_dict(data["encoder"]["state_dict"])
    enc = enc.to(device).eval()
    args = dict(data["policy"]["args"])
    policy = HierarchicalPolicy(**args)
    policy.load_state_dict(data["policy"]["state_dict"])
    policy.eval()
    wm = None
    if method == "rlflow":
        from rlflow.nn.mdnrnn import load_world_model_state, make_world_model

        wm = make_world_model(**data["world_model"]["model_args"])
        load_world_model_state(wm, data["world_model"]["state_dict"], "the agent checkpoint")
        wm.eval()
        want = enc.config["z_dim"] + wm.hidden_size
    else:
        want = enc.config["z_dim"]
    if args["in_dim"] != want:
        raise RLFlowError(f"damaged agent checkpoint: the policy reads {args['in_dim']} features, the encoder "
                          f"and world model give {want}")
    rules = data["rules"]
    if not isinstance(rules, dict) or args["n_xfers"] != rules.get("count"):
        raise RLFlowError("damaged agent checkpoint: its rule fingerprint does not fit the policy")
    env = data["env"]
    if not isinstance(env.get("episodes", 1), int) or env.get("episodes", 1) < 1:
        raise RLFlowError("damaged agent checkpoint: env.episodes must be an integer >= 1")
    if env["max_locations"] != args["max_locations"]:
        raise RLFlowError("damaged agent checkpoint: env.max_locations does not fit the policy")
    return Agent(method, policy, args, enc, rules, env, world_model=wm, config=data.get("config"),
                 info=data.get("info"))
