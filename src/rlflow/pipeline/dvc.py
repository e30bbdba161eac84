"""Generate ``dvc.yaml`` (and the opt-in ``xla/dvc.yaml``, ``multi/dvc.yaml``) from the stage registry (the same one the Snakemake
rules read).

    python -m rlflow.pipeline.dvc            # (re)write dvc.yaml, xla/dvc.yaml, multi/dvc.yaml under the repository root
    python -m rlflow.pipeline.dvc --check    # exit 1 if a file differs from what the registry gives
    python -m rlflow.pipeline.dvc --exp-flags configs/paper.yaml
                                             # print `-S key=value` for `dvc exp run`, one per key in that file
    python -m rlflow.pipeline.dvc --commit export_model@bert generate_rules
                                             # record these stages' files in dvc.lock (what Snakemake's onsuccess
                                             #   runs), as `dvc commit --force --no-relink` would, in one pass

Each per-model stage is a ``foreach`` over ``models`` in config.yaml, a per-model-and-shard stage a ``matrix``
over ``models`` and ``rollouts.shards`` (a stage without wildcards, such as generate_rules, is a plain stage), and
paths use ``${device}`` from config.yaml, so ``dvc repro`` builds the same jobs as ``snakemake`` (rule all) and
dvc.yaml need not change when the model list does. ``params`` lists exactly
the config.yaml keys the stage reads, so DVC reruns a stage only when one of those changes; ``deps`` are the
stage's code and input files; ``outs`` are its declared outputs (cached by DVC, pushed to the remote).

A stage of an opt-in pipeline (registry ``Stage.pipeline``, e.g. ``xla``) goes to that pipeline's file, with
``wdir`` at the repository root: ``dvc repro`` (which reads ``dvc.yaml``) leaves it alone, ``dvc repro
xla/dvc.yaml`` builds it, as ``snakemake xla`` does.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from pathlib import Path

import yaml

from rlflow.pipeline.registry import (CONFIG_FIELDS, CONFIG_FILE, OWN_MODELS_DIR, PIPELINE_FILES, STAGES,
                                      WILDCARD_CONFIG, Stage)

HEADER = """\
# GENERATED from src/rlflow/pipeline/registry.py by `python -m rlflow.pipeline.dvc` -- do not edit by hand.
# The Snakemake rules (workflow/rules/stages.smk) come from the same registry; tests/test_pipeline.py checks that
# this file is up to date. Stages run `rlflow ...`: activate the environment first (`. .venv/bin/activate`).
#   dvc repro          build every model in config.yaml `models`
#   dvc push / pull    share results/ through the default remote (see .dvc/config)
"""

def _deps(stage: Stage, values: dict) -> list[str]:
    deps = list(stage.code_paths())
    for pattern in stage.input_paths(**values).values():
        parts = pattern.split("/")
        listed = [i for i, part in enumerate(parts) if any("{%s}" % f in part for f in stage.expand)]
        if listed and listed[0] < len(parts) - 1:
            # one file in each model's folder (train_pass_agent's results/<model>/xla/module.hlo): the folder
            # above them is all of results/, so list the files of config.yaml's list (dvc.yaml is regenerated,
            # and its test fails, when that list changes)
            deps += [p for p in _listed_files(stage, pattern) if p not in deps]
            continue
        if listed:  # a list of files DVC cannot expand: the folder above the first listed path segment
            pattern = "/".join(parts[:listed[0]])
        if pattern not in deps:
            deps.append(pattern)
    if stage.config_inputs:
        deps.append(OWN_MODELS_DIR)
    return deps


def _listed_files(stage: Stage, pattern: str) -> list[str]:
    from rlflow.config import get, load_config
    from rlflow.pipeline.registry import REPO_ROOT, fill

    config = load_config([REPO_ROOT / CONFIG_FILE])
    (f,) = [f for f in stage.expand if "{%s}" % f in pattern]
    return [fill(pattern, **{f: v}) for v in get(config, stage.expand[f])]


def stage_entry(stage: Stage) -> dict:
    values = stage.dvc_values()
    root = _to_root(stage.pipeline)
    body = {**({"wdir": root} if root != "." else {}),
        "cmd": stage.dvc_cmd(),
        "deps": _deps(stage, values),
    }
    keys = list(stage.config_keys(**values).values())
    if keys:
        body["params"] = [{CONFIG_FILE: keys}]
    outs = stage.output_paths(**values)
    body["outs"] = [p for k, p in outs.items() if k not in stage.metrics + stage.plots]
    if stage.metrics:
        body["metrics"] = [outs[k] for k in stage.metrics]
    if stage.plots:
        body["plots"] = [outs[k] for k in stage.plots]
    if not stage.wildcards:  # one run in all (e.g. generate_rules): a plain stage
        return body
    if len(stage.wildcards) == 1:
        return {"foreach": "${%s}" % WILDCARD_CONFIG[stage.wildcards[0]], "do": body}
    return {"matrix": {w: "${%s}" % WILDCARD_CONFIG[w] for w in stage.wildcards}, **body}


def _enabled(stage: Stage) -> bool:
    """Is the stage on under config.yaml (its :attr:`~rlflow.pipeline.registry.Stage.enabled_by` switch)?"""
    from rlflow.config import get
    from rlflow.pipeline.registry import default_config

    return not stage.enabled_by or bool(get(default_config(), stage.enabled_by))


def _switches() -> set[str]:
    """The config switches that add stages or inputs to the pipeline (``enabled_by``, ``when``)."""
    return {k for st in STAGES.values() for k in (st.enabled_by, *st.when.values()) if k}


def _to_root(pipeline: str) -> str:
    """The repository root relative to a pipeline file's folder (its stages' ``wdir``: paths stay root-relative)."""
    depth = len(Path(PIPELINE_FILES[pipeline]).parent.parts)
    return "/".join([".."] * depth) or "."


#: what an opt-in pipeline's ``dvc repro`` builds (its file's header)
PIPELINE_SCOPE = {"xla": "for every model in config.yaml `models`",
                  "multi": "for the models of config.yaml `multi_model`"}


def render(pipeline: str = "main") -> str:
    """The DVC file of one pipeline (:data:`rlflow.pipeline.registry.PIPELINE_FILES`): its stages only."""
    tops = sorted({k.split(".")[0] for k in [*WILDCARD_CONFIG.values(), *CONFIG_FIELDS.values()]})
    root = _to_root(pipeline)
    doc = {
        "vars": [f"{CONFIG_FILE if root == '.' else root + '/' + CONFIG_FILE}:{','.join(tops)}"],
        "stages": {name: stage_entry(stage) for name, stage in STAGES.items()
                   if stage.pipeline == pipeline and _enabled(stage)},
    }
    body = yaml.safe_dump(doc, sort_keys=False, default_flow_style=False, width=120)
    header = HEADER if pipeline == "main" else HEADER.replace(
        "#   dvc repro          build every model in config.yaml `models`",
        f"#   dvc repro {PIPELINE_FILES[pipeline]}   build this opt-in pipeline {PIPELINE_SCOPE[pipeline]}")
    return header + body


def exp_flags(path: Path) -> list[str]:
    """``-S key=value`` for ``dvc exp run``: DVC reads params from config.yaml only, so an override file (e.g.
    configs/paper.yaml, which Snakemake takes as ``--configfile``) becomes one flag per leaf key (lists whole)."""
    from rlflow.config import _read_yaml_mapping
    from rlflow.pipeline.registry import cli_value

    def leaves(node: dict, prefix: str = ""):
        for key, value in node.items():
            if isinstance(value, dict) and value:
                yield from leaves(value, f"{prefix}{key}.")
            else:
                yield f"{prefix}{key}", value

    from rlflow.config import get
    from rlflow.pipeline.registry import default_config

    flags = []
    for key, value in leaves(_read_yaml_mapping(path)):
        if key in _switches() and bool(value) != bool(get(default_config(), key)):
            # dvc.yaml holds the stages of config.yaml's switches; a flag cannot add or remove stages
            print(f"note: {key}={cli_value(value)} left out: it changes which stages run, and dvc.yaml was made "
                  f"with config.yaml's value; set it there and run `make dvc-yaml`, or run this config with "
                  f"Snakemake (--configfile {path})", file=sys.stderr)
            continue
        flags.append(f"-S {key}={cli_value(value)}")
    return flags


def commit(names: list[str], root: Path = Path(".")) -> None:
    """Record the current dependencies and outputs of the DVC stages ``names`` (``export_model@bert``,
    ``multi/dvc.yaml:report_multi``) in their lock files and the DVC cache, as ``dvc commit --force --no-relink``
    does, but in one pass: DVC's own command reads dvc.yaml and rewrites dvc.lock once per stage named, which took
    71 s for a tiny bert run's 25 stages on a 2-core CPU (each stage's lock entry lists its code files). Here the
    files are read once and each lock file is written once. Raises RLFlowError for a name no dvc.yaml defines
    and for what DVC refuses (a missing output)."""
    import contextlib

    from dvc.exceptions import DvcException
    from dvc.repo import Repo, lock_repo

    from rlflow.errors import RLFlowError

    try:
        # DVC names stages and writes paths relative to the current folder: the repository root's
        with contextlib.chdir(root), Repo(".") as repo, lock_repo(repo):
            by_name = {st.addressing: st for st in repo.index.stages}
            unknown = sorted(set(names) - by_name.keys())
            if unknown:
                raise RLFlowError(f"no DVC stage named {', '.join(unknown)} under {root}")
            by_file: dict[str, list] = {}
            for name in dict.fromkeys(names):
                st = by_name[name]
                st.save()
                st.commit(relink=False)  # no relink: new modification times would make Snakemake rerun everything
                by_file.setdefault(st.dvcfile.relpath, []).append(st)
            for stages in by_file.values():
                stages[0].dvcfile.dump_stages(stages, update_pipeline=False)
    except DvcException as e:
        raise RLFlowError(f"dvc: {e}") from e


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlflow.pipeline.dvc", description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="do not write; exit 1 if the file is out of date")
    parser.add_argument("--root", type=Path, default=Path("."),
                        help="the repository root the pipeline files are written under (default: the current folder)")
    parser.add_argument("--exp-flags", type=Path, metavar="YAML",
                        help="print the `dvc exp run` flags (-S key=value) that apply this override file, and exit")
    parser.add_argument("--commit", nargs="+", metavar="STAGE",
                        help="record these DVC stages' current files in dvc.lock and the cache (as `dvc commit "
                             "--force --no-relink`, in one pass), and exit")
    args = parser.parse_args(argv)
    if args.commit:
        from rlflow.errors import RLFlowError

        try:
            commit(args.commit, args.root)
        except RLFlowError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        return 0
    if args.exp_flags:
        from rlflow.errors import RLFlowError

        try:
            print(" ".join(exp_flags(args.exp_flags)))
        except RLFlowError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        return 0
    stale = 0
    for pipeline, name in PIPELINE_FILES.items():
        out = args.root / name
        want = render(pipeline)
        have = out.read_text() if out.is_file() else ""
        if have == want:
            continue
        if args.check:
            sys.stdout.writelines(difflib.unified_diff(have.splitlines(True), want.splitlines(True),
                                                       str(out), "generated"))
            print(f"{out} is out of date: run `python -m rlflow.pipeline.dvc`", file=sys.stderr)
            stale = 1
        else:
            from rlflow.atomic import write_text

            out.parent.mkdir(parents=True, exist_ok=True)
            write_text(out, want)
            print(f"wrote {out}")
    return stale


if __name__ == "__main__":
    sys.exit(main())
