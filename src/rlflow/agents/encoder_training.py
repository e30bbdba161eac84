"""Training the graph encoder on rollout graphs, and encoding every rollout step (the world model's data).

1. Episodes are split into training and held-out episodes (``encoder.holdout``, seeded; the world model uses the
   same split, recorded in ``latents.npz``).
2. Every graph of every episode is taken from the rollouts' graphs file when there is one (:func:`from_stored`;
   ``encoder.replay_check`` episodes are replayed to check it), otherwise re-materialised by replaying the
   actions in a real environment (the environment is deterministic; :func:`materialise`), and turned into a PyG
   graph (:mod:`rlflow.nn.graph_data`).
3. At most ``encoder.max_graphs`` training graphs are sampled (seeded), and at most as many held-out graphs.
   The encoder is trained with Adam on MSE(normalised log1p metrics) + MSE(log1p match counts per rule),
   checkpointing every epoch (a killed run resumes from its last epoch when nothing it depends on changed).
4. Held-out errors: mean relative error of each metric (runtime_ms first), and the match-count accuracy: exact
   (round(expm1(pred)) == count) and mask ((expm1(pred) > 0.5) == (count > 0)), over all (graph, rule) pairs.
5. Every step of every episode is encoded; :func:`latents_arrays` lays the z out with the rollouts' actions,
   metrics, counts and flags (format below; the interface to the world-model stage).

``latents.npz`` (E episodes, T = env.max_steps, N rules, Z = z_dim)::

    z         float32 [E, T+1, Z]   the graph before each step and after the last; zero after the episode's end
    lengths   int32   [E]           actions per episode
    actions   int32   [E, T, 2]     (xfer, location); -1 after the end
    metrics   float64 [E, T+1, 4]   [runtime_ms, flops, bytes, launches] (rollouts file); the last row repeated
    counts    int32   [E, T+1, N]   matches per rule (dense); the last row repeated
    done      bool    [E, T]        the episode ended at this step; False after the end
    valid     bool    [E, T]        the action was valid; False after the end
    holdout   bool    [E]           held-out episode
    n_xfers, max_locations, z_dim   scalars
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

import numpy as np
import torch

from rlflow.agents.checkpoint import Checkpointer
from rlflow.agents.rollouts import FORMAT, rules_digest
from rlflow.cost import METRIC_NAMES
from rlflow.errors import RLFlowError


def _bar(progress: bool, **kw):
    from tqdm import tqdm

    return tqdm(file=sys.stderr, mininterval=1.0, disable=None if progress else True, leave=False, **kw)


def check_rollouts(doc: dict, rules: Sequence, max_steps: int, max_locations: int, source: str = "rollouts") -> None:
    """One-line errors when the rollouts file does not fit the rules and the environment settings."""
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise RLFlowError(f"{source}: not an {FORMAT} file")
    if doc.get("rules") != rules_digest(rules):
        raise RLFlowError(f"{source}: collected with other rules ({doc.get('rules')}, these are {rules_digest(rules)})")
    env = doc.get("env", {})
    if env.get("max_steps") != max_steps or env.get("max_locations") != max_locations:
        raise RLFlowError(f"{source}: collected with env.max_steps={env.get('max_steps')}, env.max_locations="
                          f"{env.get('max_locations')}; the config says {max_steps}, {max_locations}")
    if not doc.get("episodes"):
        raise RLFlowError(f"{source}: no episodes")


def split_episodes(n: int, holdout: float, seed: int) -> np.ndarray:
    """bool [n]: True for held-out episodes (round(holdout * n), at least 1 when holdout > 0 and n >= 2, and at
    least one training episode)."""
    k = int(round(holdout * n))
    if holdout > 0 and n >= 2:
        k = min(max(k, 1), n - 1)
    k = min(k, max(n - 1, 0))
    mask = np.zeros(n, bool)
    mask[np.random.default_rng([seed, 7]).permutation(n)[:k]] = True
    return mask


#: the largest relative difference between a replayed metric and the rollouts file's (the environment and cost
#: model are deterministic; this only absorbs summation order)
REPLAY_RTOL = 1e-6


def materialise(env, episodes: Sequence[dict], progress: bool = False,
                source: str = "the rollouts file", numbers: Sequence[int] | None = None) -> tuple[list[list], dict]:
    """Replay every episode; -> (graphs: per episode T_e + 1 ``Data`` with targets, replay check).

    Every replayed step must reproduce the file's metrics (within :data:`REPLAY_RTOL`) and match counts exactly:
    otherwise the rollouts were collected with another model, rule set or cost model, and the encoder would learn
    targets that belong to other graphs, so the first step that differs is a one-line RLFlowError naming
    ``source``, the episode (its number in ``numbers``, when given, else its position), the step and the value.
    The check record gives the largest metric difference seen and the steps whose counts differ (0).
    """
    from rlflow.nn.graph_data import to_data

    graphs: list[list] = []
    max_rel = 0.0
    bar = _bar(progress, total=sum(len(e["actions"]) + 1 for e in episodes), desc="replay", unit="graph")
    for e, ep in enumerate(episodes):
        obs, info = env.reset()
        seq = [to_data(obs, info["counts"])]
        infos = [info]
        for a in ep["actions"]:
            obs, _, _, _, info = env.step(a)
            seq.append(to_data(obs, info["counts"]))
            infos.append(info)
        for t, inf in enumerate(infos):
            where = f"{source}: episode {numbers[e] if numbers is not None else e}, step {t}"
            if t >= len(ep["metrics"]) or t >= len(ep["counts"]):
                raise RLFlowError(f"{where}: the file has no metrics or counts for this step")
            got = np.array([inf[k] for k in METRIC_NAMES], np.float64)
            want = np.asarray(ep["metrics"][t], np.float64)
            rel = np.abs(got - want) / np.maximum(np.abs(want), 1e-12)
            if got.shape != want.shape or not np.all(rel <= REPLAY_RTOL):
                k = int(np.argmax(np.where(np.isnan(rel), np.inf, rel))) if got.shape == want.shape else 0
                raise RLFlowError(
                    f"{where}: replaying the actions gives {METRIC_NAMES[k]} {got[k]:.6g}, the file has "
                    f"{want[k] if want.shape == got.shape else list(want)}: the rollouts were collected with another "
                    f"model, rules or cost model; collect them again")
            max_rel = max(max_rel, float(np.max(rel)))
            replayed = {int(k): int(inf["counts"][k]) for k in np.flatnonzero(inf["counts"])}
            stored = {int(k): int(c) for k, c in ep["counts"][t] if int(c)}
            if replayed != stored:
                k = min(x for x in replayed.keys() | stored.keys() if replayed.get(x, 0) != stored.get(x, 0))
                raise RLFlowError(
                    f"{where}: replaying the actions gives {replayed.get(k, 0)} match(es) of rule {k}, the file has "
                    f"{stored.get(k, 0)}: the rollouts were collected with another model, rules or cost model; "
                    f"collect them again")
        graphs.append(seq)
        bar.update(len(seq))
    bar.close()
    return graphs, {"max_metric_rel_diff": max_rel, "count_mismatch_steps": 0, "replayed_episodes": len(episodes)}


def from_stored(env, episodes: Sequence[dict], stored: Iterable[Sequence], check: int, seed: int,
                progress: bool = False, source: str = "the rollouts file",
                graphs_source: str = "the graphs file") -> tuple[list[list], dict]:
    """Like :func:`materialise`, from stored graphs instead of a replay of every episode.

    ``stored`` yields each episode's T_e + 1 observation graphs (:func:`rlflow.agents.rollouts.unpack_graphs`);
    the targets come from the rollouts file's metrics and counts. ``check`` episodes (a seeded sample; all of
    them when there are no more) are replayed with :func:`materialise` (which checks the file's metrics and
    counts) and each of their graphs must equal the stored one (node features, links, edge features), or a
    one-line RLFlowError names ``graphs_source``, the episode and the step.
    """
    from rlflow.nn.graph_data import to_data

    graphs: list[list] = []
    for ep, seq in zip(episodes, stored):
        datas = []
        for t, g in enumerate(seq):
            counts = np.zeros(env.n_xfers, np.int64)
            for k, c in ep["counts"][t]:
                counts[k] = c
            datas.append(to_data({"graph": g, "global": np.asarray(ep["metrics"][t], np.float64)}, counts))
        graphs.append(datas)
    pick = np.sort(np.random.default_rng([seed, 19]).choice(len(episodes), min(check, len(episodes)),
                                                             replace=False)).tolist()
    replayed, record = materialise(env, [episodes[e] for e in pick], progress, source, numbers=pick)
    for e, seq in zip(pick, replayed):
        for t, (want, got) in enumerate(zip(seq, graphs[e])):
            for name in ("x", "edge_index", "edge_attr"):
                if not torch.equal(getattr(want, name), getattr(got, name)):
                    raise RLFlowError(f"{graphs_source}: episode {e}, step {t}: the stored graph differs from the "
                                      f"replayed one ({name}); collect the rollouts again")
    return graphs, {**record, "stored_graphs": sum(len(s) for s in graphs)}


def _sample(pairs: list[tuple[int, int]], k: int, rng: np.random.Generator) -> list[tuple[int, int]]:
    if len(pairs) <= k:
        return pairs
    idx = np.sort(rng.choice(len(pairs), size=k, replace=False))
    return [pairs[i] for i in idx]


def _batches(datas: Sequence, batch_size: int, device: str):
    from rlflow.nn.graph_data import batch

    for i in range(0, len(datas), batch_size):
        yield batch(datas[i:i + batch_size]).to(device)


def _loss(model, b) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    z = model(b)
    pm, pc = model.predict(z)
    lm = torch.nn.functional.mse_loss(pm, model.normalise(b.y_metrics))
    lc = torch.nn.functional.mse_loss(pc, b.y_counts)
    return lm + lc, lm, lc


@torch.no_grad()
def evaluate(model, datas: Sequence, device: str, batch_size: int) -> dict:
    """Held-out errors of the prediction heads on ``datas`` (with targets)."""
    model.eval()
    n = 0
    rel_sum = np.zeros(len(METRIC_NAMES))
    exact = mask_ok = present = present_exact = entries = 0
    loss_m = loss_c = 0.0
    for b in _batches(datas, batch_size, device):
        z = model(b)
        pm, pc = model.predict(z)
        loss_m += float(torch.nn.functional.mse_loss(pm, model.normalise(b.y_metrics), reduction="sum"))
        loss_c += float(torch.nn.functional.mse_loss(pc, b.y_counts, reduction="sum"))
        pred = model.metrics_from(pm).double()
        true = torch.expm1(b.y_metrics.double())
        rel_sum += ((pred - true).abs() / true.abs().clamp(min=1e-12)).sum(0).cpu().numpy()
        pcount = torch.expm1(pc)
        tcount = torch.round(torch.expm1(b.y_counts))
        hit = torch.round(pcount).clamp(min=0) == tcount
        exact += int(hit.sum())
        mask_ok += int(((pcount > 0.5) == (tcount > 0)).sum())
        present += int((tcount > 0).sum())
        present_exact += int((hit & (tcount > 0)).sum())
        entries += tcount.numel()
        n += pm.shape[0]
    model.train()
    if n == 0:
        return {"graphs": 0}
    rel = rel_sum / n
    return {
        "graphs": n,
        "runtime_rel_err": float(rel[0]),
        "metric_rel_err": {k: float(v) for k, v in zip(METRIC_NAMES, rel)},
        "counts_exact_acc": exact / entries,
        "counts_mask_acc": mask_ok / entries,
        "counts_exact_acc_where_matched": present_exact / present if present else None,
        "loss_metrics": loss_m / (n * len(METRIC_NAMES)),
        "loss_counts": loss_c / entries,
    }


@torch.no_grad()
def encode(model, datas: Sequence, device: str, batch_size: int) -> np.ndarray:
    """z [len(datas), Z] float32."""
    model.eval()
    out = [model(b).float().cpu().numpy() for b in _batches(datas, batch_size, device)]
    model.train()
    return np.concatenate(out) if out else np.zeros((0, model.config["z_dim"]), np.float32)


def latents_arrays(episodes: Sequence[dict], z: Sequence[np.ndarray], holdout: np.ndarray, max_steps: int,
                   n_xfers: int, max_locations: int, z_dim: int) -> dict[str, np.ndarray]:
    """The arrays of ``latents.npz`` (see the module docstring); ``z[e]`` is [T_e + 1, Z]."""
    E, T, N = len(episodes), max_steps, n_xfers
    out = {
        "z": np.zeros((E, T + 1, z_dim), np.float32),
        "lengths": np.zeros(E, np.int32),
        "actions": np.full((E, T, 2), -1, np.int32),
        "metrics": np.zeros((E, T + 1, len(METRIC_NAMES)), np.float64),
        "counts": np.zeros((E, T + 1, N), np.int32),
        "done": np.zeros((E, T), bool),
        "valid": np.zeros((E, T), bool),
        "holdout": np.asarray(holdout, bool).copy(),
    }
    for e, ep in enumerate(episodes):
        L = len(ep["actions"])
        if L > T:
            raise RLFlowError(f"episode {e} has {L} actions, more than env.max_steps={T}")
        out["z"][e, :L + 1] = z[e]
        out["lengths"][e] = L
        if L:
            out["actions"][e, :L] = np.asarray(ep["actions"], np.int32)
        m = np.asarray(ep["metrics"], np.float64)
        out["metrics"][e, :L + 1] = m
        out["metrics"][e, L + 1:] = m[-1]
        for t, row in enumerate(ep["counts"]):
            for k, c in row:
                out["counts"][e, t, k] = c
        out["counts"][e, L + 1:] = out["counts"][e, L]
        out["done"][e, :L] = ep["done"]
        out["valid"][e, :L] = ep["valid"]
    out["n_xfers"] = np.array(N, np.int64)
    out["max_locations"] = np.array(max_locations, np.int64)
    out["z_dim"] = np.array(z_dim, np.int64)
    return out


@dataclass
class EncoderResult:
    model: object                       # GraphEncoder (on the device)
    latents: dict[str, np.ndarray]
    metrics: dict = field(default_factory=dict)


#: held-out graphs scored after every epoch for the curve, at most (a forward pass each; the training epoch
#: makes a forward and a backward pass over up to encoder.max_graphs)
HELDOUT_CURVE_GRAPHS = 500
#: per-epoch history keys -> curve names (dvclive, :mod:`rlflow.agents.logging`)
CURVE_NAMES = {"loss": "train/loss", "loss_metrics": "train/loss_metrics", "loss_counts": "train/loss_counts",
               "heldout_loss": "heldout/loss", "heldout_loss_metrics": "heldout/loss_metrics",
               "heldout_loss_counts": "heldout/loss_counts"}


def train_encoder(env, episodes: Sequence[dict], cfg: dict, seed: int, device: str, ckpt: Checkpointer,
                  progress: bool = False, on_epoch: Callable[[int, float, float], None] | None = None,
                  live=None, source: str = "the rollouts file",
                  replayed: tuple[list[list], dict] | None = None) -> EncoderResult:
    """Split, replay, train (resuming from ``ckpt``'s partial file), evaluate and encode (see the module doc).

    ``cfg`` is the ``encoder`` config section; ``env`` a reward-free environment of the rollouts' problem.
    ``on_epoch(epoch, loss, seconds)`` is called after each epoch's checkpoint. After every epoch the held-out
    loss is computed too (on at most :data:`HELDOUT_CURVE_GRAPHS` held-out graphs); each epoch's row (train and
    held-out losses) goes to ``live`` (a :class:`rlflow.agents.logging.TrainingLog`), the rows of a resumed run's
    earlier epochs first. ``source`` (the rollouts file) names the file in the error when a replayed step does not
    reproduce it (:func:`materialise`). ``replayed``: :func:`materialise`'s (or :func:`from_stored`'s) result for
    ``episodes``, when the caller has the graphs already (the stage's stored graphs; the multi-model agent replays
    each model's episodes in that model's environment).
    """
    from rlflow.nn.encoder import GraphEncoder

    t0 = time.perf_counter()
    holdout = split_episodes(len(episodes), float(cfg["holdout"]), seed)
    graphs, replay_check = replayed if replayed is not None else materialise(env, episodes, progress, source)
    if len(graphs) != len(episodes):
        raise ValueError(f"{len(graphs)} replayed episodes for {len(episodes)} episodes")
    t_replay = time.perf_counter() - t0

    rng = np.random.default_rng([seed, 11])
    train_pairs = [(e, t) for e in range(len(episodes)) if not holdout[e] for t in range(len(graphs[e]))]
    held_pairs = [(e, t) for e in range(len(episodes)) if holdout[e] for t in range(len(graphs[e]))]
    max_graphs = int(cfg["max_graphs"])
    train_pairs = _sample(train_pairs, max_graphs, rng)
    held_pairs = _sample(held_pairs, max_graphs, rng)
    train_set = [graphs[e][t] for e, t in train_pairs]
    held_set = [graphs[e][t] for e, t in held_pairs]

    first = graphs[0][0]
    ym = torch.cat([d.y_metrics for d in train_set]).double()
    mean, std = ym.mean(0), (ym.std(0, unbiased=False) if len(train_set) > 1 else torch.ones(ym.shape[1]))
    model = GraphEncoder(first.x.shape[1], first.edge_attr.shape[1], first.u.shape[1], int(cfg["hidden"]),
                         int(cfg["layers"]), int(cfg["heads"]), int(cfg["z_dim"]), n_xfers=env.n_xfers)
    model.set_normalisation(mean.float(), std.float())
    model.to(device)
    opt = torch.optim.Adam(model.parameters(), lr=float(cfg["lr"]))

    epochs, batch_size = int(cfg["epochs"]), int(cfg["batch_size"])
    history: list[dict] = []
    start = 0
    state = ckpt.load()
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        start, history = int(state["epoch"]), list(state["history"])
    resumed_from = start
    if live is not None:
        live.replay(history, "epoch", CURVE_NAMES)

    # the per-epoch held-out loss (the curve) on at most HELDOUT_CURVE_GRAPHS of the held-out graphs, a fixed
    # seeded subset (the final held-out figures use them all)
    held_curve = held_set
    if len(held_set) > HELDOUT_CURVE_GRAPHS:
        pick = np.random.default_rng([seed, 17]).choice(len(held_set), HELDOUT_CURVE_GRAPHS, replace=False)
        held_curve = [held_set[i] for i in np.sort(pick)]

    t1 = time.perf_counter()
    bar = _bar(progress, total=epochs, initial=start, desc="encoder epochs", unit="epoch")
    model.train()
    for epoch in range(start, epochs):
        te = time.perf_counter()
        order = np.random.default_rng([seed, 13, epoch]).permutation(len(train_set))
        shuffled = [train_set[i] for i in order]
        tot = tm = tc = 0.0
        for b in _batches(shuffled, batch_size, device):
            loss, lm, lc = _loss(model, b)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            k = b.num_graphs
            tot, tm, tc = tot + loss.item() * k, tm + lm.item() * k, tc + lc.item() * k
        n = max(len(train_set), 1)
        row = {"epoch": epoch + 1, "loss": tot / n, "loss_metrics": tm / n, "loss_counts": tc / n}
        if held_curve:
            h = evaluate(model, held_curve, device, batch_size)
            row.update(heldout_loss=h["loss_metrics"] + h["loss_counts"], heldout_loss_metrics=h["loss_metrics"],
                       heldout_loss_counts=h["loss_counts"])
        row["seconds"] = time.perf_counter() - te
        history.append(row)
        if live is not None:
            live.log_row(row, "epoch", CURVE_NAMES)
        ckpt.save({"epoch": epoch + 1, "model": model.state_dict(), "optimizer": opt.state_dict(),
                   "history": history})
        bar.set_postfix(loss=f"{tot / n:.4f}")
        bar.update()
        if on_epoch is not None:
            on_epoch(epoch + 1, tot / n, history[-1]["seconds"])
    bar.close()
    t_train = time.perf_counter() - t1

    t2 = time.perf_counter()
    held = evaluate(model, held_set, device, batch_size)
    if held_set:  # for scale: a constant guess, each rule's median count over the training graphs
        tc = torch.round(torch.expm1(torch.cat([d.y_counts for d in train_set])))
        hc = torch.round(torch.expm1(torch.cat([d.y_counts for d in held_set])))
        guess = tc.median(0).values
        held["baseline_median_counts"] = {"counts_exact_acc": float((hc == guess).float().mean()),
                                          "counts_mask_acc": float(((hc > 0) == (guess > 0)).float().mean())}
        tr = torch.expm1(torch.cat([d.y_metrics[:, 0] for d in train_set]).double())
        hr = torch.expm1(torch.cat([d.y_metrics[:, 0] for d in held_set]).double())
        held["baseline_mean_runtime_rel_err"] = float(((hr - tr.mean()).abs() / hr).mean())
    train_eval = evaluate(model, train_set[: min(len(train_set), 500)], device, batch_size)
    z = [encode(model, seq, device, max(batch_size, 64)) for seq in graphs]
    latents = latents_arrays(episodes, z, holdout, env.max_steps, env.n_xfers, env.max_locations,
                             int(cfg["z_dim"]))
    t_encode = time.perf_counter() - t2
    metrics = {
        "heldout": held,
        "train_eval": train_eval,
        "train_loss": [h["loss"] for h in history],
        "history": history,
        "episodes": {"train": int((~holdout).sum()), "heldout": int(holdout.sum())},
        "graphs": {"train": len(train_set), "heldout": len(held_set),
                   "encoded": int(sum(len(s) for s in graphs))},
        "resumed_from_epoch": resumed_from,
        "replay_check": replay_check,
        "normalisation": {"metric_mean": mean.tolist(), "metric_std": model.metric_std.tolist()},
        "seconds": {"replay": t_replay, "train_this_run": t_train, "evaluate_encode": t_encode},
    }
    return EncoderResult(model, latents, metrics)


def encoder_payload(result: EncoderResult, model: str | list[str], cfg: dict, seed: int, rules: Sequence,
                    episodes: Sequence[dict]) -> dict:
    """The final encoder checkpoint (``rlflow.encoder/1``, read by :func:`rlflow.agents.checkpoint.load_encoder`)
    of a trained encoder: ``model`` is the model (or the models) whose rollouts ``episodes`` it learned from."""
    from rlflow.agents.rollouts import rules_digest

    net = result.model
    return {
        "kind": "rlflow.encoder/1",
        "model": model,
        "state_dict": {k: v.detach().cpu() for k, v in net.state_dict().items()},
        "encoder_config": dict(net.config),
        "config": cfg,
        "seed": seed,
        "rules": rules_digest(rules),
        # the real-environment steps of the rollouts it learned from (part of every agent's real interactions)
        "rollout_steps": sum(len(ep["actions"]) for ep in episodes),
        "node_features": net.config["node_features"],
        "edge_features": net.config["edge_features"],
        "normalisation": result.metrics["normalisation"],
        "metric_names": list(METRIC_NAMES),
    }
