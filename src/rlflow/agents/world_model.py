"""Training and evaluating the MDN-RNN world model (:mod:`rlflow.nn.mdnrnn`) on the encoder's latents.

Input: ``latents.npz`` (stage ``train_encoder``; arrays for E episodes of at most T steps, N rules, Z dims):
``z`` [E, T+1, Z], ``lengths`` [E], ``actions`` [E, T, 2] (xfer, location; -1 padding), ``metrics`` [E, T+1, 4],
``counts`` [E, T+1, N], ``done`` [E, T], ``valid`` [E, T], ``holdout`` [E], scalars ``n_xfers``,
``max_locations``, ``z_dim``.

Training pairs of episode e at step t < lengths[e]: input (z_t, a_t, counts_t); targets z_{t+1}, whether the
step changed any cost metric (changed_t), the normalised log1p-metric delta (see :mod:`rlflow.nn.mdnrnn`;
mean/std over the training steps that changed them), done_t and log1p(counts_{t+1}) (counts capped at
max_locations, as the masks are). Steps t >= lengths[e] are padding: a mask removes them from every loss term.

    loss = gmm NLL per dimension + BCE(changed) + MSE(deltas, over the steps that changed the metrics)
           + BCE(done) + MSE(log1p counts)

The deltas are a zero-inflated mixture: a step that changes nothing (a cost-neutral rewrite) is the ``changed``
head's business, so the delta head is never pulled towards 0 by them and never predicts a saving for them.

Adam, learning rate decayed as lr * (1 - step / total_steps)^2 (RLFlow's 2nd-degree polynomial to 0), batches of
whole episodes shuffled per epoch with a generator seeded by (seed, epoch) so that a resumed run repeats the
same batches. Held-out episodes (``holdout``) are never trained on; they give the per-epoch held-out loss and
the final quality figures (:func:`evaluate`).
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from rlflow.errors import RLFlowError
from rlflow.nn.losses import gmm_loss, masked_bce_with_logits, masked_mse
from rlflow.nn.mdnrnn import MDNRNN, EnsembleMDNRNN, load_world_model_state, make_world_model

METRIC_NAMES = ("runtime_ms", "flops", "bytes", "launches")
ARRAYS = ("z", "lengths", "actions", "metrics", "counts", "done", "valid", "holdout")
SCALARS = ("n_xfers", "max_locations", "z_dim")
LOSS_TERMS = ("loss", "nll", "change_bce", "delta_mse", "done_bce", "count_mse")
CURVE_COLUMNS = ("epoch", "lr", *(f"{part}_{t}" for part in ("train", "heldout") for t in LOSS_TERMS), "seconds")
#: a step whose log1p-metric deltas are all below this in magnitude changed nothing
CHANGE_EPS = 1e-9


# -- data ---------------------------------------------------------------------------------------------------
def merge_latents(a: dict, b: dict) -> dict:
    """The episodes of ``a`` then those of ``b`` (both in the format of :func:`load_latents`, same rules, horizon
    and latent size)."""
    for k in SCALARS:
        if int(a[k]) != int(b[k]):
            raise RLFlowError(f"latents: cannot merge episodes with {k} {int(a[k])} and {int(b[k])}")
    if a["z"].shape[1:] != b["z"].shape[1:]:
        raise RLFlowError(f"latents: cannot merge episodes of shape {a['z'].shape[1:]} and {b['z'].shape[1:]}")
    return {**{k: np.concatenate([a[k], b[k]]) for k in ARRAYS}, **{k: a[k] for k in SCALARS}}


def load_latents(path: str | Path) -> dict[str, Any]:
    """Read and check a latents file; anything wrong is a one-line :class:`RLFlowError` naming the file."""
    from rlflow.atomic import read_npz

    p = Path(path)
    data = read_npz(p, "no such latents file (make it with `rlflow train-encoder`)", "not a readable .npz file")
    missing = [k for k in ARRAYS + SCALARS if k not in data]
    if missing:
        raise RLFlowError(f"{p}: not a latents file (missing {', '.join(missing)})")
    try:
        n, L, zd = (int(data[k]) for k in SCALARS)
    except (TypeError, ValueError):
        raise RLFlowError(f"{p}: n_xfers, max_locations and z_dim must be integer scalars") from None
    z = data["z"]
    if z.ndim != 3 or z.shape[0] < 1 or z.shape[1] < 2 or z.shape[2] != zd:
        raise RLFlowError(f"{p}: z has shape {z.shape}, expected [episodes, steps+1, z_dim={zd}]")
    E, T = z.shape[0], z.shape[1] - 1
    want = {"lengths": (E,), "actions": (E, T, 2), "metrics": (E, T + 1, 4), "counts": (E, T + 1, n),
            "done": (E, T), "valid": (E, T), "holdout": (E,)}
    for k, shape in want.items():
        if tuple(data[k].shape) != shape:
            raise RLFlowError(f"{p}: {k} has shape {tuple(data[k].shape)}, expected {shape}")
    for k in ARRAYS:
        if data[k].dtype.kind not in "biuf":
            raise RLFlowError(f"{p}: {k} is not numeric (dtype {data[k].dtype})")
    if n < 1 or L < 1 or zd < 1:
        raise RLFlowError(f"{p}: n_xfers, max_locations and z_dim must be >= 1")
    lengths = data["lengths"].astype(np.int64)
    if lengths.min() < 0 or lengths.max() > T:
        raise RLFlowError(f"{p}: lengths must lie in [0, {T}]")
    steps = np.arange(T)[None, :] < lengths[:, None]
    acts = data["actions"][steps]
    if acts.size and (acts[:, 0].min() < 0 or acts[:, 0].max() > n or acts[:, 1].min() < 0):
        raise RLFlowError(f"{p}: actions out of range (xfer in [0, {n}], location >= 0)")
    for k in ("z", "metrics"):
        if not np.isfinite(data[k][:, :T + 1]).all():
            raise RLFlowError(f"{p}: {k} has non-finite values")
    data.update(n_xfers=n, max_locations=L, z_dim=zd, lengths=lengths)
    return data


@dataclass
class Tensors:
    """Padded training tensors of a set of episodes (all on one device)."""

    z_in: torch.Tensor       # [E, T, Z]
    actions: torch.Tensor    # [E, T, 2] long
    z_next: torch.Tensor     # [E, T, Z]
    deltas: torch.Tensor     # [E, T, 4]  normalised
    changed: torch.Tensor    # [E, T]     float 0/1: the step changed a metric
    done: torch.Tensor       # [E, T]     float 0/1
    counts_in: torch.Tensor  # [E, T, N] counts_t, capped at max_locations (the world model's input)
    log_counts: torch.Tensor  # [E, T, N] log1p(counts_{t+1}), capped at max_locations (its target)
    mask: torch.Tensor       # [E, T] bool
    index: np.ndarray        # episode indices into the latents file

    def __len__(self) -> int:
        return len(self.index)

    def batch(self, idx) -> "Tensors":
        return Tensors(*(getattr(self, f)[idx] for f in TENSOR_FIELDS), self.index[idx.cpu().numpy()])


TENSOR_FIELDS = ("z_in", "actions", "z_next", "deltas", "changed", "done", "counts_in", "log_counts", "mask")


def log_deltas(metrics: np.ndarray) -> np.ndarray:
    """metrics [E, T+1, 4] -> log1p(metrics[t+1]) - log1p(metrics[t]), [E, T, 4]."""
    lm = np.log1p(np.maximum(metrics.astype(np.float64), 0.0))
    return lm[:, 1:] - lm[:, :-1]


def delta_stats(data: dict, episodes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Mean and std (floored at 1e-6; 1 where there are none) of the log-deltas of these episodes' steps that
    changed a metric."""
    T = data["z"].shape[1] - 1
    d = log_deltas(data["metrics"])[episodes]
    m = np.arange(T)[None, :] < data["lengths"][episodes][:, None]
    rows = d[m]
    rows = rows[np.abs(rows).max(-1) > CHANGE_EPS]
    if len(rows) == 0:
        return np.zeros(4), np.ones(4)
    return rows.mean(0), np.maximum(rows.std(0), 1e-6)


