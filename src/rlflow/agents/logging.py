"""Training curves of the learning stages, logged with dvclive into each stage's ``--logs`` folder.

Every training stage writes its curves to a folder (``results/<model>/<stage>/live``; a Snakemake
``directory()`` output and a DVC output)::

    live/metrics.json                 the last value of every metric, and its step
    live/params.yaml                  the config values the run used
    live/plots/metrics/<name>.tsv     one row per step: step, value (names with "/" make subfolders)

``dvc plots show results/bert/encoder/live/plots/metrics`` draws them, and so does anything that reads TSV.

The folder is always rebuilt from the start of the run: dvclive clears the files it owns when it opens the
folder. A stage that resumes from its partial checkpoint first re-logs the curve saved in that checkpoint
(:meth:`TrainingLog.replay`), so after a resumed run the folder still holds the whole curve from step 1, with
no duplicated or missing steps.

No git or DVC side effects: dvclive here never looks for a DVC repository (its default would open the one
around the working directory, or ``dvc init`` one in a git repository without DVC), never saves a DVC
experiment, writes no ``dvc.yaml``, no report and posts nothing to DVC Studio.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch


def _live_class():
    from dvclive import Live

    class QuietLive(Live):
        """dvclive's Live without its repository integration (dvclive 3.49's two init hooks, emptied)."""

        def _init_dvc(self):  # no DVC repo lookup or `dvc init`, no experiment bookkeeping
            self._dvc_file = "dvc.yaml"  # never written: dvcyaml=False

        def _init_studio(self):  # no DVC Studio events
            self._dvc_studio_config = {}
            self._studio_events_to_skip.update({"start", "data", "done"})

        def post_data_to_studio(self):  # noqa: D102 (no background thread per step)
            return None

    return QuietLive


def _number(v: Any) -> float | int | None:
    """A loggable number, or None (skipped): tensors and numpy scalars become Python numbers; NaN/inf and
    anything non-numeric are skipped."""
    if isinstance(v, bool):
        return int(v)
    if isinstance(v, torch.Tensor):
        if v.numel() != 1:
            return None
        v = v.item()
    elif hasattr(v, "item") and not isinstance(v, (str, bytes)):
        try:
            v = v.item()
        except (TypeError, ValueError):
            return None
    if isinstance(v, int):
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    return None


class TrainingLog:
    """A dvclive folder for one training run: ``log(step, {name: value})`` per epoch or update (``folder=None``:
    logs nothing, for a stage run without ``--logs``).

    ::

        with TrainingLog(args.logs, params=used) as live:
            live.replay(saved_rows, step_key="epoch")        # a resumed run: the curve so far
            for epoch in ...:
                live.log(epoch, {"train/loss": loss, "heldout/loss": held})
            live.summary({"heldout/runtime_rel_err": err})   # final figures (metrics.json only)
    """

    def __init__(self, folder: str | Path | None, params: Mapping[str, Any] | None = None):
        self.steps = 0
        self.live = None
        if folder is None:  # no --logs: a logger that logs nothing
            self.folder = None
            return
        self.folder = Path(folder)
        if self.folder.exists() and not self.folder.is_dir():
            from rlflow.errors import RLFlowError

            raise RLFlowError(f"{self.folder}: is a file, expected a (log) folder")
        self.folder.mkdir(parents=True, exist_ok=True)
        self.live = _live_class()(dir=str(self.folder), resume=False, report=None, save_dvc_exp=False,
                                  dvcyaml=False)
        if params:
            self.live.log_params(_plain(dict(params)))

    def log(self, step: int, values: Mapping[str, Any]) -> None:
        """Values of one step (an epoch, a PPO update). Non-finite or non-numeric values are left out."""
        if self.live is None:
            return
        self.live.step = int(step)
        for name, v in values.items():
            x = _number(v)
            if x is not None:
                self.live.log_metric(name, x)
        self.live.make_summary()
        self.steps += 1

    def log_row(self, row: Mapping[str, Any], step_key: str, names: Mapping[str, str] | None = None) -> None:
        """One row of a stage's curve (a dict with the step under ``step_key``); ``names`` maps row keys to
        metric names (default: every key but ``step_key``, as is; keys it does not name are left out)."""
        self.log(int(row[step_key]), _rename(row, step_key, names))

    def replay(self, rows: Iterable[Mapping[str, Any]], step_key: str, names: Mapping[str, str] | None = None,
               ) -> int:
        """:meth:`log_row` for each saved row (a resumed run's curve so far). Returns the number of rows."""
        n = 0
        for row in rows:
            self.log_row(row, step_key, names)
            n += 1
        return n

    def summary(self, values: Mapping[str, Any]) -> None:
        """Final figures: into ``metrics.json`` only, not the curves."""
        if self.live is None:
            return
        for name, v in values.items():
            x = _number(v)
            if x is not None:
                self.live.log_metric(name, x, plot=False)
        self.live.make_summary()

    def close(self) -> None:
        if self.live is not None:
            self.live.end()

    def __enter__(self) -> "TrainingLog":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _rename(row: Mapping[str, Any], step_key: str, names: Mapping[str, str] | None) -> dict[str, Any]:
    if names is None:
        return {k: v for k, v in row.items() if k != step_key}
    return {names[k]: v for k, v in row.items() if k in names}


def _plain(v: Any) -> Any:
    """YAML-safe params: mappings, lists, str, numbers, bools, None."""
    if isinstance(v, Mapping):
        return {str(k): _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if v is None or isinstance(v, (str, bool, int, float)):
        return v
    if hasattr(v, "item"):
        return v.item()
    return str(v)


class EpisodeStats:
    """A :class:`rlflow.agents.ppo.VectorEnv` wrapper that records finished episodes (return, length) for the
    curves; everything else passes through (``steps_taken``, ``interactions``, ...).

    :meth:`pop` returns the statistics of the episodes finished since the last call."""

    def __init__(self, venv):
        self.venv = venv
        self.num_envs = venv.num_envs
        self._ret = torch.zeros(self.num_envs, dtype=torch.float64)
        self._len = torch.zeros(self.num_envs, dtype=torch.long)
        self._returns: list[float] = []
        self._lengths: list[int] = []

    def __getattr__(self, name: str):
        return getattr(self.venv, name)

    def reset(self):
        self._ret.zero_()
        self._len.zero_()
        return self.venv.reset()

    def step_batch(self, xfer, loc):
        obs, reward, done = self.venv.step_batch(xfer, loc)
        self._ret += reward.double()
        self._len += 1
        d = done.bool()
        if bool(d.any()):
            self._returns += self._ret[d].tolist()
            self._lengths += self._len[d].tolist()
            self._ret[d] = 0.0
            self._len[d] = 0
        return obs, reward, done

    def pop(self) -> dict[str, float]:
        """{episodes, episode_return, episode_length} (the means; only ``episodes`` when none finished)."""
        n = len(self._returns)
        out: dict[str, float] = {"episodes": n}
        if n:
            out["episode_return"] = sum(self._returns) / n
            out["episode_length"] = sum(self._lengths) / n
        self._returns, self._lengths = [], []
        return out
