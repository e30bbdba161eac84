"""Tensor types: a value's static shape and element type. Imported by the IR and the op registry alike (the op
registry infers types without knowing the graph)."""

from __future__ import annotations

from dataclasses import dataclass

DTYPE_BYTES = {"float32": 4, "float64": 8, "float16": 2, "int64": 8, "int32": 4, "int8": 1, "uint8": 1, "bool": 1}
FLOAT_DTYPES = ("float16", "float32", "float64")  # the floating-point element types of the IR


@dataclass(frozen=True, slots=True)
class TensorType:
    """A tensor's static shape and element type (``float32`` for everything the rewrites touch)."""

    shape: tuple[int, ...]
    dtype: str = "float32"

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_BYTES[self.dtype]

    def __str__(self) -> str:
        return f"{self.dtype}[{'x'.join(map(str, self.shape))}]"
