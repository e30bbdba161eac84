# Helpers shared by the .smk files (config validation, wildcard patterns) and accessors for the stage
# registry (src/rlflow/pipeline/registry.py). The registry is the ONE place where each stage's files, command
# line and config keys are declared; dvc.yaml is generated from it too (python -m rlflow.pipeline.dvc).
#
# How a job gets its config: Snakemake merges config.yaml (the Snakefile's configfile), then every
# --configfile (e.g. tests/configs/tiny.yaml), then --config KEY=VALUE. Each config key a stage reads becomes
# a rule param and is passed to the job as `--set KEY=VALUE`, so the job sees exactly the merged, validated
# values, reads no undeclared file, and the `params` rerun-trigger fires when one of them changes.
import sys
from pathlib import Path

from snakemake.exceptions import WorkflowError
from snakemake.utils import validate

# Parse with this checkout's registry even where rlflow is not installed (e.g. a bare snakemake env).
sys.path.insert(0, str(Path(workflow.basedir) / "src"))
from rlflow.config import check_models, validate as validate_config  # noqa: E402
from rlflow.errors import RLFlowError  # noqa: E402
from rlflow.pipeline import registry  # noqa: E402

# Validate the merged config before any job is scheduled. rlflow's check (same schema file) first, because
# it names the bad key in one line where Snakemake would print the whole config; then Snakemake's own,
# which also fills the schema defaults into `config`.
try:
    validate_config(config, "config (config.yaml + --configfile/--config)")
    check_models(config, "config (config.yaml + --configfile/--config)")
except RLFlowError as e:
    raise WorkflowError(str(e)) from None
validate(config, "../schemas/config.schema.yaml")

# Wildcard values allowed (the Snakefile applies them to every rule): model is a zoo model's name or an own
# model's (config zoo.NAME.onnx), shard an integer.
WILDCARD_PATTERNS = registry.wildcard_patterns(config)


def stage_input(name):
    """Named inputs: the stage's input files (a list where the stage expands over a config list, e.g. the
    rollout shards) and, as `code`, the source files its outputs depend on."""
    st = registry.stage(name)
    code = st.code_files()
    return lambda wildcards: {**st.input_paths(config, device=config["device"], **wildcards), "code": code}


def stage_output(name):
    """Output patterns; config fields (`{device}`) filled in, wildcards (`{model}`, `{shard}`) kept; a folder
    output (e.g. a dvclive log folder) as `directory()`."""
    st = registry.stage(name)
    return {k: directory(v) if k in st.folders else v for k, v in st.output_paths(device=config["device"]).items()}


def stage_params(name):
    """One param per config key the stage reads, encoded for `--set KEY=VALUE`."""
    st = registry.stage(name)
    return {
        pname: (lambda wildcards, pname=pname: st.param_values(config, **wildcards)[pname])
        for pname in st.params
    }


def stage_log(name):
    return registry.stage(name).log


def stage_benchmark(name):
    return registry.stage(name).benchmark


def stage_priority(name):
    return registry.stage(name).priority


def stage_conda(name):
    """The env file, relative to this rules folder (Snakemake resolves `conda:` relative to the rule file)."""
    return str(Path("../..") / registry.stage(name).conda)


def stage_threads(name):
    """Every core for a stage that times ops (nothing runs beside it), else the processes it runs at once. Under a
    cluster executor without --cores (e.g. the SLURM profile) there is no machine-wide core count: a job gets the
    stage's own count, and the profile's `cpus_per_task` says how many cores SLURM gives it."""
    st = registry.stage(name)
    try:
        cores = workflow.cores
    except WorkflowError:
        return st.cores
    return cores if st.all_cores else min(st.cores, cores)


def stage_shell(name):
    return registry.stage(name).snakemake_shell(config)


def stage_targets(name, models):
    """The outputs of stage `name` for each model (and each shard id in config, for a sharded stage), for
    `rule all`; a stage without wildcards has one set."""
    st = registry.stage(name)
    combos = [{}]
    for w in st.wildcards:
        values = models if w == "model" else registry.get(config, registry.WILDCARD_CONFIG[w])
        combos = [{**c, w: v} for c in combos for v in values]
    return [path for c in combos for path in st.output_paths(device=config["device"], **c).values()]


def dvc_stage_name(job):
    """The DVC stage a Snakemake job is (`export_model@bert`, `multi/dvc.yaml:report_multi`): Stage.dvc_address."""
    st = registry.stage(job.rule.name)
    return st.dvc_address({w: job.wildcards[w] for w in st.wildcards})


def dvc_commit(config):
    """Record the outputs of every stage in this run's DAG (the targets and all they depend on, which Snakemake
    has just made or found up to date) in dvc.lock, as `dvc commit --force --no-relink` does, in one pass
    (rlflow.pipeline.dvc.commit). Only when the run's config is exactly config.yaml's (with schema defaults): DVC
    reads its params from config.yaml, and a lock recording values that were not used would make `dvc status` lie."""
    import importlib.util
    import subprocess
    import sys

    from rlflow.config import load_config

    if config != load_config(Path(workflow.basedir) / registry.CONFIG_FILE):
        print("dvc: not recording this run in dvc.lock: its config differs from config.yaml (--configfile/--config)")
        return
    if importlib.util.find_spec("dvc") is None:
        print(f"dvc: not recording this run in dvc.lock: DVC is not installed in Snakemake's Python ({sys.executable})")
        return
    by_defined = {True: set(), False: set()}  # does dvc.yaml define the job's stage?
    for job in workflow.dag.jobs:
        if job.rule.name in registry.STAGES:
            defined = registry.stage(job.rule.name).dvc_defines(job.wildcards, config)
            by_defined[defined].add(dvc_stage_name(job))
    if by_defined[False]:
        print(f"dvc: not recording {', '.join(sorted(by_defined[False]))}: dvc.yaml only runs over config.yaml's "
              "lists (`models`, `rollouts.shards`, ...) and switched-on stages; add the value there to version its outputs")
    stages = sorted(by_defined[True])
    if not stages:
        return
    print(f"dvc: recording {len(stages)} stage{'' if len(stages) == 1 else 's'} in dvc.lock (dvc commit) ...", flush=True)
    proc = subprocess.run([sys.executable, "-m", "rlflow.pipeline.dvc", "--commit", *stages], cwd=workflow.basedir,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        # the results are fine; only their DVC record failed: say so, do not fail the run
        print(f"dvc: recording failed (exit {proc.returncode}): {proc.stderr.strip() or proc.stdout.strip()}")
    else:
        print("dvc: done; `dvc status` now reports these stages up to date")
