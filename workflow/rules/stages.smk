# Every pipeline stage is one Snakemake rule, made here from its entry in the stage registry
# (STAGES in src/rlflow/pipeline/registry.py), which dvc.yaml is generated from too, so the two never drift.
# Rule X runs `rlflow x`, whose code is src/rlflow/stages/X.py; a rule that repeats another stage with config keys
# fixed (sweep_temperature, search_taso_machine, ...) runs that stage's code (its entry's `runs`).
# What each stage makes: `rlflow x --help`, or docs/pipeline.md. Adding a stage takes its registry entry and its
# module (and its config keys in the schema); nothing here.

for _name in registry.STAGES:

    rule:
        name:
            _name
        input:
            unpack(stage_input(_name)),
        output:
            **stage_output(_name),
        params:
            **stage_params(_name),
        log:
            stage_log(_name),
        benchmark:
            stage_benchmark(_name)
        threads: stage_threads(_name)
        priority: stage_priority(_name)
        conda:
            stage_conda(_name)
        shell:
            # Snakemake evaluates this again inside the job's function, when the loop has moved on: there
            # `rule` is the job's rule name
            stage_shell(locals().get("rule", _name))
