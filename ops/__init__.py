"""Mojo kernels for MAX, called from PyTorch: the p22 puzzle ops and a LayerNorm library. ``ops.apply_to(model)``
puts the library's norms into a model you have (``ops/apply.py``)."""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    """``apply_to``, imported when first asked for: the puzzle's scripts import ``ops`` without the library."""
    if name == "apply_to":
        from ops.apply import apply_to

        return apply_to
    raise AttributeError(f"module 'ops' has no attribute {name!r}")
