"""RLFlow: verified graph rewrites chosen by a world-model RL agent, as a reproducible pipeline."""

__version__ = "0.1.0"
