"""User-facing tools that are not pipeline stages (``rlflow inspect``, ``rlflow run``, ...)."""
