# Stages report (results/<model>/report.html: one self-contained HTML file with the paper's tables and figures
# and this run's numbers) and summary (results/summary.csv and .html: every model that was evaluated).
# Code: src/rlflow/stages/report.py, src/rlflow/stages/summary.py (and src/rlflow/report/). Paths, command line
# and config keys: STAGES[...] in src/rlflow/pipeline/registry.py.


rule report:
    input:
        unpack(stage_input("report")),
    output:
        **stage_output("report"),
    params:
        **stage_params("report"),
    log:
        stage_log("report"),
    benchmark:
        stage_benchmark("report")
    priority: stage_priority("report")
    conda:
        stage_conda("report")
    shell:
        stage_shell("report")


rule summary:
    input:
        unpack(stage_input("summary")),
    output:
        **stage_output("summary"),
    params:
        **stage_params("summary"),
    log:
        stage_log("summary"),
    benchmark:
        stage_benchmark("summary")
    priority: stage_priority("summary")
    conda:
        stage_conda("summary")
    shell:
        stage_shell("summary")
