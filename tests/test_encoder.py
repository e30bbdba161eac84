"""The graph encoder (rlflow.nn.graph_data, rlflow.nn.encoder), its training and the train_encoder stage."""

import dataclasses
import json

import numpy as np
import pytest
import torch

from rlflow.agents.rollouts import FORMAT, collect, rules_digest
from rlflow.cost import AnalyticCost
from rlflow.env import make_env
from rlflow.env.observation import MAX_RANK, NODE_FEATURES
from rlflow.graph.onnx_io import load_onnx
from rlflow.rewrite.rule import load_rules

MAX_STEPS, EPISODES = 5, 6
ENV_CONFIG = {"env": {"max_steps": MAX_STEPS, "max_locations": 200}}
ENC = {"z_dim": 8, "hidden": 16, "layers": 2, "heads": 2, "epochs": 2, "lr": 1e-3, "batch_size": 8,
       "max_graphs": 20, "holdout": 0.34}


@pytest.fixture(scope="module")
def problem(tiny_zoo, rules_file):
    graph, rules = load_onnx(tiny_zoo["bert"]), load_rules(rules_file)
    env = make_env(ENV_CONFIG, graph, rules, AnalyticCost("cpu"), reward=False)
    return env, graph, rules


@pytest.fixture(scope="module")
def rollouts(problem, tmp_path_factory):
    env, _, rules = problem
    episodes = collect(env, EPISODES, stop_prob=0.1, seed=0)
    for e in episodes:
        e["shard"] = 0
    doc = {"format": FORMAT, "model": "bert", "shards": [0], "seed": 0, "rules": rules_digest(rules),
           "env": {"max_steps": MAX_STEPS, "max_locations": 200}, "cost": env.cost.describe(),
           "metric_names": ["runtime_ms", "flops", "bytes", "launches"], "stats": {}, "episodes": episodes}
    path = tmp_path_factory.mktemp("enc-rollouts") / "rollouts.json"
    path.write_text(json.dumps(doc))
    return path, doc


@pytest.fixture(scope="module")
def stored(problem, rollouts, tmp_path_factory):
    """The rollouts' graphs file (collected again with the same seed, keeping the graphs)."""
    from rlflow.agents.rollouts import graph_arrays
    from rlflow.atomic import write_npz

    env = problem[0]
    packed: list = []
    episodes = collect(env, EPISODES, stop_prob=0.1, seed=0, graphs=packed)
    assert [e["actions"] for e in episodes] == [e["actions"] for e in rollouts[1]["episodes"]]
    path = tmp_path_factory.mktemp("enc-graphs") / "rollouts.graphs.npz"
    write_npz(path, graph_arrays(packed, episodes))
    return path


def _encoder(env, **kw):
    from rlflow.nn.encoder import GraphEncoder

    torch.manual_seed(0)
    args = dict(hidden=16, layers=2, heads=2, z_dim=8, n_xfers=env.n_xfers)
    args.update(kw)
    return GraphEncoder(NODE_FEATURES, MAX_RANK, 4, **args)


def test_graph_data_shapes(problem):
    from rlflow.nn.graph_data import batch, to_data

    env = problem[0]
    obs, info = env.reset()
    d = to_data(obs, info["counts"])
    g = obs["graph"]
    V, E = g.nodes.shape[0], g.edges.shape[0]
    assert d.x.shape == (V, NODE_FEATURES) and d.x.dtype == torch.float32
    assert d.edge_index.shape == (2, E) and d.edge_index.dtype == torch.int64
    assert d.edge_attr.shape == (E, MAX_RANK) and d.u.shape == (1, 4)
    assert d.y_counts.shape == (1, env.n_xfers)
    np.testing.assert_allclose(d.x[:, -1].numpy(), np.log1p(g.nodes[:, -1]), rtol=1e-6)
    np.testing.assert_allclose(d.edge_attr.numpy(), np.log1p(g.edges), rtol=1e-6)
    np.testing.assert_allclose(d.u.numpy()[0], np.log1p(obs["global"]), rtol=1e-6)
    b = batch([d, d, d])
    assert b.u.shape == (3, 4) and b.x.shape == (3 * V, NODE_FEATURES) and b.num_graphs == 3


