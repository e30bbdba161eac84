"""RLFlow: verified graph rewrites chosen by a world-model RL agent, as a reproducible pipeline.

The Python API (:mod:`rlflow.api`)::

    import rlflow

    fast = rlflow.optimize("model.onnx")      # an onnx.ModelProto, checked equal to the original, never slower
    rlflow.save(fast, "fast.onnx")
    rlflow.estimate_cost(fast, target="sim-h100")["runtime_ms"]

``rlflow.load`` reads a model into rlflow's graph. The names are imported on first use, so ``import rlflow``
stays cheap (the pipeline's Snakefile imports it).
"""

__version__ = "0.1.0"

_API = ("optimize", "estimate_cost", "load", "save", "Optimiser")
__all__ = ["__version__", *_API]


def __getattr__(name: str):
    if name in _API:
        # importlib, not an import statement: the pipeline's code dependencies are the import statements a stage's
        # module reaches (rlflow.pipeline.imports), and every stage runs this file; none of them uses the API
        import importlib

        return getattr(importlib.import_module("rlflow.api"), name)
    raise AttributeError(f"module 'rlflow' has no attribute '{name}'")
