"""The pipeline on a GPU box, as its users run it: the tiny config with ``device: cuda`` through Snakemake (rule
all) and the same through ``dvc repro``, side by side in two fresh repositories; and ``evaluate`` on paper-size
BERT (the original and the graphs eqsat and greedy find for the simulated H100) with torch on the GPU; and, when
named, the default config's learning stages for bert, each alone, with their wall times on ``--device``.

  python benchmarks/gpu_pipeline.py --parts pipeline evaluate --out gpu_pipeline.json [--cores 16]
  python benchmarks/gpu_pipeline.py --parts stages --device cpu --out stages_cpu.json    # the same stages here

Per part: the exit code, the wall time, the last lines of its output; ``evaluate``: every row of evaluation.csv
(method, backend, the device it ran on, latency, ratio, interval, verdict, output difference). Needs snakemake,
dvc and git on the PATH (benchmarks/gpu_check.sh installs the first two from make gpu-wheels' folder) and an
``rlflow`` command (this script puts one, running src/, first on the PATH of what it starts).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


def _env(bindir: Path) -> dict:
    """PATH with an ``rlflow`` that runs this checkout's src/ (no install needed), PYTHONPATH with src/."""
    bindir.mkdir(parents=True, exist_ok=True)
    shim = bindir / "rlflow"
    shim.write_text(f"#!/bin/sh\nexec {sys.executable} -m rlflow.cli \"$@\"\n")
    shim.chmod(0o755)
    env = dict(os.environ)
    env["PATH"] = f"{bindir}{os.pathsep}{env['PATH']}"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), *filter(None, [env.get("PYTHONPATH")])])
    return env