def test_encoder_shapes_and_permutation_sense(problem):
    from rlflow.nn.graph_data import batch, to_data

    env = problem[0]
    obs, info = env.reset()
    d = to_data(obs, info["counts"])
    model = _encoder(env).eval()
    with torch.no_grad():
        z = model(batch([d, d]))
        pm, pc = model.predict(z)
        assert z.shape == (2, 8) and pm.shape == (2, 4) and pc.shape == (2, env.n_xfers)
        torch.testing.assert_close(z[0], z[1])
        # renumbering the nodes does not change z
        V = d.x.shape[0]
        perm = torch.randperm(V, generator=torch.Generator().manual_seed(1))
        inv = torch.empty_like(perm)
        inv[perm] = torch.arange(V)
        d2 = dataclasses.replace(d, x=d.x[perm], edge_index=inv[d.edge_index])
        torch.testing.assert_close(model(batch([d2]))[0], z[0], rtol=1e-4, atol=1e-5)


def test_global_metrics_far_outside_the_rollouts_are_clipped(problem):
    """A metric the rollouts hardly vary (tiny std, like bert's FLOPs) must not blow z up on a graph of another
    shape: beyond U_CLIP standard deviations the encoder sees exactly U_CLIP; within, the metrics pass unchanged."""
    from rlflow.nn.encoder import U_CLIP
    from rlflow.nn.graph_data import batch, to_data

    env = problem[0]
    obs, _ = env.reset()
    d = to_data(obs)
    model = _encoder(env).eval()
    std = torch.tensor([0.01, 1e-5, 0.01, 0.01])
    model.set_normalisation(d.u[0], std)

    def z_at(shift_in_std):  # the same graph with its log FLOPs moved by this many std
        d2 = dataclasses.replace(d, u=d.u.clone())
        d2.u[0, 1] += shift_in_std * std[1]
        with torch.no_grad():
            return model(batch([d2]))[0]

    halved = z_at(-np.log(2) / 1e-5)  # FLOPs halved: -69,000 std
    torch.testing.assert_close(halved, z_at(-U_CLIP))
    assert float((halved - z_at(0)).norm()) < 10 * float(z_at(0).norm())
    assert not torch.allclose(z_at(-3), z_at(0)) and not torch.allclose(z_at(-3), z_at(-U_CLIP))  # inside: seen


def test_training_reduces_the_loss(problem, rollouts, tmp_path):
    from rlflow.agents.checkpoint import Checkpointer
    from rlflow.agents.encoder_training import train_encoder

    env = problem[0]
    episodes = rollouts[1]["episodes"]
    cfg = {**ENC, "epochs": 5, "lr": 1e-2}
    res = train_encoder(env, episodes, cfg, 0, "cpu", Checkpointer(tmp_path / "e.pt", "fp"))
    loss = res.metrics["train_loss"]
    assert len(loss) == 5 and loss[-1] < 0.7 * loss[0]
    assert res.metrics["replay_check"] == {"max_metric_rel_diff": 0.0, "count_mismatch_steps": 0,
                                           "replayed_episodes": EPISODES}
    h = res.metrics["heldout"]
    assert h["graphs"] > 0 and 0 <= h["counts_mask_acc"] <= 1 and h["runtime_rel_err"] >= 0


def _stage_args(tiny_zoo, rules_file, rollouts_path, out, *extra):
    return ["train-encoder", "--config", "config.yaml", "--model", "bert", "--onnx", str(tiny_zoo["bert"]),
            "--rules", str(rules_file), "--rollouts", str(rollouts_path), "--out", str(out / "encoder.pt"),
            "--latents", str(out / "latents.npz"), "--metrics", str(out / "metrics.json"), "--no-progress",
            "--set", "cost.model=analytic", "--set", "device=cpu", "--set", f"env.max_steps={MAX_STEPS}",
            *[a for k, v in ENC.items() for a in ("--set", f"encoder.{k}={v}")], *extra]


