# Stage measure_costs: time each op signature of the model (and of graphs a few rewrites away) on the device
# -> results/costs/<device>/<model>.json, the measured cost model's cache.
# Code: src/rlflow/stages/measure_costs.py (`rlflow measure-costs --help`); the cost models: src/rlflow/cost/.
# Paths, command line and config keys: STAGES["measure_costs"] in src/rlflow/pipeline/registry.py.


rule measure_costs:
    input:
        unpack(stage_input("measure_costs")),
    output:
        **stage_output("measure_costs"),
    threads: stage_threads("measure_costs")
    params:
        **stage_params("measure_costs"),
    log:
        stage_log("measure_costs"),
    benchmark:
        stage_benchmark("measure_costs")
    priority: stage_priority("measure_costs")
    conda:
        stage_conda("measure_costs")
    shell:
        stage_shell("measure_costs")
