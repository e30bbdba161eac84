# Targets beyond `rule all` (in the Snakefile): groups of stages built on purpose.


# The multi-model agent: train_multi_model trains one model-free agent on every model in multi_model.train_models
# (one encoder on all their rollouts, PPO on real environments of all of them) and runs it zero-shot on those and
# on multi_model.heldout beside greedy -> results/multi/{agent.pt,encoder.pt,metrics.json}; report_multi draws
# results/multi/report.html. Not in `rule all` (it exports, costs and rolls out models beyond config `models`):
#   snakemake multi --cores 2
#   snakemake multi --cores 2 --configfile tests/configs/tiny.yaml   tiny sizes
rule multi:
    input:
        stage_targets("train_multi_model", []),
        stage_targets("report_multi", []),


# XLA pass ordering: export_hlo (results/<model>/xla/module.hlo, the JAX lowering of the model's ONNX graph),
# export_hlo_suite (the HLO suite of xla.suite, split by family -> results/xla/suite/ and results/xla/suite.json),
# train_pass_agent (one PPO agent per xla.variants on the suite's training split, or with xla.train_on=models on
# the HLO of xla.train_models -> results/xla/agent-<variant>.pt), evaluate_passes (per model: the agents vs XLA's
# default pipeline, random orders and greedy -> results/<model>/xla/passes.json and .csv) and
# evaluate_passes_suite (the same on every held-out module of the suite -> results/xla-suite/passes.json and
# .csv). Not in `rule all`: every pass step is a real XLA
# compile of the whole module (about 30 s on paper-size ResNet-18), so build them on purpose:
#   snakemake xla --cores 2                                        every model in config `models`
#   snakemake xla --cores 2 --configfile tests/configs/tiny.yaml   tiny sizes (a few minutes)
rule xla:
    input:
        stage_targets("evaluate_passes", config["models"]),
        stage_targets("export_hlo_suite", config["models"]),
        stage_targets("evaluate_passes_suite", config["models"]),