def test_stage_end_to_end(tiny_zoo, rules_file, rollouts, tmp_path, root, monkeypatch):
    from rlflow.cli import main
    from rlflow.agents.checkpoint import load_encoder

    monkeypatch.chdir(root)
    path, doc = rollouts
    assert main(_stage_args(tiny_zoo, rules_file, path, tmp_path)) == 0
    for name in ("encoder.pt", "latents.npz", "metrics.json"):
        assert (tmp_path / name).is_file()
    assert not (tmp_path / "encoder.pt.partial").exists()
    E, T, N, Z = EPISODES, MAX_STEPS, len(load_rules(rules_file)), ENC["z_dim"]
    lat = np.load(tmp_path / "latents.npz")
    expect = {"z": (np.float32, (E, T + 1, Z)), "lengths": (np.int32, (E,)), "actions": (np.int32, (E, T, 2)),
              "metrics": (np.float64, (E, T + 1, 4)), "counts": (np.int32, (E, T + 1, N)),
              "done": (np.bool_, (E, T)), "valid": (np.bool_, (E, T)), "holdout": (np.bool_, (E,)),
              "n_xfers": (None, ()), "max_locations": (None, ()), "z_dim": (None, ())}
    assert set(lat.files) == set(expect)
    for k, (dtype, shape) in expect.items():
        assert lat[k].shape == shape, k
        if dtype is not None:
            assert lat[k].dtype == dtype, k
    assert int(lat["n_xfers"]) == N and int(lat["max_locations"]) == 200 and int(lat["z_dim"]) == Z
    assert 0 < lat["holdout"].sum() < E
    for e, ep in enumerate(doc["episodes"]):
        L = len(ep["actions"])
        assert lat["lengths"][e] == L
        assert (lat["actions"][e, :L] == np.array(ep["actions"])).all() and (lat["actions"][e, L:] == -1).all()
        np.testing.assert_array_equal(lat["metrics"][e, :L + 1], np.array(ep["metrics"]))
        assert (lat["metrics"][e, L + 1:] == lat["metrics"][e, L]).all()
        assert (lat["z"][e, L + 1:] == 0).all() and np.abs(lat["z"][e, :L + 1]).sum(-1).min() > 0
        for k, c in ep["counts"][0]:
            assert lat["counts"][e, 0, k] == c
        assert lat["counts"][e, 0].sum() == sum(c for _, c in ep["counts"][0])
        assert lat["done"][e, :L].tolist() == ep["done"] and not lat["done"][e, L:].any()
    m = json.loads((tmp_path / "metrics.json").read_text())
    assert len(m["train_loss"]) == 2 and m["graphs"]["train"] <= 20 and "runtime_rel_err" in m["heldout"]
    model = load_encoder(tmp_path / "encoder.pt")
    assert model.config["z_dim"] == Z

    # the encoder reproduces the stored z of the first graph
    from rlflow.nn.graph_data import batch, to_data

    env = make_env(ENV_CONFIG, load_onnx(tiny_zoo["bert"]), load_rules(rules_file), AnalyticCost("cpu"), reward=False)
    obs, _ = env.reset()
    with torch.no_grad():
        z0 = model(batch([to_data(obs)]))[0].numpy()
    np.testing.assert_allclose(z0, lat["z"][0, 0], rtol=1e-4, atol=1e-5)


def test_stage_resumes_after_a_kill(tiny_zoo, rules_file, rollouts, tmp_path, root, monkeypatch):
    from rlflow.agents.checkpoint import Checkpointer
    from rlflow.cli import main

    monkeypatch.chdir(root)
    path, _ = rollouts
    save = Checkpointer.save

    def killed(self, state):
        save(self, state)
        raise KeyboardInterrupt  # killed right after the first epoch's checkpoint

    monkeypatch.setattr(Checkpointer, "save", killed)
    assert main(_stage_args(tiny_zoo, rules_file, path, tmp_path)) == 130
    assert (tmp_path / "encoder.pt.partial").is_file() and not (tmp_path / "encoder.pt").exists()
    monkeypatch.setattr(Checkpointer, "save", save)
    assert main(_stage_args(tiny_zoo, rules_file, path, tmp_path)) == 0
    m = json.loads((tmp_path / "metrics.json").read_text())
    assert m["resumed_from_epoch"] == 1 and len(m["train_loss"]) == 2
    assert not (tmp_path / "encoder.pt.partial").exists()
    from rlflow.agents.checkpoint import load_encoder

    load_encoder(tmp_path / "encoder.pt")
    # a run with another config ignores the partial file and starts over
    monkeypatch.setattr(Checkpointer, "save", killed)
    assert main(_stage_args(tiny_zoo, rules_file, path, tmp_path)) == 130
    monkeypatch.setattr(Checkpointer, "save", save)
    assert main(_stage_args(tiny_zoo, rules_file, path, tmp_path, "--set", "encoder.lr=0.002")) == 0
    assert json.loads((tmp_path / "metrics.json").read_text())["resumed_from_epoch"] == 0


