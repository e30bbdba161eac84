"""Train the MDN-RNN world model on the encoder's z sequences (pipeline stage ``train_world_model``).

Reads the latents file of stage train_encoder (z_t per step of each rollout episode, the actions, cost metrics,
per-rule match counts, done flags and the held-out split) and trains an LSTM with mixture-density, metric-delta,
done and match-count heads (world_model.*: hidden, gaussians, epochs, lr decayed polynomially to 0,
batch_size). Held-out episodes are never trained on. Writes:

  --out      the checkpoint (state_dict, model_args, delta normalisation, world_model config, z_dim/n_xfers/
             max_locations); a partial checkpoint <out>.partial after every epoch lets a killed run resume
  --metrics  held-out quality: next-z log-likelihood per dimension, Pearson correlation of the rewards
             (weighted, delta) from predicted vs true metric deltas, rule-mask accuracy/recall, done accuracy
  --curve    per-epoch train and held-out losses (CSV)
  --logs     the same curves as a dvclive folder (rlflow.agents.logging), and the final held-out figures;
             rebuilt from epoch 1, with the checkpoint's saved epochs, when a run resumes
"""

from __future__ import annotations

import argparse
import json
import time

from rlflow.config import get, load_config, resolve_device
from rlflow.problem import single_cpu_thread

HELP = "train the MDN-RNN world model on the encoder's latents (pipeline stage train_world_model)"
SET_EXAMPLE = "world_model.epochs=10"


def run(args: argparse.Namespace) -> int:
    import numpy as np
    import torch

    from rlflow.agents.checkpoint import Checkpointer, fingerprint
    from rlflow.agents.logging import TrainingLog
    from rlflow.agents.world_model import curve_csv, evaluate, load_latents, train
    from rlflow.atomic import write_text

    config = load_config(args.config, args.overrides)
    device = resolve_device(config)
    seed = int(get(config, "seed"))
    wm = dict(get(config, "world_model"))
    data = load_latents(args.latents)
    np.random.seed(seed)
    torch.manual_seed(seed)
    single_cpu_thread()

    t0 = time.perf_counter()
    ckpt = Checkpointer(args.out, fingerprint({"stage": "train-world-model", "seed": seed, "world_model": wm}, [args.latents]))
    live = TrainingLog(args.logs, params={"seed": seed, "device": get(config, "device"), "world_model": wm})
    res = train(data, wm, seed, device, checkpointer=ckpt, progress=not args.no_progress,
                log=lambda s: print(f"train_world_model: {s}"), live=live)
    model = res["model"]
    seconds = time.perf_counter() - t0
    held = res["heldout_episodes"]
    on = "heldout" if len(held) else "train"  # no held-out episodes: report the training fit, and say so
    quality = evaluate(model, data, held if len(held) else res["train_episodes"], device)
    model_cpu = model.to("cpu")
    payload = {
        "format": "rlflow-world-model/1",
        "model": args.model,
        "state_dict": model_cpu.state_dict(),
        "model_args": {k: v for k, v in model_cpu.config.items()},
        "delta_norm": {"kind": "log1p", "metrics": ["runtime_ms", "flops", "bytes", "launches"],
                       "mean": model_cpu.delta_mean.tolist(), "std": model_cpu.delta_std.tolist()},
        "world_model": wm,
        "seed": seed,
        "z_dim": data["z_dim"], "n_xfers": data["n_xfers"], "max_locations": data["max_locations"],
    }
    last = res["rows"][-1] if res["rows"] else {}
    metrics = {
        "model": args.model,
        "device": device,
        "world_model": wm,
        "train_episodes": int(len(res["train_episodes"])),
        "heldout_episodes": int(len(held)),
        "evaluated_on": on,
        "epochs": len(res["rows"]),
        "resumed_from_epoch": res["resumed_from"],
        "train_seconds": seconds,
        "final_train_loss": last.get("train_loss"),
        "final_train_nll": last.get("train_nll"),
        "final_heldout_nll": None if not len(held) else last.get("heldout_nll"),
        **quality,
    }
    write_text(args.curve, curve_csv(res["rows"]))
    write_text(args.metrics, json.dumps(_clean(metrics), indent=2, allow_nan=False) + "\n")
    ckpt.finish(payload)
    live.summary({f"final/{on}_loglik_per_dim": quality.get("loglik_per_dim"),
                  "final/mask_accuracy": quality.get("mask_accuracy"), "final/mask_recall": quality.get("mask_recall"),
                  "final/done_accuracy": quality.get("done_accuracy"),
                  **{f"final/reward_corr_{k}": v for k, v in quality.get("reward_corr", {}).items()},
                  "final/seconds": seconds})
    live.close()
    corr = quality.get("reward_corr", {})
    fmt = lambda v: "n/a" if v is None else f"{v:.3f}"  # noqa: E731
    print(f"train_world_model: wrote {args.out}: {metrics['epochs']} epochs in {seconds:.1f} s on {device}; "
          f"{on} next-z loglik/dim {fmt(quality.get('loglik_per_dim'))}, reward corr weighted "
          f"{fmt(corr.get('weighted'))} delta {fmt(corr.get('delta'))}, mask acc {fmt(quality.get('mask_accuracy'))} "
          f"recall {fmt(quality.get('mask_recall'))}, done acc {fmt(quality.get('done_accuracy'))}")
    return 0


def _clean(v):
    """JSON-safe: NaN/inf become null, numpy scalars plain numbers."""
    import math

    if isinstance(v, dict):
        return {k: _clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_clean(x) for x in v]
    if hasattr(v, "item") and not isinstance(v, (str, bytes)):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v
