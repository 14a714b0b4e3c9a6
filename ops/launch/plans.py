"""The plan tables: what a direct launch of one shape needs (the loaded kernel, its grid, block and sizes), made
once per shape by the op that knows how, kept here, and handed to the C++ entries' tables so that later calls of
that shape run without Python. The only module that hands plans to the C++ side.

* ``PlanTable``: an op's Python table, keyed by what the plan depends on (shapes, dtypes, device), bounded;
* ``remember``: hand a plan to the C++ tables once; ``forget_plans``: clear both sides together.
"""

from __future__ import annotations

from collections.abc import Callable

from ops.launch import direct

PLANS_MAX = 4096   # plans kept per table (a model with ever new shapes must not grow them without end)


class PlanTable(dict):
    """An op's plans by key; ``keep`` clears the table at ``PLANS_MAX`` entries first. The plans depend on shapes
    and dtypes only, never on a tensor's values, so none can go stale."""

    def keep(self, key: tuple, plan: tuple) -> tuple:
        if len(self) >= PLANS_MAX:
            self.clear()
        self[key] = plan
        return plan


_native_keys: set[tuple] = set()


def remember(key: tuple, register: Callable[[object], None]) -> None:
    """Hand a plan to the C++ tables once: ``register(torch.ops.mojo_direct)`` unless ``key`` (tagged by table)
    was handed over before. At PLANS_MAX keys both sides are cleared together, so they stay in step."""
    if direct.NATIVE.ops is None or key in _native_keys:
        return
    if len(_native_keys) >= PLANS_MAX:
        forget_plans()
    _native_keys.add(key)
    register(direct.NATIVE.ops)


def forget_plans() -> None:
    """Clear the C++ plan tables and Python's record of what it handed over, together (they stay in step); the
    next call of each shape takes the Python route and hands its plan over again."""
    _native_keys.clear()
    if direct.NATIVE.ops is not None:
        direct.NATIVE.ops.clear_plans()
