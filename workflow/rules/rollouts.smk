# Stages collect_rollouts (one job per model and shard id in config rollouts.shards; they run in parallel) and
# merge_rollouts (joins a model's shards) -> results/<model>/rollouts.json: random-agent episodes in the rewrite
# environment (actions, per-step metrics, per-xfer location counts, done), and rollouts.graphs.npz: the graph of
# every step (train_encoder reads them instead of replaying every episode). Reward settings are NOT inputs.
# Code: src/rlflow/stages/collect_rollouts.py, src/rlflow/stages/merge_rollouts.py; the env: src/rlflow/env/.
# Paths, command line and config keys: STAGES[...] in src/rlflow/pipeline/registry.py.


rule collect_rollouts:
    input:
        unpack(stage_input("collect_rollouts")),
    output:
        **stage_output("collect_rollouts"),
    params:
        **stage_params("collect_rollouts"),
    log:
        stage_log("collect_rollouts"),
    benchmark:
        stage_benchmark("collect_rollouts")
    priority: stage_priority("collect_rollouts")
    conda:
        stage_conda("collect_rollouts")
    shell:
        stage_shell("collect_rollouts")


rule merge_rollouts:
    input:
        unpack(stage_input("merge_rollouts")),
    output:
        **stage_output("merge_rollouts"),
    params:
        **stage_params("merge_rollouts"),
    log:
        stage_log("merge_rollouts"),
    benchmark:
        stage_benchmark("merge_rollouts")
    priority: stage_priority("merge_rollouts")
    conda:
        stage_conda("merge_rollouts")
    shell:
        stage_shell("merge_rollouts")
