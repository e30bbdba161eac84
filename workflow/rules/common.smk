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
from rlflow.config import validate as validate_config  # noqa: E402
from rlflow.errors import RLFlowError  # noqa: E402
from rlflow.pipeline import registry  # noqa: E402

# Validate the merged config before any job is scheduled. rlflow's check (same schema file) first, because
# it names the bad key in one line where Snakemake would print the whole config; then Snakemake's own,
# which also fills the schema defaults into `config`.
try:
    validate_config(config, "config (config.yaml + --configfile/--config)")
except RLFlowError as e:
    raise WorkflowError(str(e)) from None
validate(config, "../schemas/config.schema.yaml")

MODELS = registry.model_names()
# Wildcard values allowed (the Snakefile applies them to every rule): model is a zoo model name, shard an integer.
WILDCARD_PATTERNS = registry.wildcard_patterns()


def stage_input(name):
    """Named inputs: the stage's input files (a list where the stage expands over a config list, e.g. the
    rollout shards) and, as `code`, the source files its outputs depend on."""
    st = registry.stage(name)
    code = st.code_files(workflow.basedir)
    return lambda wildcards: {**st.input_paths(config, device=config["device"], **wildcards), "code": code}


def stage_output(name):
    """Output patterns; config fields (`{device}`) filled in, wildcards (`{model}`, `{shard}`) kept."""
    return registry.stage(name).output_paths(device=config["device"])


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


def stage_conda(name):
    """The env file, relative to this rules folder (Snakemake resolves `conda:` relative to the rule file)."""
    return str(Path("../..") / registry.stage(name).conda)


def stage_threads(name):
    """Every core for a stage that times ops (nothing runs beside it), else one."""
    return workflow.cores if registry.stage(name).all_cores else 1


def stage_shell(name):
    return registry.stage(name).snakemake_shell()


def stage_targets(name, models):
    """The outputs of stage `name` for each model (and each shard id in config, for a sharded stage), for
    `rule all`; a stage without wildcards has one set."""
    st = registry.stage(name)
    combos = [{}]
    for w in st.wildcards:
        values = models if w == "model" else registry.get(config, registry.WILDCARD_CONFIG[w])
        combos = [{**c, w: v} for c in combos for v in values]
    return [path for c in combos for path in st.output_paths(device=config["device"], **c).values()]
