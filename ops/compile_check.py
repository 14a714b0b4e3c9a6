"""Compile every registered op's GPU path for a virtual sm_90 device (no GPU needed).

    python -m ops.compile_check

MAX compiles for a GPU that is not attached once the virtual device API,
architecture and count are set; loading a graph then returns a compile-only
model or raises the kernel's compile error. Must run in its own process:
the virtual device settings apply to the whole process.
"""

from __future__ import annotations

import sys
import time

import torch

from ops import bridge
from ops.bridge import GraphOp


def registered_ops() -> list[tuple[GraphOp, torch.dtype]]:
    """Every (op, dtype) the project ships: the p22 problems and solutions, the library."""
    from ops.p22 import PROBLEMS, SOLUTIONS, P22Kernels

    found = []
    for package in (SOLUTIONS, PROBLEMS):
        k = P22Kernels(package)
        for op in (k.layernorm, k.transpose, k.matmul, k.bias_add, k.fused_op("tiled"), k.fused_op("naive")):
            found.append((op, torch.float32))
    from ops.dispatch import SIZES, dispatch_op

    found += [(dispatch_op(n), torch.float32) for n in SIZES]
    return found


def main() -> int:
    from max import driver
    from max.driver import Accelerator
    from max.engine import InferenceSession

    driver.set_virtual_device_api("cuda")
    driver.set_virtual_device_target_arch("sm_90")
    driver.set_virtual_device_count(1)
    session = InferenceSession(devices=[Accelerator(0)])
    failed = 0
    for op, dtype in registered_ops():
        t0 = time.perf_counter()
        try:
            graph = bridge.build_graph(op, (dtype,) * len(op.inputs), "gpu", 0)
            session.load(graph)
            status = "ok"
        except Exception as e:  # noqa: BLE001 - report every failing op, then fail
            failed += 1
            status = f"FAILED: {e}"
        where = op.package.relative_to(bridge.ROOT) if op.package.is_relative_to(bridge.ROOT) else op.package
        print(f"{where} {op.name} {dtype}: {status} "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)
    if failed:
        print(f"{failed} GPU graphs failed to compile")
        return 1
    print("all GPU graphs compiled for sm_90")
    return 0


if __name__ == "__main__":
    sys.exit(main())
