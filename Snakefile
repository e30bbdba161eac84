# RLFlow experiment pipeline (see docs/pipeline.md).
#   snakemake --cores 2                           rule all: results/<model>/report.html for every model in
#                                                 config["models"] (and every stage before it), results/summary.html
#   snakemake results/vit/model.onnx --cores 2    build one file
#   snakemake --cores 2 --configfile tests/configs/tiny.yaml     tiny sizes, merged over config.yaml
# (Put targets BEFORE --configfile/--config: those options take every word that follows them.)
# Each stage's rule is made from its entry in src/rlflow/pipeline/registry.py (workflow/rules/stages.smk), which
# also generates dvc.yaml. A rule `X` runs `rlflow x` whose code is src/rlflow/stages/X.py (the sweep_* rules run
# train_controller with one config key fixed).
from snakemake.utils import min_version

min_version("9.0")


configfile: "config.yaml"


include: "workflow/rules/common.smk"


wildcard_constraints:
    **WILDCARD_PATTERNS,


include: "workflow/rules/stages.smk"
include: "workflow/rules/targets.smk"


rule all:
    default_target: True
    input:
        stage_targets("report", config["models"]),
        stage_targets("summary", config["models"]),
        stage_targets("search_eqsat", config["models"]),
        stage_targets("sweep_temperature", config["models"]),
        stage_targets("sweep_reward", config["models"]),


# After a successful run, record what Snakemake built in DVC's dvc.lock (`dvc commit` of those stages), so that
# `dvc status` calls them up to date and `dvc repro` reruns nothing. Skipped, with a note, when the run's config
# is not config.yaml's (a --configfile/--config override): dvc.lock would then record params that were not used.
onsuccess:
    dvc_commit(config)
