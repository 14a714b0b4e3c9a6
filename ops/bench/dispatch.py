"""dispatch_N_dps: trivial N-input ops (y = sum of inputs) used to time host dispatch cost."""

from __future__ import annotations

from ops.launch.bridge import LIBRARY, GraphOp, Out

SIZES = (1, 3, 6)


def dispatch_op(n: int, weights: bool = False) -> GraphOp:
    """The n-input op over 1-D tensors [n_elems]; ``weights`` caches inputs 1.. as weights."""
    if n not in SIZES:
        raise ValueError(f"n: {n} inputs is not registered (use one of {SIZES})")
    return GraphOp(f"dispatch_{n}_dps", LIBRARY, (("n",),) * n, (Out(("n",)),),
                   weights=frozenset(range(1, n)) if weights else frozenset())
