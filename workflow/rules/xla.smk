# XLA pass ordering (issue I): export_hlo (results/<model>/xla/module.hlo, the JAX lowering of the model's ONNX
# graph, weights in full), train_pass_agent (one PPO agent per xla.variants on the HLO of every model in
# xla.train_models -> results/xla/agent-<variant>.pt) and evaluate_passes (per model: the agents vs XLA's default
# pipeline, random orders and greedy -> results/<model>/xla/passes.json and .csv). Not in `rule all`: every pass
# step is a real XLA compile of the whole module (about 30 s on paper-size ResNet-18, whose HLO with its weights
# is 210 MB), so build them on purpose:
#   snakemake xla --cores 2                                        every model in config `models`
#   snakemake xla --cores 2 --configfile tests/configs/tiny.yaml   tiny sizes (a few minutes)
# Code: src/rlflow/stages/{export_hlo,train_pass_agent,evaluate_passes}.py; paths, command lines and config keys:
# STAGES[...] in src/rlflow/pipeline/registry.py.


rule export_hlo:
    input:
        unpack(stage_input("export_hlo")),
    output:
        **stage_output("export_hlo"),
    params:
        **stage_params("export_hlo"),
    log:
        stage_log("export_hlo"),
    benchmark:
        stage_benchmark("export_hlo")
    priority: stage_priority("export_hlo")
    conda:
        stage_conda("export_hlo")
    shell:
        stage_shell("export_hlo")


rule train_pass_agent:
    input:
        unpack(stage_input("train_pass_agent")),
    output:
        **stage_output("train_pass_agent"),
    params:
        **stage_params("train_pass_agent"),
    log:
        stage_log("train_pass_agent"),
    benchmark:
        stage_benchmark("train_pass_agent")
    priority: stage_priority("train_pass_agent")
    conda:
        stage_conda("train_pass_agent")
    shell:
        stage_shell("train_pass_agent")


rule evaluate_passes:
    input:
        unpack(stage_input("evaluate_passes")),
    output:
        **stage_output("evaluate_passes"),
    threads: stage_threads("evaluate_passes")
    params:
        **stage_params("evaluate_passes"),
    log:
        stage_log("evaluate_passes"),
    benchmark:
        stage_benchmark("evaluate_passes")
    priority: stage_priority("evaluate_passes")
    conda:
        stage_conda("evaluate_passes")
    shell:
        stage_shell("evaluate_passes")


# Target: the XLA pass-ordering results of every model in config `models` (`snakemake xla --cores 2`).
rule xla:
    input:
        stage_targets("evaluate_passes", config["models"]),
