"""The MDN-RNN world model: its losses, the model, training on synthetic latents, and the stage."""

from __future__ import annotations

import csv
import json
import math

import numpy as np
import pytest
import torch

from rlflow.nn.losses import gmm_loss, masked_bce_with_logits, masked_mse
from rlflow.nn.mdnrnn import MDNRNN


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models: one thread is fastest and does not fight other processes for the cores."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def synthetic_latents(path, episodes=40, steps=8, n_xfers=4, max_locations=3, z_dim=6, seed=0, holdout=0.25,
                      neutral=()):
    """A latents file with deterministic dynamics: z' = 0.7 z + 0.6 B[xfer] + 0.1 loc; rule k matches the graph
    iff z_(k mod Z) > 0 (< 0 for odd k div Z), count 1 or 2; applying a matching rule scales the runtime by
    0.9 + 0.02 (k mod 5) and the bytes by 0.95, except the rules in ``neutral``, which change the graph but no
    metric (a commutativity swap); a rule that does not match is invalid (graph unchanged); xfer == n_xfers is
    the NO-OP (done)."""
    rng = np.random.default_rng(seed)
    B = rng.normal(0, 0.8, (n_xfers + 1, z_dim))
    T, N = steps, n_xfers
    z = np.zeros((episodes, T + 1, z_dim), np.float32)
    actions = np.full((episodes, T, 2), -1, np.int32)
    metrics = np.zeros((episodes, T + 1, 4))
    counts = np.zeros((episodes, T + 1, N), np.int32)
    done = np.zeros((episodes, T), bool)
    valid = np.zeros((episodes, T), bool)
    lengths = np.zeros(episodes, np.int32)

    def count(zz):
        k = np.arange(N)
        sign = np.where((k // z_dim) % 2 == 0, 1.0, -1.0)
        return np.where(sign * zz[k % z_dim] > 0, 1 + k % 2, 0).astype(np.int32)

    for e in range(episodes):
        zt = rng.normal(0, 1, z_dim)
        m = np.array([10.0 + rng.random(), 1e6, 4e6, 20.0])
        z[e, 0], metrics[e, 0], counts[e, 0] = zt, m, count(zt)
        t = 0
        while t < T:
            c = count(zt)
            xfer = N if rng.random() < 0.12 else int(rng.integers(0, N))
            loc = int(rng.integers(0, max(1, min(c[xfer], max_locations)))) if xfer < N else 0
            actions[e, t] = (xfer, loc)
            ok = xfer == N or c[xfer] > 0
            valid[e, t] = ok
            if xfer < N and ok:
                zt = 0.7 * zt + 0.6 * B[xfer] + 0.1 * loc
                if xfer not in neutral:
                    m = m * np.array([0.9 + 0.02 * (xfer % 5), 1.0, 0.95, 1.0])
            t += 1
            z[e, t], metrics[e, t], counts[e, t] = zt, m, count(zt)
            if xfer == N or t == T:
                done[e, t - 1] = True
                break
        lengths[e] = t
        metrics[e, t + 1:] = metrics[e, t]
    hold = np.zeros(episodes, bool)
    hold[: int(round(holdout * episodes))] = True
    np.savez(path, z=z, lengths=lengths, actions=actions, metrics=metrics, counts=counts, done=done, valid=valid,
             holdout=hold, n_xfers=np.int64(N), max_locations=np.int64(max_locations), z_dim=np.int64(z_dim))
    return path


# -- losses -------------------------------------------------------------------------------------------------
def test_gmm_loss_matches_hand_computation():
    # one step, Z = 2, K = 2: NLL = -log sum_k pi_k prod_z N(x_z; mu_kz, s_kz), divided by Z
    x = torch.tensor([[[0.5, -1.0]]])
    mus = torch.tensor([[[[0.0, 0.0], [1.0, -2.0]]]])
    sig = torch.tensor([[[[1.0, 2.0], [0.5, 1.0]]]])
    pi = torch.tensor([0.3, 0.7])

    def normal(v, m, s):
        return math.exp(-0.5 * ((v - m) / s) ** 2) / (s * math.sqrt(2 * math.pi))

    p = sum(float(pi[k]) * normal(0.5, float(mus[0, 0, k, 0]), float(sig[0, 0, k, 0]))
            * normal(-1.0, float(mus[0, 0, k, 1]), float(sig[0, 0, k, 1])) for k in range(2))
    got = gmm_loss(x, mus, sig, pi.log().view(1, 1, 2))
    assert got.item() == pytest.approx(-math.log(p) / 2, rel=1e-5)


def test_gmm_loss_fit_recovers_a_known_mixture():
    g = torch.Generator().manual_seed(0)
    n = 800
    comp = torch.rand(n, generator=g) < 0.3                   # weight 0.3 at -2, 0.7 at +3 (sigma 0.5)
    x = torch.where(comp, torch.tensor(-2.0), torch.tensor(3.0)) + 0.5 * torch.randn(n, generator=g)
    target = x.view(1, n, 1)
    mu = torch.tensor([[-0.5], [0.5]], requires_grad=True)     # [K, Z]
    log_s = torch.zeros(2, 1, requires_grad=True)
    logits = torch.zeros(2, requires_grad=True)
    opt = torch.optim.Adam([mu, log_s, logits], lr=0.1)
    for _ in range(250):
        loss = gmm_loss(target, mu.expand(1, n, 2, 1), log_s.exp().expand(1, n, 2, 1),
                        torch.log_softmax(logits, 0).expand(1, n, 2))
        opt.zero_grad()
        loss.backward()
        opt.step()
    order = torch.argsort(mu[:, 0])
    assert mu[order, 0].tolist() == pytest.approx([-2.0, 3.0], abs=0.1)
    assert torch.softmax(logits, 0)[order].tolist() == pytest.approx([0.3, 0.7], abs=0.03)
    assert log_s.exp()[order, 0].tolist() == pytest.approx([0.5, 0.5], abs=0.05)


def _random_batch(seed=0, B=3, T=5, K=2, Z=3, N=4):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=torch.bool)[:B, :T]
    return mask, r


def test_padding_changes_neither_losses_nor_gradients():
    mask, r = _random_batch()
    model = MDNRNN(3, 4, 3, hidden=8, gaussians=2)
    z = r(3, 5, 3)
    actions = torch.randint(0, 4, (3, 5, 2))
    tz, td, tc = r(3, 5, 3), (r(3, 5) > 0).float(), r(3, 5, 4)
    counts = torch.randint(0, 5, (3, 5, 4)).float()

    def run(z, actions, tz, td, tc):
        model.zero_grad()
        out = model(z, actions, counts)
        loss = (gmm_loss(tz, out.mus, out.sigmas, out.logpi, mask) + masked_mse(out.log_counts, tc, mask)
                + masked_bce_with_logits(out.done, td, mask))
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    l1, g1 = run(z, actions, tz, td, tc)
    pad = ~mask
    z2, a2, tz2, td2, tc2 = z.clone(), actions.clone(), tz.clone(), td.clone(), tc.clone()
    z2[pad] = 1e3
    a2[pad] = -1
    tz2[pad] = float("nan")
    td2[pad] = 1 - td2[pad]
    tc2[pad] = float("inf")
    l2, g2 = run(z2, a2, tz2, td2, tc2)
    assert torch.equal(l1, l2)
    for a, b in zip(g1, g2):
        assert torch.allclose(a, b, atol=1e-6)
    # and an all-padding batch is a zero loss
    assert gmm_loss(tz, *model(z, actions, counts)[:3], torch.zeros(3, 5, dtype=torch.bool)).item() == 0.0


PREDICTIONS = ("mus", "sigmas", "logpi", "deltas", "changed", "done", "log_counts")


@pytest.mark.parametrize("members", [1, 3])
def test_sequence_forward_equals_one_step_cell(members):
    from rlflow.nn.mdnrnn import make_world_model

    torch.manual_seed(0)
    model = make_world_model(members, z_dim=5, n_xfers=3, max_locations=4, hidden=16, gaussians=3).eval()
    z = torch.randn(2, 6, 5)
    actions = torch.stack([torch.randint(0, 4, (2, 6)), torch.randint(0, 4, (2, 6))], -1)
    counts = torch.randint(0, 9, (2, 6, 3)).float()
    seq = model(z, actions, counts)
    hidden = None
    for t in range(6):
        one = model.step(z[:, t], actions[:, t], counts[:, t], hidden)
        hidden = one.hidden
        for name in PREDICTIONS:
            assert torch.allclose(getattr(seq, name)[:, t], getattr(one, name), atol=1e-5), name
    assert torch.allclose(seq.hidden[0], hidden[0], atol=1e-5)
    assert hidden[0].shape == (1, 2, 16 * members) and seq.mus.shape[-2] == 3 * members
    sample = model.sample_z(one)
    assert sample.shape == (2, 5) and torch.isfinite(sample).all()


def test_an_ensemble_is_its_members_combined():
    """The next-z density is the uniform mixture of the members' mixtures; deltas their mean; each member's own
    predictions are kept for the disagreement."""
    from rlflow.nn.losses import gmm_log_prob
    from rlflow.nn.mdnrnn import EnsembleMDNRNN

    torch.manual_seed(1)
    ens = EnsembleMDNRNN(3, z_dim=4, n_xfers=3, max_locations=2, hidden=8, gaussians=2).eval()
    z, target = torch.randn(2, 5, 4), torch.randn(2, 5, 4)
    actions = torch.stack([torch.randint(0, 4, (2, 5)), torch.randint(0, 2, (2, 5))], -1)
    counts = torch.randint(0, 3, (2, 5, 3)).float()
    out, members = ens(z, actions, counts), ens.member_outputs(z, actions, counts)
    mixture = torch.logsumexp(torch.stack([gmm_log_prob(target, *m[:3]) for m in members]), 0) - math.log(3)
    assert torch.allclose(gmm_log_prob(target, *out[:3]), mixture, atol=1e-5)
    assert torch.allclose(out.deltas, torch.stack([m.deltas for m in members]).mean(0), atol=1e-6)
    assert torch.equal(out.member_deltas[..., 1, :], members[1].deltas)
    p = torch.stack([torch.sigmoid(m.changed) for m in members]).mean(0)
    assert torch.allclose(torch.sigmoid(out.changed), p, atol=1e-5)
    ens.set_delta_norm(torch.ones(4), 2 * torch.ones(4))
    assert all(torch.equal(m.delta_std, 2 * torch.ones(4)) for m in ens.members)


# -- training -----------------------------------------------------------------------------------------------
def test_training_lowers_heldout_nll(tmp_path):
    from rlflow.agents.world_model import evaluate, load_latents, train

    data = load_latents(synthetic_latents(tmp_path / "l.npz", episodes=64))
    wm = {"hidden": 24, "gaussians": 2, "epochs": 12, "lr": 1e-2, "batch_size": 8}
    res = train(data, wm, seed=0, device="cpu", progress=False)
    rows = res["rows"]
    assert len(rows) == 12
    assert rows[-1]["heldout_nll"] < rows[0]["heldout_nll"] - 0.15
    assert rows[-1]["train_loss"] < rows[0]["train_loss"]
    q = evaluate(res["model"], data, res["heldout_episodes"], "cpu")
    assert q["steps"] > 0 and q["mask_accuracy"] > 0.7 and q["done_accuracy"] > 0.7
    assert q["reward_corr"]["delta"] is not None


def test_a_step_that_changes_nothing_is_its_own_output(tmp_path):
    """Zero-inflated deltas: the model learns which steps change no metric (here rule 1, a cost-neutral swap,
    besides invalid steps and the NO-OP), predicts exactly no change for them -- so no reward in the dream --
    and its delta head is trained on the steps that change the metrics only."""
    from rlflow.agents.world_model import CHANGE_EPS, evaluate, load_latents, log_deltas, make_tensors, train

    data = load_latents(synthetic_latents(tmp_path / "l.npz", episodes=96, neutral=(1,)))
    raw = log_deltas(data["metrics"])
    neutral = (data["actions"][..., 0] == 1) & data["valid"]
    assert neutral.any() and (np.abs(raw[neutral]).max(-1) <= CHANGE_EPS).all()
    res = train(data, {"hidden": 24, "gaussians": 2, "epochs": 25, "lr": 1e-2, "batch_size": 8}, seed=0,
                device="cpu", progress=False)
    q = evaluate(res["model"], data, res["heldout_episodes"], "cpu")
    assert 0.2 < q["unchanged_share"] < 0.8
    # better than calling every step a change (accuracy 1 - unchanged_share); few unchanged steps called changed
    assert q["change_accuracy"] > 1 - q["unchanged_share"] + 0.05 and q["false_change_rate"] < 0.2
    # the held-out neutral steps: predicted unchanged, so the predicted metrics are the current ones exactly
    model = res["model"]
    t = make_tensors(data, res["heldout_episodes"], model.delta_mean.numpy(), model.delta_std.numpy(), "cpu")
    with torch.no_grad():
        out = model(t.z_in, t.actions, t.counts_in)
    sel = t.mask & (t.actions[..., 0] == 1) & torch.as_tensor(data["valid"][res["heldout_episodes"]])
    assert int(sel.sum()) > 0
    assert (out.changed[sel] < 0).float().mean() > 0.85
    cur = torch.as_tensor(data["metrics"][res["heldout_episodes"]][:, :-1], dtype=torch.float32)
    after = model.metrics_after(cur, out.deltas, out.changed > 0)
    kept = sel & (out.changed < 0)
    assert torch.equal(after[kept], cur[kept])


def test_rule_priors_are_the_datas_per_rule_change_rates_and_deltas(tmp_path):
    """Each rule's share of steps that changed the metrics (smoothed by PRIOR_STEPS towards the overall rate) and
    its mean normalised delta over those steps (shrunk towards 0): what the per-rule terms start from."""
    from rlflow.agents.world_model import PRIOR_STEPS, delta_stats, load_latents, log_deltas, rule_priors

    data = load_latents(synthetic_latents(tmp_path / "l.npz", episodes=40, neutral=(1,)))
    eps = np.arange(40)
    mean, std = delta_stats(data, eps)
    logit, deltas = rule_priors(data, eps, mean, std)
    assert logit.shape == (5,) and deltas.shape == (5, 4)
    T = data["z"].shape[1] - 1
    m = np.arange(T)[None, :] < data["lengths"][:, None]
    xfer, raw = data["actions"][..., 0][m], log_deltas(data["metrics"])[m]
    changed = np.abs(raw).max(-1) > 1e-9
    rate = changed.mean()
    for k in range(4):
        n, c = (xfer == k).sum(), (changed & (xfer == k)).sum()
        p = np.clip((c + PRIOR_STEPS * rate) / (n + PRIOR_STEPS), 1e-4, 1 - 1e-4)
        assert logit[k] == pytest.approx(np.log(p / (1 - p)))
        want = ((raw[changed & (xfer == k)] - mean) / std).sum(0) / (c + PRIOR_STEPS)
        np.testing.assert_allclose(deltas[k], want, atol=1e-9)
    assert logit[1] < -2 and deltas[1].tolist() == [0, 0, 0, 0]  # the neutral swap: never a change
    # the own count's mean change over the rule's valid steps (the counts capped at max_locations), shrunk
    from rlflow.agents.world_model import count_effects

    uses = count_effects(data, eps)[0]
    e, t = np.nonzero(m)
    counts = np.minimum(data["counts"], int(data["max_locations"]))
    for k in range(4):
        sel = (data["actions"][e, t, 0] == k) & data["valid"][e, t]
        d = counts[e[sel], t[sel] + 1, k] - counts[e[sel], t[sel], k]
        assert uses[k] == pytest.approx(d.sum() / (sel.sum() + PRIOR_STEPS))
    assert uses[4] == 0  # the NO-OP has no count


def test_per_rule_terms_learn_a_neutral_rule_at_once(tmp_path):
    """With the per-rule terms started at the data's statistics, a world model after ONE epoch at a tiny learning
    rate already predicts no change for the cost-neutral rule (the LSTM and heads alone, so briefly trained,
    could not: their logits stay near 0, and the dream paid for neutral swaps)."""
    from rlflow.agents.world_model import load_latents, make_tensors, train

    data = load_latents(synthetic_latents(tmp_path / "l.npz", episodes=96, neutral=(1,)))
    res = train(data, {"hidden": 24, "gaussians": 2, "epochs": 1, "lr": 1e-5, "batch_size": 8}, seed=0,
                device="cpu", progress=False)
    model = res["model"]
    t = make_tensors(data, res["heldout_episodes"], model.delta_mean.numpy(), model.delta_std.numpy(), "cpu")
    with torch.no_grad():
        out = model(t.z_in, t.actions, t.counts_in)
    valid = torch.as_tensor(data["valid"][res["heldout_episodes"]])
    sel = t.mask & (t.actions[..., 0] == 1) & valid
    assert int(sel.sum()) > 0 and (torch.sigmoid(out.changed[sel]) < 0.1).all()
    moved = t.mask & t.changed.bool()
    assert torch.sigmoid(out.changed[moved]).mean() > torch.sigmoid(out.changed[sel]).mean() + 0.2


def test_delta_loss_ignores_steps_that_change_nothing(tmp_path):
    from rlflow.agents.world_model import load_latents, losses, make_tensors

    data = load_latents(synthetic_latents(tmp_path / "l.npz", episodes=8))
    model = MDNRNN(6, 4, 3, hidden=8, gaussians=2)
    t = make_tensors(data, np.arange(8), np.zeros(4), np.ones(4), "cpu")
    base = losses(model, t)
    t.deltas[~t.changed.bool()] = 1e6  # garbage where nothing changed: must not matter
    assert torch.isclose(losses(model, t)["delta_mse"], base["delta_mse"])
    assert base["change_bce"] > 0 and torch.isclose(base["loss"], sum(base[k] for k in
                                                                      ("nll", "change_bce", "delta_mse", "done_bce",
                                                                       "count_mse")))


def _stage_args(tmp_path, latents, extra=()):
    out = tmp_path / "wm"
    return out, ["train-world-model", "--set", "world_model.hidden=16", "--set", "world_model.gaussians=2",
                 "--set", "world_model.batch_size=8", "--set", "device=cpu", *extra, "--model", "toy",
                 "--latents", str(latents), "--out", str(out / "world_model.pt"),
                 "--metrics", str(out / "metrics.json"), "--curve", str(out / "loss.csv"), "--no-progress"]


@pytest.mark.parametrize("members", [1, 2])
def test_stage_end_to_end(tmp_path, members):
    from rlflow.agents.world_model import load_world_model
    from rlflow.cli import main
    from rlflow.nn.mdnrnn import EnsembleMDNRNN

    lat = synthetic_latents(tmp_path / "l.npz", episodes=16)
    out, argv = _stage_args(tmp_path, lat, ["--set", "world_model.epochs=3", "--set",
                                            f"world_model.ensemble={members}"])
    assert main(argv) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["epochs"] == 3 and metrics["heldout_episodes"] == 4 and metrics["evaluated_on"] == "heldout"
    for key in ("loglik_per_dim", "reward_corr", "mask_accuracy", "mask_recall", "done_accuracy"):
        assert key in metrics
    rows = list(csv.DictReader((out / "loss.csv").open()))
    assert [r["epoch"] for r in rows] == ["1", "2", "3"]
    assert {"train_loss", "train_nll", "heldout_nll"} <= set(rows[0])
    model = load_world_model(out / "world_model.pt")
    assert model.config["hidden"] == 16 and not (out / "world_model.pt.partial").exists()
    assert isinstance(model, EnsembleMDNRNN) == (members > 1)
    if members > 1:  # differently initialised members stay different after training
        a, b = (m.delta_head.weight for m in model.members)
        assert not torch.allclose(a, b)


def test_stage_resumes_after_kill(tmp_path, monkeypatch):
    import rlflow.agents.world_model as wmod
    from rlflow.agents.checkpoint import load_checkpoint
    from rlflow.cli import main

    lat = synthetic_latents(tmp_path / "l.npz", episodes=12)
    out, argv = _stage_args(tmp_path, lat, ["--set", "world_model.epochs=3"])

    class Killed(KeyboardInterrupt):
        pass

    real = wmod.mean_losses
    calls = {"n": 0}

    def dying(*a, **k):   # held-out evaluation of epoch 2 is "killed" (after epoch 1's partial was saved)
        calls["n"] += 1
        if calls["n"] == 2:
            raise Killed()
        return real(*a, **k)

    monkeypatch.setattr(wmod, "mean_losses", dying)
    assert main(argv) == 130
    partial = out / "world_model.pt.partial"
    assert partial.is_file() and not (out / "world_model.pt").exists()
    assert torch.load(partial, weights_only=True)["epoch"] == 1
    monkeypatch.setattr(wmod, "mean_losses", real)
    assert main(argv) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["resumed_from_epoch"] == 1 and metrics["epochs"] == 3
    assert not partial.exists()
    ck = load_checkpoint(out / "world_model.pt")
    assert ck["z_dim"] == 6 and ck["n_xfers"] == 4 and ck["max_locations"] == 3 and "delta_norm" in ck


@pytest.mark.parametrize("damage", ["missing", "garbage", "no_z", "bad_shape"])
def test_malformed_latents_exit_2(tmp_path, capsys, damage):
    from rlflow.cli import main

    lat = tmp_path / "l.npz"
    if damage == "garbage":
        lat.write_bytes(b"not an npz")
    elif damage in ("no_z", "bad_shape"):
        synthetic_latents(lat, episodes=4)
        d = dict(np.load(lat))
        if damage == "no_z":
            del d["z"]
        else:
            d["counts"] = d["counts"][:, :, :2]
        np.savez(lat, **d)
    out, argv = _stage_args(tmp_path, lat, ["--set", "world_model.epochs=1"])
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("rlflow: error:")
    assert not out.exists()


def test_delta_normalisation_round_trips(tmp_path):
    from rlflow.agents.world_model import delta_stats, load_latents, make_tensors

    data = load_latents(synthetic_latents(tmp_path / "l.npz", episodes=10))
    eps = np.arange(10)
    mean, std = delta_stats(data, eps)
    t = make_tensors(data, eps, mean, std, "cpu")
    model = MDNRNN(6, 4, 3, hidden=8, gaussians=2)
    model.delta_mean.copy_(torch.as_tensor(mean, dtype=torch.float32))
    model.delta_std.copy_(torch.as_tensor(std, dtype=torch.float32))
    prev = torch.as_tensor(data["metrics"][:, :-1], dtype=torch.float64)
    back = model.double().metrics_after(prev, t.deltas.double())
    true = torch.as_tensor(data["metrics"][:, 1:])
    assert torch.allclose(back[t.mask], true[t.mask], rtol=1e-5)


# -- counts: predicted as a change of the current graph's ------------------------------------------------------
def test_an_untrained_world_model_predicts_the_counts_unchanged():
    """The count head starts at zero: every rule keeps its current count (capped at max_locations, as the masks
    are); a rule without a match stays without one."""
    from rlflow.nn.mdnrnn import make_world_model

    torch.manual_seed(0)
    for members in (1, 2):
        model = make_world_model(members, z_dim=3, n_xfers=4, max_locations=200, hidden=8, gaussians=2)
        counts = torch.tensor([[0.0, 1.0, 5.0, 250.0]])
        out = model.step(torch.randn(1, 3), torch.tensor([[1, 0]]), counts)
        assert torch.round(model.counts(out.log_counts)).tolist() == [[0.0, 1.0, 5.0, 200.0]]


def _consuming_latents(path, episodes=80, steps=10, seed=0):
    """Latents where rule 0 uses up one of its matches per step (1..6 at the start), rule 1 (always 3 matches)
    changes nothing, and z is noise that says nothing about the counts: only the current counts tell how many
    matches of rule 0 are left."""
    rng = np.random.default_rng(seed)
    N, Z, L, T = 2, 4, 8, steps
    z = rng.normal(0, 1, (episodes, T + 1, Z)).astype(np.float32)
    actions = np.full((episodes, T, 2), -1, np.int32)
    counts = np.zeros((episodes, T + 1, N), np.int32)
    metrics = np.tile(np.array([10.0, 1e6, 4e6, 20.0]), (episodes, T + 1, 1))
    done, valid = np.zeros((episodes, T), bool), np.zeros((episodes, T), bool)
    for e in range(episodes):
        left = int(rng.integers(1, 7))
        counts[e, 0] = (left, 3)
        for t in range(T):
            xfer = 0 if left and rng.random() < 0.6 else 1
            actions[e, t], valid[e, t] = (xfer, 0), True
            if xfer == 0:
                left -= 1
                metrics[e, t + 1:, 0] *= 0.95
            counts[e, t + 1] = (left, 3)
        done[e, T - 1] = True
    hold = np.zeros(episodes, bool)
    hold[: episodes // 4] = True
    np.savez(path, z=z, lengths=np.full(episodes, T, np.int32), actions=actions, metrics=metrics, counts=counts,
             done=done, valid=valid, holdout=hold, n_xfers=np.int64(N), max_locations=np.int64(L), z_dim=np.int64(Z))
    return path


def test_a_rule_whose_matches_are_used_up_leaves_the_dream(tmp_path):
    """The dream's counts follow the actions taken: a rule with 5 matches left is masked after 5 uses, wherever its
    count started in training (predicted outright from z and the LSTM's history, the counts could not know it, and
    in the dream BERT's MatMul merges never ran out)."""
    from rlflow.agents.world_model import evaluate, load_latents, train
    from rlflow.env.dream import DreamEnv
    from rlflow.env.rewards import make_reward

    data = load_latents(_consuming_latents(tmp_path / "l.npz"))
    res = train(data, {"hidden": 16, "gaussians": 2, "epochs": 20, "lr": 1e-2, "batch_size": 8}, seed=0,
                device="cpu", progress=False)
    model = res["model"].eval()
    assert evaluate(model, data, res["heldout_episodes"], "cpu")["mask_accuracy"] > 0.97
    for left in (5, 2):
        dream = DreamEnv(model, torch.zeros(4), torch.tensor([10.0, 1e6, 4e6, 20.0]), torch.tensor([left, 3.0]),
                         make_reward("delta"), max_steps=10, max_locations=8, num_envs=4,
                         generator=torch.Generator().manual_seed(0))
        obs, offered = dream.reset(), []
        for _ in range(left + 1):
            offered.append(bool(obs["xfer_mask"][0, 0]))
            obs, _, _ = dream.step_batch(torch.zeros(4, dtype=torch.long), torch.zeros(4, dtype=torch.long))
        assert offered == [True] * left + [False], left
        assert obs["xfer_mask"][:, 1].all()  # the neutral rule's 3 matches stay


def _effects_data(steps, runtime=None):
    """A latents dict (no z needed) of one episode per list in ``steps``: (rule applied, counts after), 4 rules,
    all starting at counts (3, 3, 0, 0); ``runtime`` {rule: factor}: applying the rule multiplies the runtime by
    it (other rules leave every metric as it was)."""
    E, T, N = len(steps), max(map(len, steps)), 4
    actions = np.full((E, T, 2), -1, np.int64)
    counts = np.zeros((E, T + 1, N), np.int64)
    valid = np.zeros((E, T), bool)
    metrics = np.ones((E, T + 1, 4))
    for e, ep in enumerate(steps):
        counts[e, 0] = (3, 3, 0, 0)
        for t, (k, after) in enumerate(ep):
            actions[e, t], valid[e, t], counts[e, t + 1] = (k, 0), True, after
            metrics[e, t + 1:, 0] *= (runtime or {}).get(k, 1.0)
        counts[e, len(ep) + 1:] = counts[e, len(ep)]
    return {"z": np.zeros((E, T + 1, 1)), "lengths": np.array([len(x) for x in steps]), "actions": actions,
            "counts": counts, "valid": valid, "metrics": metrics, "done": np.zeros((E, T), bool),
            "n_xfers": N, "max_locations": 8}


def test_count_effects_keep_decreases_and_one_way_raises_not_circular_ones():
    """Rules 0 and 1 are two merges of the same pairs (each uses up one of its own and one of the other's
    matches; they lower the runtime); rule 0 also opens a fold (rule 2, one-way); rule 3 is an un-merge that
    raises rule 0 (and the runtime), and rule 0 raises rule 3: a circle, left out."""
    from rlflow.agents.world_model import PRIOR_STEPS, count_effects

    ep = [(0, (2, 2, 1, 1)), (1, (1, 1, 1, 1)), (3, (2, 1, 1, 0))]
    data = _effects_data([ep, ep[:2]], runtime={0: 0.9, 1: 0.9, 3: 1.1})
    uses, effects, circular = count_effects(data, np.arange(2))
    # applications: rule 0 twice, rule 1 twice, rule 3 once
    assert uses.tolist() == pytest.approx([-2 / (2 + PRIOR_STEPS), -2 / (2 + PRIOR_STEPS), 0, -1 / (1 + PRIOR_STEPS), 0])
    got = {(int(k), int(j)): v for k, j, v, _ in effects}
    assert got == pytest.approx({(0, 1): -2 / (2 + PRIOR_STEPS),      # a merge uses up the other merge's match
                                 (1, 0): -2 / (2 + PRIOR_STEPS),
                                 (0, 2): 2 / (2 + PRIOR_STEPS)})      # and opens the fold: one-way, kept
    # the fold was at 0 both times rule 0 opened it: the raise applies from 0 too; a decrease never does
    at_zero = {(int(k), int(j)): v for k, j, _, v in effects}
    assert at_zero == pytest.approx({(0, 1): 0, (1, 0): 0, (0, 2): 2 / (2 + PRIOR_STEPS)})
    # 0 -> 3 (merge raises its un-merge, 2/3) and 3 -> 0 (un-merge raises the merge, 1/2): a circle, both out
    assert (0, 3) not in got and (3, 0) not in got and sorted(map(tuple, circular.tolist())) == [(0, 3), (3, 0)]
    # and the world model is not taught them: where rule 0 is applied, rule 3's target count stays as it was
    from rlflow.agents.world_model import make_tensors

    t = make_tensors(data, np.arange(2), np.zeros(4), np.ones(4), "cpu", circular)
    assert torch.expm1(t.log_counts[0, :, 3]).round().tolist() == [0, 1, 0]  # real 1, 1, 0
    assert torch.expm1(t.log_counts[0, :, 0]).round().tolist() == [2, 1, 1]  # real 2, 1, 2 (the un-merge raises it)
    assert torch.expm1(t.log_counts[0, :, 2]).round().tolist() == [1, 1, 1]  # the one-way raise: taught


@pytest.mark.parametrize("rule_0_runtime, rule_3_runtime, kept", [(0.9, 1.0, True), (0.9, 0.9, True),
                                                                   (0.9, 1.1, False), (1.0, 1.0, False)])
def test_count_effects_keep_a_circle_that_only_goes_down(rule_0_runtime, rule_3_runtime, kept):
    """A scale that moves into a MatMul (rule 0: lowers the runtime) opens its move through the head split
    (rule 3: no change), which opens the move into the MatMul again: a circle, but one in which no step raises
    the runtime -- the way to the fold into the weight. Its raises stay in the table (and in the targets). With a
    rule in it that raises the runtime (as an un-merge), or with no rule that lowers it (as Mul <-> ScalarMul),
    they are left out."""
    from rlflow.agents.world_model import PRIOR_STEPS, count_effects

    ep = [(0, (2, 3, 0, 1)), (3, (3, 3, 0, 0))]
    data = _effects_data([ep, ep], runtime={0: rule_0_runtime, 3: rule_3_runtime})
    _, effects, circular = count_effects(data, np.arange(2))
    got = {(int(k), int(j)): v for k, j, v, _ in effects}
    if kept:
        assert got == pytest.approx({(0, 3): 2 / (2 + PRIOR_STEPS), (3, 0): 2 / (2 + PRIOR_STEPS)})
        assert len(circular) == 0
        # rule 3 only ever raised rule 0 from 2: where rule 0 is at 0 the raise does not apply
        assert {(int(k), int(j)): v for k, j, _, v in effects} == pytest.approx({(0, 3): 2 / (2 + PRIOR_STEPS),
                                                                               (3, 0): 0})
    else:
        assert got == {} and sorted(map(tuple, circular.tolist())) == [(0, 3), (3, 0)]


def test_a_circle_that_goes_down_does_not_reopen_its_way_in():
    """The attention scale's circle: moving it into the MatMul (rule 0, which the first graph offers 3 times;
    lowers the runtime) opens the move through the head split (rule 3) from 0, and that opens rule 0 again, even
    from 0 in the data. In the dream the second raise pumped the circle (into the MatMul, through the split,
    into the MatMul again, paid every time). So where the raised rule is one the first graph had matches of
    (the way in), the raise only adds to a count above 0; the way down (rule 0 opening rule 3) still opens
    from 0."""
    from rlflow.agents.world_model import PRIOR_STEPS, count_effects

    ep = [(0, (2, 3, 0, 1)), (0, (1, 3, 0, 2)), (0, (0, 3, 0, 3)), (3, (1, 3, 0, 2))]
    data = _effects_data([ep, ep], runtime={0: 0.9})
    _, effects, circular = count_effects(data, np.arange(2))
    assert len(circular) == 0  # a circle that goes down: kept
    got = {(int(k), int(j)): (v, z) for k, j, v, z in effects}
    assert got[(0, 3)] == pytest.approx((6 / (6 + PRIOR_STEPS), 6 / (6 + PRIOR_STEPS)))  # opens from 0
    assert got[(3, 0)] == pytest.approx((2 / (2 + PRIOR_STEPS), 0.0))  # seen from 0 twice, but the way in


def test_a_raise_never_seen_from_zero_does_not_open_a_used_up_rule():
    """bert's attention scale moved off the Q/K input makes a merge possible again (+0.61 on average), but the
    rollouts never moved it once the merges were all made. A raise whose 4th column (the change where j's count
    is 0) is 0 adds to a count above 0 and leaves a count at 0 alone; a 3-column table (older checkpoints)
    applies it everywhere."""
    from rlflow.nn.mdnrnn import MDNRNN

    torch.manual_seed(0)
    for effects, from_zero in (([[0, 2, 1.0, 0.0]], 0.0), ([[0, 2, 1.0]], 1.0)):
        m = MDNRNN(3, 4, 8, hidden=8, gaussians=2).eval()
        m.set_rule_priors(np.zeros(5), np.zeros((5, 4)), -np.ones(5), np.array(effects))
        for c2, want in ((0.0, from_zero), (1.0, 2.0)):
            out = m.step(torch.zeros(1, 3), torch.tensor([[0, 0]]), torch.tensor([[2.0, 3.0, c2, 1.0]]))
            assert float(torch.round(m.counts(out.log_counts))[0, 2]) == want


@pytest.mark.parametrize("members", [1, 2])
def test_count_effects_survive_a_checkpoint(tmp_path, members):
    """The effects table has as many rows as the data gave: a fresh model (no rows) loads a saved one's."""
    from rlflow.agents.world_model import load_world_model
    from rlflow.nn.mdnrnn import make_world_model

    torch.manual_seed(0)
    args = dict(z_dim=3, n_xfers=4, max_locations=8, hidden=8, gaussians=2)
    model = make_world_model(members, **args)
    model.set_rule_priors(np.zeros(5), np.zeros((5, 4)), -np.ones(5), np.array([[0, 1, -1.0], [0, 2, 1.0]]))
    path = tmp_path / "wm.pt"
    torch.save({"model_args": {**args, "members": members}, "state_dict": model.state_dict()}, path)
    loaded = load_world_model(path)
    counts = torch.tensor([[2.0, 3.0, 0.0, 1.0]])
    for m in (model.eval(), loaded):
        out = m.step(torch.zeros(1, 3), torch.tensor([[0, 0]]), counts)
        assert torch.round(m.counts(out.log_counts)).tolist() == [[1.0, 2.0, 1.0, 1.0]]


def test_data_starts_are_the_real_graphs_part_way_with_the_lstm_state_of_the_steps_before_them(tmp_path):
    """Every graph after an episode's first step and before its last (and before the horizon) is a start, with
    its own z, counts (capped), metrics and step; its LSTM state is the one the world model reaches over the
    real steps before it (the same as running the sequence through it, for an episode of valid moves)."""
    from rlflow.agents.world_model import load_latents
    from rlflow.env.dream import data_starts

    data = load_latents(synthetic_latents(tmp_path / "l.npz", episodes=12))
    torch.manual_seed(0)
    wm = MDNRNN(6, 4, 3, hidden=8, gaussians=2)
    s = data_starts(wm, data, max_steps=100)
    lengths = data["lengths"]
    assert len(s) == int(np.maximum(lengths - 1, 0).sum())
    assert int(s.steps.min()) == 1 and all(int(t) < lengths.max() for t in s.steps)
    # the LSTM state of a start: the sequence of the real steps before it that moved the graph, run through the
    # world model (an invalid step or the NO-OP leaves it as it was, as in the dream)
    moved = data["valid"] & (data["actions"][..., 0] < 4) & (data["actions"][..., 0] >= 0)
    i = 0
    for e in range(12):
        for t in range(1, int(lengths[e])):
            assert int(s.steps[i]) == t
            assert torch.equal(s.z[i], torch.as_tensor(data["z"][e, t]))
            assert torch.equal(s.counts[i], torch.as_tensor(np.minimum(data["counts"][e, t], 3), dtype=torch.float32))
            assert torch.equal(s.metrics[i], torch.as_tensor(data["metrics"][e, t]))
            steps = np.nonzero(moved[e, :t])[0]
            if len(steps) == 0:
                assert not s.h[i].any() and not s.c[i].any()
            else:
                z = torch.as_tensor(data["z"][e:e + 1, steps])
                a = torch.as_tensor(data["actions"][e:e + 1, steps]).long()
                c = torch.as_tensor(data["counts"][e:e + 1, steps], dtype=torch.float32)
                h, cell = wm(z, a, c).hidden
                assert torch.allclose(s.h[i], h[0, 0], atol=1e-5) and torch.allclose(s.c[i], cell[0, 0], atol=1e-5)
            i += 1
    assert len(data_starts(wm, data, max_steps=2)) == int((np.minimum(lengths, 2) - 1).clip(0).sum())