def _repo(dest: Path, cfg: dict) -> None:
    """A pipeline repository as a user has one: the workflow, dvc.yaml and DVC config, ``cfg``, a git repo."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("Snakefile", "dvc.yaml", ".gitignore"):
        shutil.copy2(ROOT / name, dest / name)
    for name in ("workflow", "src", "envs", "models"):
        shutil.copytree(ROOT / name, dest / name, symlinks=True, ignore=ignore, dirs_exist_ok=True)
    shutil.copytree(ROOT / ".dvc", dest / ".dvc", ignore=shutil.ignore_patterns("cache", "tmp", "config.local"))
    os.symlink(os.readlink(ROOT / "profiles"), dest / "profiles")
    (dest / "tests" / "configs").mkdir(parents=True)
    shutil.copy2(ROOT / "tests/configs/tiny.yaml", dest / "tests/configs/tiny.yaml")
    (dest / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    subprocess.run(["git", "init", "-q"], cwd=dest, check=True)


def _tail(text: str, n: int = 15) -> list[str]:
    return text.strip().splitlines()[-n:]


def pipeline(work: Path, env: dict, cores: int, limit: float, device: str = "cuda") -> dict:
    """A fresh repository with the tiny config and device: cuda (backends ort and torch: the GPU image has no
    TensorFlow): ``snakemake`` (rule all); then ``dvc status`` and ``dvc repro`` there (the run's onsuccess
    recorded it in dvc.lock: nothing to rerun) and ``dvc repro --force`` of the stages that use the GPU most
    (measure_costs times every op with CUDA events; the world model trains on cuda), one at a time; each
    command's exit code. Stopped after ``limit`` seconds. (A fresh ``dvc repro`` of the whole tiny pipeline
    runs its 24 stages one at a time: 14 took 181 s on an H200 box.)"""
    from rlflow.config import load_config

    cfg = load_config([ROOT / "config.yaml", ROOT / "tests/configs/tiny.yaml"])
    cfg["device"] = device
    cfg["evaluate"]["backends"] = ["ort", "torch"]
    cfg["sweeps"] = {"temperatures": [0.5], "rewards": ["delta"]}
    runs = {"snakemake": [["snakemake", "--cores", str(cores)], ["dvc", "status"], ["dvc", "repro"],
                          ["dvc", "repro", "--force", "--single-item", "measure_costs@bert"],
                          ["dvc", "repro", "--force", "--single-item", "train_world_model@bert"], ["dvc", "status"]]}
    procs = {}
    for name, cmds in runs.items():
        d = work / name
        d.mkdir()
        _repo(d, cfg)
        script = "; ".join(f"{' '.join(c)}; echo \"@@ {i}: exit $?\"" for i, c in enumerate(cmds))
        procs[name] = (subprocess.Popen(["bash", "-c", script], cwd=d, env=env, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True, start_new_session=True),
                       time.perf_counter(), d, script)
    out = {}
    for name, (p, t0, d, script) in procs.items():
        try:
            text, _ = p.communicate(timeout=max(1.0, limit - (time.perf_counter() - t0)))
            code = p.returncode
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, 9)
            text, _ = p.communicate()
            code = None
        steps = {int(i): int(rc) for i, rc in re.findall(r"^@@ (\d+): exit (\d+)$", text, re.M)}
        out[name] = {"commands": [{"command": " ".join(c), "exit_code": steps.get(i)} for i, c in enumerate(runs[name])],
                     "seconds": round(time.perf_counter() - t0, 1), "stopped_at_limit": code is None,
                     "tail": _tail(text)}
        out[name]["exit_code"] = None if code is None else max(steps.values(), default=code)
        out[name]["dvc_stages_run"] = text.count("\nRunning stage")
        rows = d / "results/bert/evaluation.csv"
        if rows.is_file():
            out[name]["evaluation"] = _rows(rows)
        print(f"pipeline {name}: " + "; ".join(f"{c['command']}: exit {c['exit_code']}" for c in out[name]["commands"])
              + f" ({out[name]['seconds']} s)"
              + (" (stopped at the limit)" if code is None else ""), flush=True)
        (work / f"{name}.log").write_text(text)
    return out


#: the stages that train networks on the config's device, in the order the pipeline runs them
LEARNING_STAGES = ("train_encoder", "train_world_model", "train_controller", "train_model_free")


def learning_stages(work: Path, env: dict, cores: int, device: str, model: str = "bert",
                    target: str = "sim-h100", limit: float = 600.0, together: bool = False,
                    save=lambda doc: None, size: str = "paper") -> dict:
    """The default config's learning stages for ``model`` as a user's ``snakemake`` runs them, with ``device``
    (cost target fixed, so every device trains on the same environment): first what they read (not timed), then
    each stage alone (``snakemake --cores CORES <its outputs>``), or with ``together`` all of them in one
    ``snakemake`` call, side by side where the DAG allows, as ``rule all`` runs them. Per stage: its wall time from
    the rule's benchmark file (results/benchmarks/<stage>/<model>.tsv) and, for the agents, their metrics'
    training seconds and what the never-slower check did (on a GPU box ``sim-h100`` is verifiable on torch/cuda,
    so the agents' graphs are timed there; on a CPU box they are not). Stopped after ``limit`` seconds;
    ``save(doc)`` is called after each step (a stopped run keeps what finished). ``size`` ``tiny`` merges
    tests/configs/tiny.yaml over the config (a check of this part in seconds, not a timing)."""
    from rlflow.config import load_config
    from rlflow.pipeline import registry

    cfg = load_config([ROOT / "config.yaml"] + ([ROOT / "tests/configs/tiny.yaml"] if size == "tiny" else []))
    cfg.update(device=device, models=[model])
    cfg["cost"]["target"] = target
    d = work / f"stages-{device}"
    d.mkdir()
    _repo(d, cfg)
    t_end = time.perf_counter() + limit

    def snakemake(targets: list[str]) -> tuple[int | None, float, str]:
        t0 = time.perf_counter()
        try:
            r = subprocess.run(["snakemake", "--cores", str(cores), *targets], cwd=d, env=env, capture_output=True,
                               text=True, timeout=max(1.0, t_end - t0))
        except subprocess.TimeoutExpired as e:
            return None, time.perf_counter() - t0, (e.stdout or b"").decode(errors="replace")
        return r.returncode, time.perf_counter() - t0, r.stdout + r.stderr

    def paths(name: str, kind: str) -> list[str]:
        st = registry.stage(name)
        pats = st.output_paths(device=device) if kind == "outputs" else st.input_paths(cfg, device=device, model=model)
        flat = [q for k, v in pats.items() if k not in st.folders for q in (v if isinstance(v, list) else [v])]
        return sorted({q.format(model=model) for q in flat})

    def timing(name: str) -> dict:
        st = registry.stage(name)
        row: dict = {"stage_seconds": None}
        bench = d / st.benchmark.format(model=model)
        if bench.is_file():
            with open(bench) as f:
                row["stage_seconds"] = float(next(csv.DictReader(f, delimiter="\t"))["s"])
        metrics = d / st.outputs.get("metrics", "").format(model=model)
        if name in ("train_controller", "train_model_free") and metrics.is_file():
            m = json.loads(metrics.read_text())
            row.update(training_seconds=m.get("training_seconds"), agent_seconds=m.get("seconds"),
                       phase_seconds=m.get("phase_seconds"), speed_check=(m.get("speed_check") or {}).get("line"))
        return row

    first = sorted({p for name in LEARNING_STAGES for p in paths(name, "inputs")} - {
        p for name in LEARNING_STAGES for p in paths(name, "outputs")})
    code, secs, text = snakemake(first)
    out: dict = {"device": device, "model": model, "size": size, "target": target, "cores": cores, "together": together,
                 "upstream": {"exit_code": code, "seconds": round(secs, 1), "tail": _tail(text)}, "stages": {}}
    save(out)
    print(f"stages on {device}: what they read: exit {code} in {secs:.0f} s", flush=True)
    groups = [list(LEARNING_STAGES)] if together else [[name] for name in LEARNING_STAGES]
    for group in groups:
        if code != 0:
            break
        code, secs, text = snakemake([p for name in group for p in paths(name, "outputs")])
        for name in group:
            out["stages"][name] = {"exit_code": code, **timing(name), "snakemake_seconds": round(secs, 1),
                                   "tail": _tail(text)}
            row = out["stages"][name]
            print(f"stages on {device}: {name}: exit {code}, "
                  + (f"{row['stage_seconds']:.1f} s" if row["stage_seconds"] is not None else "no time")
                  + (f" (training {row['training_seconds']:.1f} s; {row['speed_check']})"
                     if row.get("training_seconds") is not None else ""), flush=True)
        save(out)
    out["exit_code"] = code
    save(out)
    return out


def _rows(path: Path) -> list[dict]:
    keep = ("method", "backend", "device", "status", "latency_ms", "ratio", "ci_low", "ci_high", "verdict",
            "max_rel_diff", "peak_memory_bytes", "too_noisy")
    with open(path) as f:
        return [{k: r.get(k) for k in keep if k in r} for r in csv.DictReader(f)]


def evaluate_bert(work: Path, env: dict, budget: float) -> dict:
    """Paper-size BERT: export, eqsat and greedy for the simulated H100, then evaluate with ort and torch on cuda."""
    cfg = str(ROOT / "config.yaml")
    steps = [("export", ["rlflow", "export-model", "--config", cfg, "--model", "bert", "--out", "bert.onnx"])]
    for m in ("eqsat", "greedy"):
        steps.append((m, ["rlflow", "optimize", "bert.onnx", "--method", m, "--target", "sim-h100", "--config", cfg,
                          "--no-speed-check", "--no-progress", "--trace", f"{m}.json", "--out", f"{m}.onnx"]))
    steps.append(("evaluate", ["rlflow", "evaluate", "--config", cfg, "--set", "device=cuda",
                               "--set", "evaluate.backends=[ort, torch]", "--set", f"timing.budget_s={budget}",
                               "--model", "bert", "--onnx", "bert.onnx", "--eqsat", "eqsat.onnx",
                               "--eqsat-trace", "eqsat.json", "--greedy", "greedy.onnx", "--greedy-trace",
                               "greedy.json", "--out", "evaluation.csv", "--metrics", "metrics.json",
                               "--headline", "headline.json", "--no-progress"]))
    out: dict = {"steps": {}}
    for name, cmd in steps:
        t0 = time.perf_counter()
        r = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True)
        out["steps"][name] = {"exit_code": r.returncode, "seconds": round(time.perf_counter() - t0, 1),
                              "tail": _tail(r.stdout + r.stderr, 25)}
        print(f"evaluate-bert {name}: exit {r.returncode} in {out['steps'][name]['seconds']} s", flush=True)
        if r.returncode:
            break
    if (work / "evaluation.csv").is_file():
        out["evaluation"] = _rows(work / "evaluation.csv")
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", nargs="+", choices=("pipeline", "evaluate", "stages"), default=["pipeline", "evaluate"],
                   help="stages (only when named): the default config's learning stages for bert, each alone, with "
                        "--device, their wall times (run it with --device cpu on a CPU box to compare)")
    p.add_argument("--out", type=Path, default=Path("gpu_pipeline.json"))
    p.add_argument("--cores", type=int, default=os.cpu_count() or 2, help="snakemake --cores (default: all)")
    p.add_argument("--device", default="cuda", help="the pipeline and stages parts' config device (default: cuda)")
    p.add_argument("--limit", type=float, default=420.0,
                   help="seconds after which the pipeline part's runs are stopped (default: 420)")
    p.add_argument("--budget", type=float, default=5.0, help="evaluate's timing.budget_s (default: 5)")
    p.add_argument("--together", action="store_true",
                   help="stages: run the learning stages in one snakemake call, side by side where the DAG allows "
                        "(as rule all does), instead of each alone")
    p.add_argument("--size", choices=("paper", "tiny"), default="paper",
                   help="stages: the model and budgets of config.yaml (paper, default) or with tests/configs/tiny.yaml "
                        "merged over it (tiny: checks the part in seconds; its times mean nothing)")
    p.add_argument("--keep", type=Path, help="work in this folder (kept) instead of a temporary one")
    a = p.parse_args()
    work = a.keep or Path(tempfile.mkdtemp(prefix="gpu-pipeline-"))
    work.mkdir(parents=True, exist_ok=True)
    env = _env(work / "bin")
    doc: dict = {}
    if "pipeline" in a.parts:
        doc["pipeline"] = pipeline(work, env, a.cores, a.limit, a.device)
    if "evaluate" in a.parts:
        (work / "evaluate").mkdir(exist_ok=True)
        doc["evaluate_bert"] = evaluate_bert(work / "evaluate", env, a.budget)
    if "stages" in a.parts:
        def save(stages: dict) -> None:
            a.out.write_text(json.dumps({**doc, "stages": stages}, indent=1))
        doc["stages"] = learning_stages(work, env, a.cores, a.device, limit=a.limit, together=a.together, save=save,
                                        size=a.size)
    a.out.write_text(json.dumps(doc, indent=1))
    codes = [r["exit_code"] for r in doc.get("pipeline", {}).values() if not r["stopped_at_limit"]]
    codes += [s["exit_code"] for s in doc.get("evaluate_bert", {}).get("steps", {}).values()]
    codes += [doc["stages"]["exit_code"]] if "stages" in doc else []
    return int(any(codes))


if __name__ == "__main__":
    sys.exit(main())