#: pseudo-steps of the whole data's change rate (and of a zero delta) added to each rule's own steps
PRIOR_STEPS = 1.0
#: a rule's mean effect on another rule's count that enters the count effects, in matches per application
EFFECT_MIN = 0.5


def rule_priors(data: dict, episodes: np.ndarray, mean: np.ndarray, std: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per rule (N+1, the NO-OP last) over these episodes' steps: the log-odds that a step changes the metrics,
    (changes + PRIOR_STEPS x overall rate) / (steps + PRIOR_STEPS), and the mean normalised delta of its steps
    that changed them, sum / (changes + PRIOR_STEPS) (a rule seen rarely stays near the overall figures).
    -> (change_logit [N+1], deltas [N+1, 4]); with :func:`count_effects`, what
    :meth:`rlflow.nn.mdnrnn.MDNRNN.set_rule_priors` starts from."""
    N1 = int(data["n_xfers"]) + 1
    T = data["z"].shape[1] - 1
    m = np.arange(T)[None, :] < data["lengths"][episodes][:, None]
    xfer = np.clip(data["actions"][episodes][..., 0], 0, N1 - 1)[m]
    raw = log_deltas(data["metrics"])[episodes][m]
    changed = np.abs(raw).max(-1) > CHANGE_EPS
    steps = np.bincount(xfer, minlength=N1).astype(np.float64)
    changes = np.bincount(xfer, weights=changed.astype(np.float64), minlength=N1)
    rate = changes.sum() / max(steps.sum(), 1.0)
    p = (changes + PRIOR_STEPS * rate) / (steps + PRIOR_STEPS)
    p = np.clip(p, 1e-4, 1 - 1e-4)
    norm = (raw - mean) / std
    sums = np.stack([np.bincount(xfer[changed], weights=norm[changed, k], minlength=N1) for k in range(norm.shape[1])], -1)
    return np.log(p / (1 - p)), sums / (changes[:, None] + PRIOR_STEPS)


def count_effects(data: dict, episodes: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """What applying a rule does to the match counts (capped at max_locations), over these episodes' valid steps:
    the mean change of rule j's count when rule k is applied, sum / (applications of k + PRIOR_STEPS).

    -> uses [N+1] (the diagonal: a rule's own count; 0 for the NO-OP), effects [P, 4] (rows k, j, change,
    change where j's count is 0) of the other pairs whose change is at least EFFECT_MIN in size, keeping every decrease (one merge uses up the
    same pair's other merge rules' matches) and the increases, and circular [Q, 2] (rows k, j): the increases left
    out, those that go round in circles a dream can exploit. k and j are then in one strongly connected component
    of the increases (j also raises k, directly or through other rules) that is not a way down: a rule in it
    raises the runtime in at least half of its steps, or none lowers it in half of its steps. A merge raises its
    un-merge, which raises the merge back (an earlier world model paid a controller about +0.24 per cycle); Mul
    <-> ScalarMul changes nothing (a controller spent 52 of its 96 real steps on it). The world model is not
    taught these raises either (:func:`make_tensors` keeps j's count in the target), or its count head learns
    them as a drift that every step adds. A circle in which no step raises the runtime and some lower it is kept:
    the attention scale moves into the Q MatMul (cheaper), through the head split and back, and only this way
    reaches the fold into the weight. Leaving it out hid that fold from the dream. One-way raises, such as a
    scale moved next to a weight opening the fold into it, are kept.

    A raise applies to a rule whose count is 0 (the last column) only where the data saw k open j from nothing:
    the mean count of j after k, over k's steps with j at 0, is at least EFFECT_MIN (shrunk by PRIOR_STEPS; else
    0). Moving bert's attention scale off the Q/K input makes a merge possible again (+0.61 on average), but
    the rollouts never moved it once every merge was made; applied there anyway, the dream gave a controller a
    phantom merge after every scale move. Nor does a circle that goes down reopen its way in (a rule the first
    graph had matches of) from 0: moving the scale through the head split reopens the move into the MatMul, and
    a controller pumped that circle for +0.03 a lap, 34 times in one dream episode."""
    from scipy.sparse import csr_matrix
    from scipy.sparse.csgraph import connected_components

    N, L = int(data["n_xfers"]), int(data["max_locations"])
    T = data["z"].shape[1] - 1
    e, t = np.nonzero(np.arange(T)[None, :] < data["lengths"][episodes][:, None])
    e = np.asarray(episodes)[e]
    k = np.clip(data["actions"][e, t, 0], 0, N)
    use = (k < N) & data["valid"][e, t].astype(bool)
    e, t, k = e[use], t[use], k[use]
    total, from_zero, at_zero = np.zeros((N + 1, N)), np.zeros((N + 1, N)), np.zeros((N + 1, N))
    for rule in np.unique(k):
        sel = k == rule
        before = np.minimum(data["counts"][e[sel], t[sel]], L).astype(np.float64)
        after = np.minimum(data["counts"][e[sel], t[sel] + 1], L).astype(np.float64)
        total[rule] = (after - before).sum(0)
        zero = before == 0
        from_zero[rule] = np.where(zero, after, 0.0).sum(0)
        at_zero[rule] = zero.sum(0)
    steps = np.bincount(k, minlength=N + 1)
    change = total / (steps[:, None] + PRIOR_STEPS)
    # a raise of a rule whose count is 0 only where the data saw k open j from nothing, often enough
    opens = from_zero / (at_zero + PRIOR_STEPS)
    uses = np.append(np.diagonal(change[:N]), 0.0)
    change[np.arange(N), np.arange(N)] = 0.0
    up = change[:N] >= EFFECT_MIN
    n_comp, comp = connected_components(csr_matrix(up), directed=True, connection="strong")
    runtime = log_deltas(data["metrics"])[e, t, 0]
    half = 0.5 * np.maximum(steps[:N], 1)
    lowers = np.bincount(k, weights=runtime < -CHANGE_EPS, minlength=N + 1)[:N] >= half
    raises = np.bincount(k, weights=runtime > CHANGE_EPS, minlength=N + 1)[:N] >= half
    # per component: a way down (some rule lowers the runtime, none raises it)
    downhill = ((np.bincount(comp, weights=lowers, minlength=n_comp) > 0)
                & (np.bincount(comp, weights=raises, minlength=n_comp) == 0))
    same = up & (comp[:, None] == comp[None, :])
    circle = same & ~downhill[comp][:, None]
    src, dst = np.nonzero((change[:N] <= -EFFECT_MIN) | (up & ~circle))
    # a circle that goes down never reopens a rule the first graph already had matches of (its way in): the
    # circle's other rules open from 0 on the way down, but reopening the way in would pump the circle
    way_in = (np.minimum(data["counts"][np.asarray(episodes), 0], L) > 0).any(0)
    opens_from_zero = (opens[src, dst] >= EFFECT_MIN) & ~(same[src, dst] & way_in[dst])
    raise_at_zero = np.where((change[src, dst] > 0) & opens_from_zero, change[src, dst], 0.0)
    effects = np.stack([src, dst, change[src, dst], raise_at_zero], -1).astype(np.float32).reshape(-1, 4)
    return uses, effects, np.argwhere(circle).astype(np.int64).reshape(-1, 2)


def make_tensors(data: dict, episodes: np.ndarray, mean: np.ndarray, std: np.ndarray, device,
                 circular: np.ndarray | None = None) -> Tensors:
    """The padded tensors of these episodes; ``circular`` [Q, 2] (rule k, rule j; :func:`count_effects`): where k
    is applied, the target keeps j's count as it was."""
    T = data["z"].shape[1] - 1
    z = torch.as_tensor(data["z"][episodes], dtype=torch.float32)
    lengths = data["lengths"][episodes]
    mask = torch.as_tensor(np.arange(T)[None, :] < lengths[:, None])
    raw = log_deltas(data["metrics"])[episodes]
    deltas = (raw - mean) / std
    counts = np.clip(data["counts"][episodes].astype(np.float32), 0, int(data["max_locations"]))  # [E, T+1, N]
    target = counts[:, 1:]
    if circular is not None and len(circular):
        N = counts.shape[-1]
        table = np.zeros((N + 1, N), bool)
        table[circular[:, 0], circular[:, 1]] = True
        target = np.where(table[np.clip(data["actions"][episodes][..., 0], 0, N)], counts[:, :-1], target)
    t = Tensors(z_in=z[:, :-1], actions=torch.as_tensor(data["actions"][episodes].astype(np.int64)),
                z_next=z[:, 1:], deltas=torch.as_tensor(deltas, dtype=torch.float32),
                changed=torch.as_tensor((np.abs(raw).max(-1) > CHANGE_EPS).astype(np.float32)),
                done=torch.as_tensor(data["done"][episodes].astype(np.float32)),
                counts_in=torch.as_tensor(counts[:, :-1]), log_counts=torch.as_tensor(np.log1p(target)),
                mask=mask, index=np.asarray(episodes))
    return Tensors(*(getattr(t, f).to(device) for f in TENSOR_FIELDS), t.index)


def losses(model: MDNRNN | EnsembleMDNRNN, b: Tensors) -> dict[str, torch.Tensor]:
    """The loss terms of one batch (each masked to the real steps) and their sum under ``loss``; an ensemble's
    are its members' means (each member is trained on its own predictions)."""
    if isinstance(model, EnsembleMDNRNN):
        per = [_terms(out, b) for out in model.member_outputs(b.z_in, b.actions, b.counts_in)]
        return {k: torch.stack([t[k] for t in per]).mean() for k in LOSS_TERMS}
    return _terms(model(b.z_in, b.actions, b.counts_in), b)


def _terms(out, b: Tensors) -> dict[str, torch.Tensor]:
    terms = {"nll": gmm_loss(b.z_next, out.mus, out.sigmas, out.logpi, b.mask),
             "change_bce": masked_bce_with_logits(out.changed, b.changed, b.mask),
             "delta_mse": masked_mse(out.deltas, b.deltas, b.mask & b.changed.bool()),
             "done_bce": masked_bce_with_logits(out.done, b.done, b.mask),
             "count_mse": masked_mse(out.log_counts, b.log_counts, b.mask)}
    terms["loss"] = sum(terms[k] for k in LOSS_TERMS[1:])
    return terms


@torch.no_grad()
def mean_losses(model: MDNRNN, data: Tensors, batch_size: int) -> dict[str, float]:
    """Step-weighted means of the loss terms over a set of episodes (NaN when it has no steps)."""
    model.eval()
    sums = dict.fromkeys(LOSS_TERMS, 0.0)
    steps = 0
    for i in range(0, len(data), batch_size):
        b = data.batch(torch.arange(i, min(i + batch_size, len(data)), device=data.mask.device))
        n = int(b.mask.sum())
        if n == 0:
            continue
        for k, v in losses(model, b).items():
            sums[k] += float(v) * n
        steps += n
    return {k: (v / steps if steps else float("nan")) for k, v in sums.items()}


# -- evaluation ---------------------------------------------------------------------------------------------
def _pearson(a: np.ndarray, b: np.ndarray) -> float | None:
    if len(a) < 2 or a.std() == 0 or b.std() == 0:
        return None
    return float(np.corrcoef(a, b)[0, 1])


@torch.no_grad()
def evaluate(model: MDNRNN, data: dict, episodes: np.ndarray, device, batch_size: int = 64) -> dict[str, Any]:
    """Quality of the model on these episodes (normally the held-out ones).

    nll_per_dim / loglik_per_dim: the next-z mixture's log-likelihood per latent dimension (nats).
    reward_corr: Pearson correlation, over the real steps with a valid action, between the reward of the true
    transition (prev = metrics[t], cur = metrics[t+1]) and of the predicted one (prev = metrics[t], cur =
    prev + predicted delta, or prev itself where the model predicts no change), for the rewards ``weighted`` and
    ``delta`` (:mod:`rlflow.env.rewards`); reward_rmse: the root mean squared difference of the same rewards.
    unchanged_share: the share of those steps that changed no metric; change_accuracy: (changed logit > 0) ==
    the step changed a metric; false_change_rate: the share of the unchanged steps predicted to change.
    mask_accuracy: fraction of (step, rule) where (predicted count > 0.5) == (true count > 0);
    mask_recall: the same over the (step, rule) pairs with a true match; done_accuracy: (logit > 0) == done.
    """
    from rlflow.env.rewards import make_reward

    T = data["z"].shape[1] - 1
    t = make_tensors(data, episodes, model.delta_mean.cpu().numpy(), model.delta_std.cpu().numpy(), device)
    model.eval()
    nll_sum, steps = 0.0, 0
    pred_metrics, pred_counts, done_logits, changed_logits = [], [], [], []
    for i in range(0, len(t), batch_size):
        b = t.batch(torch.arange(i, min(i + batch_size, len(t)), device=t.mask.device))
        out = model(b.z_in, b.actions, b.counts_in)
        n = int(b.mask.sum())
        if n:
            nll_sum += float(gmm_loss(b.z_next, out.mus, out.sigmas, out.logpi, b.mask)) * n
            steps += n
        cur = torch.as_tensor(data["metrics"][b.index][:, :T], dtype=torch.float32, device=out.deltas.device)
        pred_metrics.append(model.metrics_after(cur, out.deltas, out.changed > 0).double().cpu().numpy())
        changed_logits.append(out.changed.cpu().numpy())
        pred_counts.append(MDNRNN.counts(out.log_counts).cpu().numpy())
        done_logits.append(out.done.cpu().numpy())
    result: dict[str, Any] = {"episodes": int(len(episodes)), "steps": int(steps)}
    if steps == 0:
        return result
    mask = t.mask.cpu().numpy()
    pm = np.concatenate(pred_metrics)[mask]                     # [S, 4] predicted metrics after each step
    metrics = data["metrics"][episodes].astype(np.float64)
    prev, true_cur = metrics[:, :T][mask], metrics[:, 1:][mask]
    first = np.repeat(metrics[:, :1], T, axis=1)[mask]
    valid = data["valid"][episodes][mask].astype(bool)
    corr, rmse = {}, {}
    for name in ("weighted", "delta"):
        reward = make_reward({"name": name})
        d = lambda row: dict(zip(METRIC_NAMES, row))  # noqa: E731
        r_true = np.array([reward(d(p), d(c), d(f)) for p, c, f, v in zip(prev, true_cur, first, valid) if v])
        r_pred = np.array([reward(d(p), d(c), d(f)) for p, c, f, v in zip(prev, pm, first, valid) if v])
        corr[name] = _pearson(r_true, r_pred)
        rmse[name] = float(np.sqrt(np.mean((r_true - r_pred) ** 2))) if len(r_true) else None
    changed_true = t.changed.cpu().numpy()[mask].astype(bool)
    changed_pred = np.concatenate(changed_logits)[mask] > 0
    pc = np.concatenate(pred_counts)[mask]
    tc = data["counts"][episodes][:, 1:][mask]
    hit = (pc > 0.5) == (tc > 0)
    done_pred = np.concatenate(done_logits)[mask] > 0
    done_true = data["done"][episodes][mask].astype(bool)
    result.update(
        nll_per_dim=nll_sum / steps, loglik_per_dim=-nll_sum / steps,
        reward_corr=corr, reward_rmse=rmse, reward_steps=int(valid.sum()),
        unchanged_share=float((~changed_true[valid]).mean()) if valid.any() else None,
        change_accuracy=float((changed_pred == changed_true).mean()),
        false_change_rate=float(changed_pred[~changed_true].mean()) if (~changed_true).any() else None,
        delta_rmse_ms=float(np.sqrt(np.mean((pm[valid, 0] - true_cur[valid, 0]) ** 2))) if valid.any() else None,
        mask_accuracy=float(hit.mean()),
        mask_recall=float(hit[tc > 0].mean()) if (tc > 0).any() else None,
        mask_precision=float((tc[pc > 0.5] > 0).mean()) if (pc > 0.5).any() else None,
        done_accuracy=float((done_pred == done_true).mean()),
    )
    return result


# -- training -----------------------------------------------------------------------------------------------
def poly_decay(total_steps: int, power: float = 2.0) -> Callable[[int], float]:
    """LambdaLR factor: (1 - step / total)^power, reaching 0 after the last step."""
    return lambda step: max(0.0, 1.0 - step / max(1, total_steps)) ** power


def curve_names() -> dict[str, str]:
    """Curve row keys -> dvclive metric names (``train_nll`` -> ``train/nll``, ``lr`` -> ``lr``)."""
    out = {"lr": "lr"}
    for part in ("train", "heldout"):
        out.update({f"{part}_{k}": f"{part}/{k}" for k in LOSS_TERMS})
    return out


def train(data: dict, wm: dict, seed: int, device: str, checkpointer=None, progress: bool = True,
          log: Callable[[str], None] | None = None, live=None) -> dict[str, Any]:
    """Train a world model with config ``wm`` (hidden, gaussians, epochs, lr, batch_size; ``ensemble`` members,
    default 1: an ensemble's members start from different random weights and are trained side by side on the
    same batches).

    Each epoch's row (the loss terms on the training and held-out episodes, the learning rate) also goes to
    ``live`` (a :class:`rlflow.agents.logging.TrainingLog`; a resumed run's saved rows first; NaN held-out
    terms, when there are no held-out episodes, are left out).
    Saves a partial state after every epoch with ``checkpointer`` (and resumes from one); returns
    ``{"model", "rows" (curve rows), "train_episodes", "heldout_episodes", "resumed_from" (epoch or None)}``.
    """
    E = data["z"].shape[0]
    holdout = data["holdout"].astype(bool)
    train_eps = np.flatnonzero(~holdout & (data["lengths"] > 0))
    held_eps = np.flatnonzero(holdout & (data["lengths"] > 0))
    if len(train_eps) == 0:
        raise RLFlowError(f"latents: none of the {E} episodes is a non-empty training episode (all held out?)")
    mean, std = delta_stats(data, train_eps)
    torch.manual_seed(seed)
    model = make_world_model(int(wm.get("ensemble", 1)), z_dim=data["z_dim"], n_xfers=data["n_xfers"],
                             max_locations=data["max_locations"], hidden=wm["hidden"], gaussians=wm["gaussians"])
    model.set_delta_norm(mean, std)
    uses, effects, circular = count_effects(data, train_eps)
    model.set_rule_priors(*rule_priors(data, train_eps, mean, std), uses, effects)
    model.to(device)
    tr = make_tensors(data, train_eps, mean, std, device, circular)
    ho = make_tensors(data, held_eps, mean, std, device, circular) if len(held_eps) else None
    bs = int(wm["batch_size"])
    epochs = int(wm["epochs"])
    per_epoch = math.ceil(len(train_eps) / bs)
    opt = torch.optim.Adam(model.parameters(), lr=float(wm["lr"]))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, poly_decay(epochs * per_epoch))
    rows: list[dict] = []
    start, resumed = 0, None
    if checkpointer is not None:
        state = checkpointer.load()
        if state is not None:
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["optim"])
            sched.load_state_dict(state["sched"])
            rows = list(state["rows"])
            start = resumed = int(state["epoch"])
            if log:
                log(f"resuming from epoch {start} of {epochs}")
    if live is not None:
        live.replay(rows, "epoch", curve_names())
    from tqdm import tqdm

    bar = tqdm(total=epochs, initial=start, desc="world model", unit="epoch", file=sys.stderr,
               mininterval=1.0, disable=None if progress else True)
    for epoch in range(start, epochs):
        t0 = time.perf_counter()
        model.train()
        gen = torch.Generator().manual_seed(seed * 100_003 + epoch)
        perm = torch.randperm(len(tr), generator=gen).to(tr.mask.device)
        sums, steps = dict.fromkeys(LOSS_TERMS, 0.0), 0
        lr = opt.param_groups[0]["lr"]
        for i in range(0, len(tr), bs):
            b = tr.batch(perm[i:i + bs])
            terms = losses(model, b)
            opt.zero_grad(set_to_none=True)
            terms["loss"].backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            opt.step()
            sched.step()
            n = int(b.mask.sum())
            for k, v in terms.items():
                sums[k] += float(v.detach()) * n
            steps += n
        row: dict[str, Any] = {"epoch": epoch + 1, "lr": lr}
        row.update({f"train_{k}": v / max(steps, 1) for k, v in sums.items()})
        held = mean_losses(model, ho, bs) if ho is not None else dict.fromkeys(LOSS_TERMS, float("nan"))
        row.update({f"heldout_{k}": v for k, v in held.items()})
        row["seconds"] = time.perf_counter() - t0
        rows.append(row)
        if live is not None:
            live.log_row(row, "epoch", curve_names())
        if checkpointer is not None:
            checkpointer.save({"epoch": epoch + 1, "model": model.state_dict(), "optim": opt.state_dict(),
                               "sched": sched.state_dict(), "rows": rows})
        bar.update(1)
        bar.set_postfix(train=f"{row['train_loss']:.3f}", heldout_nll=f"{row['heldout_nll']:.3f}")
    bar.close()
    return {"model": model, "rows": rows, "train_episodes": train_eps, "heldout_episodes": held_eps,
            "resumed_from": resumed}


def curve_csv(rows: list[dict]) -> str:
    lines = [",".join(CURVE_COLUMNS)]
    for r in rows:
        cells = []
        for c in CURVE_COLUMNS:
            v = r.get(c)
            cells.append("" if v is None or (isinstance(v, float) and math.isnan(v)) else
                         (str(v) if isinstance(v, int) else f"{v:.6g}"))
        lines.append(",".join(cells))
    return "\n".join(lines) + "\n"


def load_world_model(path: str | Path, device="cpu") -> MDNRNN | EnsembleMDNRNN:
    """The trained model of a ``train_world_model`` checkpoint (eval mode)."""
    from rlflow.agents.checkpoint import load_checkpoint

    ck = load_checkpoint(path)
    if "model_args" not in ck or "state_dict" not in ck:
        raise RLFlowError(f"{path}: not a world-model checkpoint")
    model = make_world_model(**ck["model_args"])
    load_world_model_state(model, ck["state_dict"], str(path))
    return model.to(device).eval()
