"""The stage registry, which generates both the Snakemake rules' paths and dvc.yaml."""
