# RLFlow experiment pipeline (see README.md, "Pipeline").
#   snakemake --cores 2                           rule all: for every model in config["models"]: ONNX, op costs,
#                                                 TASO and greedy search results, random rollouts; and the rule set
#   snakemake results/vit/model.onnx --cores 2    build one file
#   snakemake --cores 2 --configfile tests/configs/tiny.yaml     tiny sizes, merged over config.yaml
# (Put targets BEFORE --configfile/--config: those options take every word that follows them.)
# Each rule's paths, command line and config keys come from src/rlflow/pipeline/registry.py, which also
# generates dvc.yaml. A rule `X` runs `rlflow x` whose code is src/rlflow/stages/X.py.
from snakemake.utils import min_version

min_version("9.0")


configfile: "config.yaml"


include: "workflow/rules/common.smk"


wildcard_constraints:
    **WILDCARD_PATTERNS,


include: "workflow/rules/export.smk"
include: "workflow/rules/rules.smk"
include: "workflow/rules/costs.smk"
include: "workflow/rules/search.smk"
include: "workflow/rules/rollouts.smk"
include: "workflow/rules/learning.smk"


rule all:
    default_target: True
    input:
        stage_targets("export_model", config["models"]),
        stage_targets("generate_rules", config["models"]),
        stage_targets("search_taso", config["models"]),
        stage_targets("search_greedy", config["models"]),
        stage_targets("merge_rollouts", config["models"]),
