# make run   set up .venv (once) and run the pipeline's rule all for config.yaml's models: every stage, up to
#            results/<model>/report.html and results/summary.html
# make test  set up .venv (once) and run the test suite (the project's one test command; CI runs it)
# make test-cluster  the tiny pipeline on a one-node SLURM cluster started on this machine through the SLURM
#            profile (tests/test_cluster_slurm.py, docs/cluster.md): installs the executor plugin
#            (envs/requirements-cluster.txt) and, where missing, Debian's SLURM packages (it skips without root
#            or apt-get). Not part of `make test`.
# make gpu-wheels  download into .whl/ (git-ignored, ~42 MiB) the wheels the lent GPU machine's image lacks, from
#            envs/gpu-check-wheels.txt: install there with pip install --no-index --no-deps --target DIR .whl/*.whl
#
# Setup: python3 -m venv .venv, then torch==2.13.0 FIRST in its own pip call (an unpinned torch, or one pulled
# in by another package, would be the multi-GB CUDA build), then the requirements, then rlflow itself without
# dependencies. A stamp file makes later runs skip the installs until a requirements file changes. The
# requirements go through uv (installed into the venv by pip): it unpacks and byte-compiles on every core, where
# pip does one file at a time; torch==2.13.0 is named again so that uv keeps the one installed. (pip's
# --no-compile made setup 1 min shorter but moved the byte-compiling into the pipeline's first imports, several
# jobs at once: the fresh-clone make run was no shorter.)

PYTHON ?= python3
# Where pip takes torch from. Empty: PyPI, whose Linux torch is the CUDA build (several GB). A CPU-only machine can
# take the CPU build instead: make setup TORCH_INDEX=https://download.pytorch.org/whl/cpu
TORCH_INDEX ?=
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.rlflow-installed
# The venv's bin first on PATH for everything the recipes start (snakemake's jobs call `rlflow`); the tools
# themselves are named by path too, because make 4.3 looks commands up on its own, unmodified PATH.
export PATH := $(CURDIR)/$(BIN):$(PATH)

.PHONY: run test test-install test-cluster setup setup-gpu setup-tf-gpu lint dvc-yaml default-rules clean gpu-wheels

run: $(STAMP)
	$(BIN)/snakemake --cores all

test: $(STAMP)
	$(BIN)/pytest -q -n auto --dist loadfile --durations=15

# pip install . into a clean venv (torch first), then rlflow optimize with no other file (about 2 minutes with
# pip's cache warm; it downloads about 40 packages once)
test-install: $(STAMP)
	$(BIN)/pytest -q --run-install tests/test_install.py

test-cluster: $(STAMP)
	$(BIN)/python -m pip install -q -r envs/requirements-cluster.txt
	$(BIN)/pytest -v -rsP --durations=3 --run-cluster tests/test_cluster_slurm.py

setup: $(STAMP)

$(STAMP): pyproject.toml setup.py envs/requirements.txt envs/requirements-test.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install torch==2.13.0 $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(BIN)/python -m pip install uv==0.13.9
	$(BIN)/uv pip install --python $(BIN)/python --compile-bytecode torch==2.13.0 \
		-r envs/requirements.txt -r envs/requirements-test.txt
	$(BIN)/python -m pip install --no-deps -e .
	touch $@

# The GPU box (docs/gpu.md): .venv with PyPI's torch==2.13.0 (the CUDA 13 build; a CPU build already there is
# replaced) and envs/requirements-gpu.txt (onnxruntime-gpu, jax with CUDA 13; the CPU onnxruntime is removed
# first: both install the module onnxruntime). Then `make run` as usual. It marks the CPU setup done too.
setup-gpu: $(VENV)/.rlflow-installed-gpu

$(VENV)/.rlflow-installed-gpu: pyproject.toml setup.py envs/requirements-gpu.txt envs/requirements-test.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install torch==2.13.0
	$(BIN)/python -c 'import sys, torch; sys.exit(torch.version.cuda is None)' || \
		$(BIN)/python -m pip install --force-reinstall torch==2.13.0
	$(BIN)/python -m pip uninstall -y onnxruntime
	$(BIN)/python -m pip install -r envs/requirements-gpu.txt -r envs/requirements-test.txt
	$(BIN)/python -m pip install --no-deps -e .
	touch $(STAMP) $@

# TensorFlow on the GPU, in an env of its own (no TensorFlow release uses torch 2.13's CUDA 13):
# .venv-tf with torch's CPU build and envs/requirements-tensorflow-gpu.txt; run with `make run VENV=.venv-tf`
setup-tf-gpu: .venv-tf/.rlflow-installed-tf-gpu

.venv-tf/.rlflow-installed-tf-gpu: pyproject.toml setup.py envs/requirements-tensorflow-gpu.txt envs/requirements-test.txt
	test -x .venv-tf/bin/python || $(PYTHON) -m venv .venv-tf
	.venv-tf/bin/python -m pip install torch==2.13.0 --index-url $(or $(TORCH_INDEX),https://download.pytorch.org/whl/cpu)
	.venv-tf/bin/python -m pip install -r envs/requirements-tensorflow-gpu.txt -r envs/requirements-test.txt
	.venv-tf/bin/python -m pip install --no-deps -e .
	touch .venv-tf/.rlflow-installed $@

# snakemake's linter (also a test)
lint: $(STAMP)
	$(BIN)/snakemake --lint

# regenerate dvc.yaml from the stage registry (src/rlflow/pipeline/registry.py)
dvc-yaml: $(STAMP)
	$(BIN)/python -m rlflow.pipeline.dvc

# remake the rule set shipped with the package (rlflow optimize's default): the generate_rules stage with
# config.yaml, gzipped; tests/test_rules_file.py checks that the shipped file equals a fresh generation
default-rules: $(STAMP)
	$(BIN)/rlflow generate-rules --config config.yaml --out build/default-rules/rules.json
	gzip -9 -n -c build/default-rules/rules.json > src/rlflow/rewrite/data/default_rules.json.gz
	$(BIN)/python -m rlflow.pipeline.default_rules --config config.yaml --write

# fill .whl/ with the py3.12 manylinux x86_64 wheels the lent GPU machine lacks (envs/gpu-check-wheels.txt; sdist-only pins are built)
GPU_WHEEL_PLATFORMS := manylinux_2_34_x86_64 manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_26_x86_64 \
	manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_5_x86_64 manylinux1_x86_64
gpu-wheels:
	rm -rf .whl && mkdir .whl  # fresh each time: one version of each pin, nothing stale
	set -e; for pin in $$(sed -e 's/#.*//' envs/gpu-check-wheels.txt); do \
	  $(PYTHON) -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	    $(addprefix --platform ,$(GPU_WHEEL_PLATFORMS)) -d .whl "$$pin" \
	  || { echo "gpu-wheels: no wheel of $$pin on the index (the ERROR above): building a py3-none-any one"; \
	       $(PYTHON) -m pip wheel --quiet --no-deps --no-binary="$${pin%%==*}" -w .whl "$$pin"; }; \
	done
	@ls .whl/*.whl | wc -l; du -sh .whl

# remove pipeline outputs and snakemake's bookkeeping (not the DVC cache or remote)
clean:
	rm -rf results .snakemake
