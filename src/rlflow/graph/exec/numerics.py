"""Full float32 precision for output checks on a GPU.

On Ampere and Hopper GPUs torch runs cuDNN convolutions (and, where asked, matmuls) in TF32 by default: a 10-bit
mantissa, relative errors near 1e-3, far above the 1e-4 the output checks allow. Output checks run inside
:func:`strict_fp32`, which turns TF32 off for torch's matmuls and cuDNN and restores the previous settings after;
timings keep each backend's deployment default (torch: TF32 for cuDNN convolutions, not for matmuls).
"""

from __future__ import annotations

from contextlib import contextmanager


@contextmanager
def strict_fp32():
    """torch matmuls and cuDNN convolutions in full float32 inside the block (no-op where torch is absent)."""
    try:
        import torch
    except ImportError:  # pragma: no cover -- torch is a dependency
        yield
        return
    before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before
