# Stages search_taso, search_greedy and search_eqsat: the search baselines (no learning) -> results/<model>/<method>/model.onnx
# (verified equal to the original under onnxruntime) and trace.json (rules applied, costs, seconds).
# Code: src/rlflow/stages/search_taso.py, src/rlflow/stages/search_greedy.py,
# src/rlflow/stages/search_eqsat.py; the searches: src/rlflow/search/.
# Paths, command line and config keys: STAGES[...] in src/rlflow/pipeline/registry.py.


rule search_taso:
    input:
        unpack(stage_input("search_taso")),
    output:
        **stage_output("search_taso"),
    params:
        **stage_params("search_taso"),
    log:
        stage_log("search_taso"),
    benchmark:
        stage_benchmark("search_taso")
    priority: stage_priority("search_taso")
    conda:
        stage_conda("search_taso")
    shell:
        stage_shell("search_taso")


rule search_greedy:
    input:
        unpack(stage_input("search_greedy")),
    output:
        **stage_output("search_greedy"),
    params:
        **stage_params("search_greedy"),
    log:
        stage_log("search_greedy"),
    benchmark:
        stage_benchmark("search_greedy")
    priority: stage_priority("search_greedy")
    conda:
        stage_conda("search_greedy")
    shell:
        stage_shell("search_greedy")


rule search_eqsat:
    input:
        unpack(stage_input("search_eqsat")),
    output:
        **stage_output("search_eqsat"),
    params:
        **stage_params("search_eqsat"),
    log:
        stage_log("search_eqsat"),
    benchmark:
        stage_benchmark("search_eqsat")
    priority: stage_priority("search_eqsat")
    conda:
        stage_conda("search_eqsat")
    shell:
        stage_shell("search_eqsat")
