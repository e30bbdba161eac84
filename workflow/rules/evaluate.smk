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
    conda:
        stage_conda("evaluate")
    threads: stage_threads("evaluate")
    shell:
        stage_shell("evaluate")