@pytest.mark.parametrize("damage, needle", [
    (lambda ep: ep["metrics"][1].__setitem__(0, ep["metrics"][1][0] * 1.01),
     "episode 0, step 1: replaying the actions gives runtime_ms "),
    (lambda ep: ep["counts"][0].__setitem__(0, [ep["counts"][0][0][0], ep["counts"][0][0][1] + 1]),
     "episode 0, step 0: replaying the actions gives "),
])
def test_replay_mismatch_is_an_error(problem, rollouts, damage, needle):
    """Rollouts that the environment does not reproduce (other model, rules or cost model) are refused."""
    import copy

    from rlflow.agents.encoder_training import materialise
    from rlflow.errors import RLFlowError

    env = problem[0]
    episodes = copy.deepcopy(rollouts[1]["episodes"][:1])
    assert len(episodes[0]["actions"]) >= 1 and episodes[0]["counts"][0]
    _, check = materialise(env, episodes, source="r.json")  # intact: reproduced
    assert check == {"max_metric_rel_diff": 0.0, "count_mismatch_steps": 0, "replayed_episodes": 1}
    damage(episodes[0])
    with pytest.raises(RLFlowError, match="^r.json: " + needle):
        materialise(env, episodes, source="r.json")


def test_stage_refuses_rollouts_it_cannot_reproduce(tiny_zoo, rules_file, rollouts, tmp_path, root, monkeypatch,
                                                    capsys):
    from rlflow.cli import main

    monkeypatch.chdir(root)
    doc = json.loads(rollouts[0].read_text())
    doc["episodes"][2]["metrics"][0][1] += 1000.0  # flops of the first graph
    bad = tmp_path / "rollouts.json"
    bad.write_text(json.dumps(doc))
    out = tmp_path / "out"
    out.mkdir()
    assert main(_stage_args(tiny_zoo, rules_file, bad, out)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"rlflow: error: {bad}: episode 2, step 0: replaying the actions "
                                               "gives flops "), err
    assert list(out.iterdir()) == []


def test_stage_with_a_damaged_partial_checkpoint_fails_naming_it(tiny_zoo, rules_file, rollouts, tmp_path, root,
                                                                 monkeypatch, capsys):
    from rlflow.cli import main

    monkeypatch.chdir(root)
    partial = tmp_path / "encoder.pt.partial"
    partial.write_bytes(b"\x80\x02half a checkpoint")
    assert main(_stage_args(tiny_zoo, rules_file, rollouts[0], tmp_path)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"rlflow: error: {partial}: the resumable checkpoint of an "
                                               "interrupted run cannot be read ("), err
    assert err[0].endswith("; delete it to start over")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["encoder.pt.partial"]  # kept; nothing written


# ------------------------------------------------------------------------------------------- stored graphs
def test_stored_graphs_are_the_replayed_ones(problem, rollouts, stored):
    """Every stored graph, as the encoder's Data, equals the one a replay of its episode gives (features, links,
    targets), and from_stored replays the asked number of episodes to check them."""
    from rlflow.agents.encoder_training import from_stored, materialise
    from rlflow.agents.rollouts import read_graphs, unpack_graphs

    env, episodes = problem[0], rollouts[1]["episodes"]
    replayed, _ = materialise(env, episodes)
    got, check = from_stored(env, episodes, unpack_graphs(read_graphs(stored), episodes, "g"), 2, 0)
    assert check["replayed_episodes"] == 2 and check["stored_graphs"] == sum(len(s) for s in replayed)
    assert [len(s) for s in got] == [len(s) for s in replayed]
    for want_seq, got_seq in zip(replayed, got):
        for want, have in zip(want_seq, got_seq):
            for name in ("x", "edge_index", "edge_attr", "u", "y_metrics", "y_counts"):
                a, b = getattr(want, name), getattr(have, name)
                assert a.dtype == b.dtype and torch.equal(a, b), name


