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
