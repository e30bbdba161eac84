# Stage evaluate: the original graph and every method's optimised graph (taso, greedy, eqsat, model_free, rlflow) on
# every backend (onnxruntime, torch, TensorFlow, TensorFlow-XLA) -> results/<model>/evaluation.csv, metrics.json (DVC
# metrics) and results/summary/<model>.json. Fails, writing nothing, if any optimised graph's outputs differ.
# Code: src/rlflow/stages/evaluate.py (and src/rlflow/evaluation/). Paths, command line and config keys:
# STAGES["evaluate"] in src/rlflow/pipeline/registry.py.


rule evaluate:
    input:
        unpack(stage_input("evaluate")),
    output:
        **stage_output("evaluate"),
    params:
        **stage_params("evaluate"),
    log:
        stage_log("evaluate"),
    benchmark:
        stage_benchmark("evaluate")
    priority: stage_priority("evaluate")
    conda:
        stage_conda("evaluate")
    threads: stage_threads("evaluate")
    shell:
        stage_shell("evaluate")


# Stage generalise: each trained agent (model_free, the RLFlow controller) run zero-shot on the shapes in
# generalise.variants.<model> -> results/<model>/generalise.json (improvement kept per variant; greedy beside).
# The shape they trained on is read from their own stages' traces; the variants run two at a time.
# Code: src/rlflow/stages/generalise.py. Paths, command line and config keys: STAGES["generalise"] in
# src/rlflow/pipeline/registry.py.


rule generalise:
    input:
        unpack(stage_input("generalise")),
    output:
        **stage_output("generalise"),
    params:
        **stage_params("generalise"),
    log:
        stage_log("generalise"),
    benchmark:
        stage_benchmark("generalise")
    threads: stage_threads("generalise")
    priority: stage_priority("generalise")
    conda:
        stage_conda("generalise")
    shell:
        stage_shell("generalise")