def test_a_stored_graph_that_the_replay_does_not_give_is_an_error(problem, rollouts, stored):
    from rlflow.agents.encoder_training import from_stored
    from rlflow.agents.rollouts import read_graphs, unpack_graphs
    from rlflow.errors import RLFlowError

    env, episodes = problem[0], rollouts[1]["episodes"]
    arrays = read_graphs(stored)
    n0 = int(arrays["graph_edges"][0]) + int(arrays["graph_edges"][1])  # episode 0's step 2 starts here
    arrays["edges"] = arrays["edges"].copy()
    arrays["edges"][n0] += 1.0  # a shape dim of one edge of episode 0, step 2
    assert len(episodes[0]["actions"]) >= 2
    with pytest.raises(RLFlowError, match=r"^g: episode 0, step 2: the stored graph differs from the replayed one "
                                          r"\(edge_attr\)"):
        from_stored(env, episodes, unpack_graphs(arrays, episodes, "g"), EPISODES, 0, graphs_source="g")
    # checked on a sample that leaves episode 0 out, the damage goes unseen: the check is a sample
    from_stored(env, episodes[1:], list(unpack_graphs(arrays, episodes, "g"))[1:], 1, 0)


@pytest.mark.parametrize("damage, needle", [
    (lambda a, eps: eps[1]["actions"].__setitem__(0, [eps[1]["actions"][0][0], 99]),
     "stored for other episodes than the rollouts file's"),
    (lambda a, eps: a.__setitem__("node_runtime", a["node_runtime"] * np.float32(1.5)),
     "episode 0, step 0: the stored graph's node runtimes sum to "),
    (lambda a, eps: a.__setitem__("graph_nodes", a["graph_nodes"][:-1]),
     "its graph, node and edge counts do not add up"),
])
def test_a_graphs_file_of_other_rollouts_is_refused(rollouts, stored, damage, needle):
    import copy

    from rlflow.agents.rollouts import read_graphs, unpack_graphs
    from rlflow.errors import RLFlowError

    arrays, episodes = read_graphs(stored), copy.deepcopy(rollouts[1]["episodes"])
    damage(arrays, episodes)
    with pytest.raises(RLFlowError, match="^g.npz: " + needle):
        unpack_graphs(arrays, episodes, "g.npz")


def test_stage_with_stored_graphs_writes_the_same_encoder_and_latents(tiny_zoo, rules_file, rollouts, stored,
                                                                      tmp_path, root, monkeypatch, capsys):
    from rlflow.cli import main

    monkeypatch.chdir(root)
    path = rollouts[0]
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    assert main(_stage_args(tiny_zoo, rules_file, path, tmp_path / "a")) == 0
    assert main(_stage_args(tiny_zoo, rules_file, path, tmp_path / "b", "--graphs", str(stored),
                            "--set", "encoder.replay_check=2")) == 0
    assert "2 of them replayed to check them" in capsys.readouterr().out
    a, b = np.load(tmp_path / "a" / "latents.npz"), np.load(tmp_path / "b" / "latents.npz")
    for k in a.files:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    ma, mb = (json.loads((tmp_path / d / "metrics.json").read_text()) for d in "ab")
    assert ma["train_loss"] == mb["train_loss"] and ma["heldout"] == mb["heldout"]
    assert ma["replay_check"]["replayed_episodes"] == EPISODES and mb["replay_check"]["replayed_episodes"] == 2


def test_stage_refuses_a_graphs_file_that_is_not_one(tiny_zoo, rules_file, rollouts, stored, tmp_path, root,
                                                     monkeypatch, capsys):
    from rlflow.cli import main

    monkeypatch.chdir(root)
    bad = tmp_path / "g.npz"
    bad.write_bytes(stored.read_bytes()[:200])  # cut short
    out = tmp_path / "out"
    out.mkdir()
    assert main(_stage_args(tiny_zoo, rules_file, rollouts[0], out, "--graphs", str(bad))) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"rlflow: error: {bad}: not a rollout graphs file (BadZipFile)"], err
    assert list(out.iterdir()) == []
