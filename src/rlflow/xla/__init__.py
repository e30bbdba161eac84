"""XLA HLO pass ordering: HLO modules, op counts and cost features, XLA's pass list, the crash-isolated worker.

- :mod:`rlflow.xla.hlo`: HLO text -> jaxlib's HloModule; opcode histogram, op count, XLA's cost analysis;
- :mod:`rlflow.xla.passes`: XLA's CPU pass pipeline read from XLA's own log, the target-independent passes;
- :mod:`rlflow.xla.worker`: one pass at a time through XLA's CPU compiler (PJRT plugin, :mod:`rlflow.xla.pjrt`)
  in a child process that is restarted after a crash;
HLO modules of IR graphs come from the JAX lowering of the op registry (:func:`rlflow.graph.exec.jax_exec.hlo_text`).

Needs ``jax``/``jaxlib`` and ``xla-cpu-pjrt`` (envs/requirements.txt); nothing here is imported by the other
floors unless an XLA stage or env is used.
"""
