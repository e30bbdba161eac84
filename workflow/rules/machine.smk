# The machine track (docs/pipeline-tracks.md): this machine's own cost target (cost.target=machine: ort-cpu on a CPU
# box, cuda on a GPU box). measure_costs_machine, search_taso_machine, search_greedy_machine and search_eqsat_machine
# run the configured track's stage code with cost.target=machine fixed -> results/costs/<device>/machine/<model>.json
# and results/<model>/machine/<method>/; search_ortopt runs onnxruntime's offline transformer optimizer (the
# baseline ort_optimizer). evaluate times all their graphs beside the configured track's.
# Code: src/rlflow/stages/measure_costs.py, search_taso.py, search_greedy.py, search_eqsat.py, search_ortopt.py.
# Paths, command line and config keys: STAGES[...] (on_machine) in src/rlflow/pipeline/registry.py.


rule measure_costs_machine:
    input:
        unpack(stage_input("measure_costs_machine")),
    output:
        **stage_output("measure_costs_machine"),
    params:
        **stage_params("measure_costs_machine"),
    log:
        stage_log("measure_costs_machine"),
    benchmark:
        stage_benchmark("measure_costs_machine")
    priority: stage_priority("measure_costs_machine")
    conda:
        stage_conda("measure_costs_machine")
    threads: stage_threads("measure_costs_machine")
    shell:
        stage_shell("measure_costs_machine")


rule search_taso_machine:
    input:
        unpack(stage_input("search_taso_machine")),
    output:
        **stage_output("search_taso_machine"),
    params:
        **stage_params("search_taso_machine"),
    log:
        stage_log("search_taso_machine"),
    benchmark:
        stage_benchmark("search_taso_machine")
    priority: stage_priority("search_taso_machine")
    conda:
        stage_conda("search_taso_machine")
    shell:
        stage_shell("search_taso_machine")


rule search_greedy_machine:
    input:
        unpack(stage_input("search_greedy_machine")),
    output:
        **stage_output("search_greedy_machine"),
    params:
        **stage_params("search_greedy_machine"),
    log:
        stage_log("search_greedy_machine"),
    benchmark:
        stage_benchmark("search_greedy_machine")
    priority: stage_priority("search_greedy_machine")
    conda:
        stage_conda("search_greedy_machine")
    shell:
        stage_shell("search_greedy_machine")


rule search_eqsat_machine:
    input:
        unpack(stage_input("search_eqsat_machine")),
    output:
        **stage_output("search_eqsat_machine"),
    params:
        **stage_params("search_eqsat_machine"),
    log:
        stage_log("search_eqsat_machine"),
    benchmark:
        stage_benchmark("search_eqsat_machine")
    priority: stage_priority("search_eqsat_machine")
    conda:
        stage_conda("search_eqsat_machine")
    shell:
        stage_shell("search_eqsat_machine")


rule search_ortopt:
    input:
        unpack(stage_input("search_ortopt")),
    output:
        **stage_output("search_ortopt"),
    params:
        **stage_params("search_ortopt"),
    log:
        stage_log("search_ortopt"),
    benchmark:
        stage_benchmark("search_ortopt")
    priority: stage_priority("search_ortopt")
    conda:
        stage_conda("search_ortopt")
    shell:
        stage_shell("search_ortopt")


# With machine.agents on (configs/paper.yaml): the RL agents again, for this machine's target -> the methods
# rlflow_machine and model_free_machine (results/<model>/machine/controller/, machine/model_free/), from their own
# rollouts, encoder and world model under results/<model>/machine/. Code: the configured track's stage modules
# (collect_rollouts.py, merge_rollouts.py, train_encoder.py, train_world_model.py, train_model_free.py,
# train_controller.py).

rule collect_rollouts_machine:
    input:
        unpack(stage_input("collect_rollouts_machine")),
    output:
        **stage_output("collect_rollouts_machine"),
    params:
        **stage_params("collect_rollouts_machine"),
    log:
        stage_log("collect_rollouts_machine"),
    benchmark:
        stage_benchmark("collect_rollouts_machine")
    priority: stage_priority("collect_rollouts_machine")
    conda:
        stage_conda("collect_rollouts_machine")
    threads: stage_threads("collect_rollouts_machine")
    shell:
        stage_shell("collect_rollouts_machine")


rule merge_rollouts_machine:
    input:
        unpack(stage_input("merge_rollouts_machine")),
    output:
        **stage_output("merge_rollouts_machine"),
    params:
        **stage_params("merge_rollouts_machine"),
    log:
        stage_log("merge_rollouts_machine"),
    benchmark:
        stage_benchmark("merge_rollouts_machine")
    priority: stage_priority("merge_rollouts_machine")
    conda:
        stage_conda("merge_rollouts_machine")
    threads: stage_threads("merge_rollouts_machine")
    shell:
        stage_shell("merge_rollouts_machine")


rule train_encoder_machine:
    input:
        unpack(stage_input("train_encoder_machine")),
    output:
        **stage_output("train_encoder_machine"),
    params:
        **stage_params("train_encoder_machine"),
    log:
        stage_log("train_encoder_machine"),
    benchmark:
        stage_benchmark("train_encoder_machine")
    priority: stage_priority("train_encoder_machine")
    conda:
        stage_conda("train_encoder_machine")
    threads: stage_threads("train_encoder_machine")
    shell:
        stage_shell("train_encoder_machine")


rule train_world_model_machine:
    input:
        unpack(stage_input("train_world_model_machine")),
    output:
        **stage_output("train_world_model_machine"),
    params:
        **stage_params("train_world_model_machine"),
    log:
        stage_log("train_world_model_machine"),
    benchmark:
        stage_benchmark("train_world_model_machine")
    priority: stage_priority("train_world_model_machine")
    conda:
        stage_conda("train_world_model_machine")
    threads: stage_threads("train_world_model_machine")
    shell:
        stage_shell("train_world_model_machine")


rule train_model_free_machine:
    input:
        unpack(stage_input("train_model_free_machine")),
    output:
        **stage_output("train_model_free_machine"),
    params:
        **stage_params("train_model_free_machine"),
    log:
        stage_log("train_model_free_machine"),
    benchmark:
        stage_benchmark("train_model_free_machine")
    priority: stage_priority("train_model_free_machine")
    conda:
        stage_conda("train_model_free_machine")
    threads: stage_threads("train_model_free_machine")
    shell:
        stage_shell("train_model_free_machine")


rule train_controller_machine:
    input:
        unpack(stage_input("train_controller_machine")),
    output:
        **stage_output("train_controller_machine"),
    params:
        **stage_params("train_controller_machine"),
    log:
        stage_log("train_controller_machine"),
    benchmark:
        stage_benchmark("train_controller_machine")
    priority: stage_priority("train_controller_machine")
    conda:
        stage_conda("train_controller_machine")
    threads: stage_threads("train_controller_machine")
    shell:
        stage_shell("train_controller_machine")
