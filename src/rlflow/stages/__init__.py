"""One module per pipeline stage: parse args, call the library, write outputs atomically.

The stage's Snakemake rule and dvc.yaml stage come from :mod:`rlflow.pipeline.registry`.
"""
