# Stage generate_rules: TASO's substitution generator + numeric verification + pruning, plus the builtin rules
# -> results/rules/rules.json and results/rules/stats.json. One job for the whole pipeline (no wildcards).
# Code: src/rlflow/stages/generate_rules.py (`rlflow generate-rules --help`).
# Paths, command line and config keys (rules.*): STAGES["generate_rules"] in src/rlflow/pipeline/registry.py.


rule generate_rules:
    input:
        unpack(stage_input("generate_rules")),
    output:
        **stage_output("generate_rules"),
    params:
        **stage_params("generate_rules"),
    log:
        stage_log("generate_rules"),
    benchmark:
        stage_benchmark("generate_rules")
    priority: stage_priority("generate_rules")
    conda:
        stage_conda("generate_rules")
    shell:
        stage_shell("generate_rules")
