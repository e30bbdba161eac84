"""Time the model-free agent's real work per PPO update (stage train_model_free) on each device and thread setting.

Issue T item 2: on a lent H200 the stage made 18 of 100 PPO updates in 309 s; this 2-core CPU makes 100 in 235 s.
This builds the problem, the real environments, the encoder and the policy exactly as
:func:`rlflow.agents.driver.run_agent_stage` does for ``model_free`` (its own objects and functions: load_problem,
seed_for_training, RealEnvs, HierarchicalPolicy, PPOConfig, ppo.train), except that the encoder (the GNN) is freshly
initialised with the config's sizes (timing does not depend on weights), the rules are the package's default rules
and the cost target is sim-h100, so no pipeline artefact is needed. No evaluation episodes, no output check.

Each (device, threads) configuration runs in its own subprocess (threads are set before any work):
  threads "default": torch's default intra-op threads (the stage's setting on cuda: seed_for_training sets 1 thread
  only on the cpu); "1": OMP_NUM_THREADS=1 and torch.set_num_threads(1) (the stage's setting on the cpu).
One update = collect (num_envs x steps_per_update real env steps, the policy's act on the CPU, the encoder's z of
every new observation on the device) + the PPO epochs (on the CPU: the stage never moves the policy). Update 1
includes warm-up (CUDA context, cuBLAS); the table's per-update figure is the median of the later ones.

  python benchmarks/agent_device.py --tiny --devices cpu --updates 2
  python benchmarks/agent_device.py --devices cuda,cpu --updates 2 --limit 85 --out agent_device.json  # a GPU box
  (--profile: torch.profiler's top ops by self CPU time per configuration; --set KEY=VALUE: config overrides)

The threads, the policy and PPO all on the CPU, the GNN alone on the device, with one host-device round trip per
real step (encode's .to(device) and .cpu()): on cuda the table's syncs column counts the synchronising calls.
It cannot measure two stages side by side (the world model beside the agent, as in the stalled run).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

PHASES = ("env_step", "to_data", "batch", "gnn_forward", "encode_rest", "masks", "policy_act", "ppo_update")


def run_child(a) -> dict:
    """One configuration, in this process (threads already set by the parent's environment)."""
    import torch

    default_threads = torch.get_num_threads()
    from rlflow.agents import ppo, real_env
    from rlflow.agents.driver import RealEnvs
    from rlflow.agents.logging import EpisodeStats
    from rlflow.config import get, load_config
    from rlflow.cost.platform import resolve_platform, resolved_reward
    from rlflow.env.rewards import make_reward
    from rlflow.nn.encoder import GraphEncoder
    from rlflow.nn.graph_data import to_data
    from rlflow.nn.policy import HierarchicalPolicy
    from rlflow.problem import load_problem, seed_for_training
    from rlflow.rewrite.rule import DEFAULT_RULES

    t0 = time.perf_counter()
    config = load_config(str(ROOT / "config.yaml"),
                         [f"device={a.device}", "cost.target=sim-h100", *(a.set or [])])
    problem = load_problem(config, a.onnx, DEFAULT_RULES)
    seed = seed_for_training(problem)  # the stage's thread choice: 1 on the cpu unless OMP_NUM_THREADS is set
    if a.threads == "default":
        torch.set_num_threads(default_threads)
    else:
        torch.set_num_threads(int(a.threads))
    device, cuda = problem.device, problem.device.startswith("cuda")
    section = get(config, "model_free")
    reward = make_reward(resolved_reward(config, resolve_platform(config)))
    if reward.needs_latency:
        raise SystemExit("agent_device: the reward needs measured latency; use a simulated cost target")
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    # the encoder as train_encoder builds it (fresh weights; features from a real observation)
    from rlflow.env import make_env
    probe = make_env(problem.config, problem.graph, problem.rules, problem.cost)
    first = to_data(probe.reset()[0])
    enc = get(config, "encoder")
    encoder = GraphEncoder(first.x.shape[1], first.edge_attr.shape[1], first.u.shape[1], int(enc["hidden"]),
                           int(enc["layers"]), int(enc["heads"]), int(enc["z_dim"]), n_xfers=probe.n_xfers)
    encoder.to(device).eval()
    world = RealEnvs([problem], encoder, section["num_envs"])
    max_locations = get(config, "env.max_locations")
    policy = HierarchicalPolicy(in_dim=world.in_dim, n_xfers=len(problem.rules), max_locations=max_locations,
                                hidden=get(config, "ppo.hidden"), count_features=get(config, "ppo.count_features"))
    cfg = ppo.PPOConfig.from_config(get(config, "ppo"), section["steps_per_update"], minibatch=section.get("minibatch"))
    gen = torch.Generator().manual_seed(seed)
    venv = EpisodeStats(world.vector_env(gen))
    setup_s = time.perf_counter() - t0

    # timers around the stage's own functions (module attributes, so its code calls these)
    acc = dict.fromkeys(PHASES, 0.0)
    counts = {"encode_calls": 0, "syncs": 0}

    def timed(name, fn):
        def wrapper(*args, **kw):
            t = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                acc[name] += time.perf_counter() - t
        return wrapper

    for env in world.envs:
        env.step = timed("env_step", env.step)
    real_env.to_data = timed("to_data", real_env.to_data)
    real_env.batch = timed("batch", real_env.batch)
    real_env.mask_tensors = timed("masks", real_env.mask_tensors)
    encoder.forward = timed("gnn_forward", encoder.forward)  # host time: launches (the .cpu() after it waits)
    inner_encode = real_env.encode

    def encode(enc_, obs, dev="cpu"):
        if time.monotonic() - written[0] > 5:  # a slow update: its parts so far
            write()
        t = time.perf_counter()
        before = acc["to_data"] + acc["batch"] + acc["gnn_forward"]
        out = inner_encode(enc_, obs, dev)  # ends in .cpu(): one host-device sync per call on cuda
        acc["encode_rest"] += time.perf_counter() - t - (acc["to_data"] + acc["batch"] + acc["gnn_forward"] - before)
        counts["encode_calls"] += 1
        return out

    real_env.encode = encode
    policy.act = timed("policy_act", policy.act)
    ppo.update = timed("ppo_update", ppo.update)

    if cuda:  # count synchronising CUDA calls (device-to-host copies, .item(), ...)
        import warnings
        torch.cuda.set_sync_debug_mode("warn")
        warnings.simplefilter("always")
        shown = warnings.showwarning
        warnings.showwarning = lambda msg, *r, **k: (counts.__setitem__("syncs", counts["syncs"] + 1)
                                                     if "synchroniz" in str(msg) else shown(msg, *r, **k))
    rows, deadline = [], time.monotonic() + a.limit
    info = {"device": device, "threads": a.threads, "torch_threads": torch.get_num_threads(),
            "default_threads": default_threads, "stage_threads": 1,  # rlflow.problem.single_cpu_thread, on every device
            "gpu": torch.cuda.get_device_name() if cuda else None, "torch": torch.__version__,
            "setup_s": setup_s, "nodes": len(problem.graph.nodes), "rules": len(problem.rules),
            "num_envs": section["num_envs"], "steps_per_update": section["steps_per_update"]}
    written = [time.monotonic()]

    def write(final=False, top=None):
        """The result so far (the parent reads it even if this process is killed at its time limit)."""
        later = rows[1:] or rows
        r = {**info, "updates": rows, "profile": top, "finished": final,
             "in_progress": {**{p: acc[p] - last_acc[0][p] for p in PHASES},
                             **{c: counts[c] - last_counts[0][c] for c in counts},
                             "seconds": time.perf_counter() - t_last[0]}}
        if rows:
            r.update(per_update_s=statistics.median(x["seconds"] for x in later),
                     breakdown_s={p: statistics.median(x[p] for x in later) for p in PHASES},
                     counts_per_update={c: statistics.median(x[c] for x in later) for c in counts})
        Path(a.result).write_text(json.dumps(r))
        written[0] = time.monotonic()
        return r

    t_last = [time.perf_counter()]
    last_acc, last_counts = [dict(acc)], [dict(counts)]

    class Stop(Exception):
        pass

    def on_update(k, logs):
        sync()
        now = time.perf_counter()
        row = {"update": k + 1, "seconds": now - t_last[0],
               **{p: acc[p] - last_acc[0][p] for p in PHASES},
               **{c: counts[c] - last_counts[0][c] for c in counts}}
        rows.append(row)
        t_last[0], last_acc[0], last_counts[0] = now, dict(acc), dict(counts)
        write()
        gnn = row["to_data"] + row["batch"] + row["gnn_forward"] + row["encode_rest"]
        print(f"  [{a.device} threads={a.threads}] update {k + 1}/{a.updates}: {row['seconds']:.2f} s "
              f"(env {row['env_step']:.2f}, gnn+encode {gnn:.2f}, "
              f"act {row['policy_act']:.2f}, ppo {row['ppo_update']:.2f}) reward {logs['mean_reward']:.4f}",
              flush=True)
        if time.monotonic() > deadline and k + 1 < a.updates:
            raise Stop

    prof = None
    if a.profile:
        from torch.profiler import ProfilerActivity, profile
        prof = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []))
        prof.__enter__()
    try:
        ppo.train(venv, policy, cfg, a.updates, gen, on_update)
    except Stop:
        print(f"  [{a.device} threads={a.threads}] time limit: stopped after {len(rows)} updates", flush=True)
    top = None
    if prof is not None:
        prof.__exit__(None, None, None)
        top = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15)
        print(top, flush=True)
    return write(True, top)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="bert")
    ap.add_argument("--tiny", action="store_true", help="the zoo's tiny sizes (tests/configs/tiny.yaml's)")
    ap.add_argument("--onnx", type=Path, help="use this exported model instead of exporting one")
    ap.add_argument("--devices", default=None, help="comma list, run in this order; default: cpu, and cuda where "
                    "available")
    ap.add_argument("--threads", default="default,1", help="comma list of 'default' and/or numbers")
    ap.add_argument("--updates", type=int, default=3)
    ap.add_argument("--limit", type=float, default=600.0, help="total seconds; each configuration gets its share")
    ap.add_argument("--set", action="append", metavar="KEY=VALUE", help="config overrides, e.g. model_free.num_envs=4")
    ap.add_argument("--profile", action="store_true", help="torch.profiler: top ops by self CPU time")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--device", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        run_child(a)
        return 0

    import torch

    from rlflow.config import get, load_config
    from rlflow.graph import zoo

    t0 = time.monotonic()
    devices = a.devices.split(",") if a.devices else ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    configs = [(d, t) for d in devices for t in a.threads.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        onnx = a.onnx
        if onnx is None:
            onnx = Path(tmp) / f"{a.model}.onnx"
            t = time.perf_counter()
            cfg = load_config(str(ROOT / "config.yaml"), a.set or [])
            sizes = zoo.TINY_SIZES[a.model] if a.tiny else dict(get(cfg, f"zoo.{a.model}"))
            zoo.export_model(a.model, onnx, sizes, opset=get(cfg, "export.opset"),
                             exporter=get(cfg, "export.exporter"), seed=get(cfg, "seed"))
            print(f"agent_device: exported {a.model} ({'tiny' if a.tiny else 'paper'} size) in "
                  f"{time.perf_counter() - t:.1f} s", flush=True)
        results = []
        for i, (device, threads) in enumerate(configs):
            left = a.limit - (time.monotonic() - t0)
            # its share of the time left: no new update starts after share - 10 s (startup); killed (partial
            # result kept) when it would leave the later configurations under 12 s each
            share, hard = left / (len(configs) - i), max(left - 12 * (len(configs) - i - 1), 5)
            paths = [str(ROOT / "src"), os.environ.get("PYTHONPATH")]  # (the caller's: the GPU check's wheels)
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, paths)))
            env.pop("OMP_NUM_THREADS", None)
            if threads != "default":
                env["OMP_NUM_THREADS"] = threads
            res = Path(tmp) / f"r{i}.json"
            cmd = [sys.executable, __file__, "--child", "--device", device, "--threads", threads, "--onnx", str(onnx),
                   "--updates", str(a.updates), "--limit", str(max(share - 10, 1)), "--result", str(res),
                   *(["--profile"] if a.profile else []), *[x for s in (a.set or []) for x in ("--set", s)]]
            print(f"agent_device: {device}, threads {threads}: {a.updates} updates (limit {share:.0f} s, killed at "
                  f"{hard:.0f} s)", flush=True)
            t = time.perf_counter()
            try:
                subprocess.run(cmd, env=env, timeout=hard, check=True)
                r = json.loads(res.read_text())
            except (subprocess.TimeoutExpired, subprocess.CalledProcessError) as e:
                why = (f"killed after {hard:.0f} s" if isinstance(e, subprocess.TimeoutExpired)
                       else f"exit status {e.returncode}")
                print(f"agent_device: {device}, threads {threads}: {why}", flush=True)
                r = json.loads(res.read_text()) if res.exists() else {"device": device, "threads": threads}
                print(f"agent_device: its last state: {json.dumps({k: r.get(k) for k in ('updates', 'in_progress')})}",
                      flush=True)
                if not r.get("updates"):
                    r["error"] = why
            r["wall_s"] = time.perf_counter() - t
            results.append(r)

    ok = [r for r in results if "error" not in r]
    cpu = {r["threads"]: r["per_update_s"] for r in ok if r["device"] == "cpu"}
    print(f"\n{a.model} ({'tiny' if a.tiny else 'paper'} size), cost sim-h100; s per update (median after update 1) "
          f"and its parts")
    print(f"{'device':6} {'threads':>9} {'s/update':>8} " + " ".join(f"{p:>11}" for p in PHASES)
          + f" {'syncs':>5} {'vs cpu':>6} {'setup':>6}")
    for r in results:
        if "error" in r:
            print(f"{r['device']:6} {r['threads']:>9} failed: {r['error'][:80]}")
            continue
        ratio = r["per_update_s"] / cpu[r["threads"]] if r["threads"] in cpu else float("nan")
        th = f"{r['threads']}={r['torch_threads']}" + ("*" if r["torch_threads"] == r["stage_threads"] else "")
        print(f"{r['device']:6} {th:>9} {r['per_update_s']:8.3f} "
              + " ".join(f"{r['breakdown_s'][p]:11.3f}" for p in PHASES)
              + f" {r['counts_per_update']['syncs']:5.0f} {ratio:6.2f} {r['setup_s']:6.1f}")
    print("(* the stage's own thread setting; gnn_forward is host time, encode_rest the device copy and wait; "
          "syncs counted by torch.cuda.set_sync_debug_mode on cuda only)")
    if a.out:
        a.out.write_text(json.dumps({"model": a.model, "tiny": a.tiny, "updates": a.updates, "results": results},
                                    indent=1) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
