# Stage export_model: zoo model (torch) -> ONNX.
# Code: src/rlflow/stages/export_model.py (`rlflow export-model --help`).
# Paths, command line and config keys: STAGES["export_model"] in src/rlflow/pipeline/registry.py.


rule export_model:
    input:
        unpack(stage_input("export_model")),
    output:
        **stage_output("export_model"),
    params:
        **stage_params("export_model"),
    log:
        stage_log("export_model"),
    benchmark:
        stage_benchmark("export_model")
    priority: stage_priority("export_model")
    conda:
        stage_conda("export_model")
    shell:
        stage_shell("export_model")
