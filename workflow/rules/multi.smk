# The multi-model agent (issue K): train_multi_model trains one model-free agent on every model in
# multi_model.train_models (one encoder on all their rollouts, PPO on real environments of all of them) and runs
# it zero-shot on those and on multi_model.heldout beside greedy -> results/multi/{agent.pt,encoder.pt,metrics.json};
# report_multi draws results/multi/report.html from the metrics.
# Not in `rule all` (it exports, costs and rolls out models beyond config `models`); build it on purpose:
#   snakemake multi --cores 2
#   snakemake multi --cores 2 --configfile tests/configs/tiny.yaml   tiny sizes
# Code: src/rlflow/stages/train_multi_model.py (the loops: src/rlflow/agents/multi_model.py) and
# src/rlflow/stages/report_multi.py (the page: src/rlflow/report/multi.py); paths, command line and config keys:
# STAGES["train_multi_model"] and STAGES["report_multi"] in src/rlflow/pipeline/registry.py.


rule train_multi_model:
    input:
        unpack(stage_input("train_multi_model")),
    output:
        **stage_output("train_multi_model"),
    params:
        **stage_params("train_multi_model"),
    log:
        stage_log("train_multi_model"),
    benchmark:
        stage_benchmark("train_multi_model")
    priority: stage_priority("train_multi_model")
    conda:
        stage_conda("train_multi_model")
    shell:
        stage_shell("train_multi_model")


rule report_multi:
    input:
        unpack(stage_input("report_multi")),
    output:
        **stage_output("report_multi"),
    params:
        **stage_params("report_multi"),
    log:
        stage_log("report_multi"),
    benchmark:
        stage_benchmark("report_multi")
    priority: stage_priority("report_multi")
    conda:
        stage_conda("report_multi")
    shell:
        stage_shell("report_multi")


# Target: the multi-model agent, its held-out results and its page (`snakemake multi --cores 2`).
rule multi:
    input:
        stage_targets("train_multi_model", []),
        stage_targets("report_multi", []),
