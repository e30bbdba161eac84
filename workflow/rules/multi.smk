# The multi-model agent (issue K): train_multi_model trains one model-free agent on every model in
# multi_model.train_models (one encoder on all their rollouts, PPO on real environments of all of them) and runs
# it zero-shot on those and on multi_model.heldout beside greedy -> results/multi/{agent.pt,encoder.pt,metrics.json}.
# Not in `rule all` (it exports, costs and rolls out models beyond config `models`); build it on purpose:
#   snakemake multi --cores 2
#   snakemake multi --cores 2 --configfile tests/configs/tiny.yaml   tiny sizes
# Code: src/rlflow/stages/train_multi_model.py (the loops: src/rlflow/agents/multi_model.py); paths, command line
# and config keys: STAGES["train_multi_model"] in src/rlflow/pipeline/registry.py.


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


# Target: the multi-model agent and its held-out results (`snakemake multi --cores 2`).
rule multi:
    input:
        stage_targets("train_multi_model", []),
