"""Where the host's time goes in one call: torch against ours, side by side (needs a CUDA GPU).

Per case, first the host time per call (back-to-back calls, runs of the two interleaved, median of the runs;
``ops.bench.timing.pipelined_runs``), then torch.profiler's CPU table of each (self CPU time by operator over
``--calls`` calls, and how many times each ran per call). The tables show which operators and allocations a
call pays for; the profiler's own overhead inflates every row alike, so compare rows, not totals.

Cases:
    lnl-train    a training step of Linear(LayerNorm(x)) at 4096x768->3072 bf16, as bench_layernorm_linear's
                 train rows run it (forward from leaves that need gradients, then all five gradients)
    lnl-fwd      its forward without gradients
    ln-fwd       LayerNorm forward, 4096x768 bf16
    transformer  one eager training step of bench_transformer's GPT-2-small at 1x128 tokens

    python scripts/profile_host.py [case ...]    -> results/profile_host.md (or $OUT_DIR/profile_host.md)
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from ops.bench import reports, timing  # noqa: E402
from ops.layernorm import layernorm  # noqa: E402
from ops.reference import layernorm_linear_grads_ref, layernorm_ref  # noqa: E402
from ops.tolerance import compare  # noqa: E402

CASES = ("lnl-train", "lnl-fwd", "ln-fwd", "transformer")
M, K, N = 4096, 768, 3072


def checked(name: str, got: tuple[torch.Tensor, ...], refs: tuple[torch.Tensor, ...], reduction: int,
            cond: float = 1.0) -> None:
    """Raise unless each output matches its float64 reference (ops.tolerance's table, as the benchmarks ask)."""
    for i, (g, r) in enumerate(zip(got, refs, strict=True)):
        if (bad := compare(g, r, g.dtype, reduction=reduction, cond=cond)) is not None:
            raise SystemExit(f"{name}: output {i} is wrong: {bad}")


def case_calls(case: str) -> dict[str, Callable[[], object]]:
    """The two contenders' calls of ``case``, each checked against the float64 reference first."""
    if case in ("lnl-train", "lnl-fwd"):
        import bench_layernorm_linear as bl

        train = case == "lnl-train"
        *inputs, dy = bl.input_sets(M, K, N, torch.bfloat16)[0]
        leaves = tuple(t.requires_grad_(train) for t in inputs)

        def call(fwd: Callable) -> Callable[[], object]:
            if train:
                return lambda: torch.autograd.grad(fwd(*leaves), leaves, dy)
            return lambda: fwd(*leaves)
        fwds = {"torch": bl.torch_eager, "ours": bl.ours("auto")}
        calls = {name: call(fwd) for name, fwd in fwds.items()}
        for name, fwd in fwds.items():
            if train:
                refs = layernorm_linear_grads_ref(*(t.detach() for t in leaves), dy)
                checked(name, calls[name](), refs, max(M, N * K), cond=10.0)   # bench_backward's check
            else:
                bl.check_forward(fwd, (*inputs, dy), name)
    elif case == "ln-fwd":
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        g, b = torch.ones(K, device="cuda", dtype=x.dtype), torch.zeros(K, device="cuda", dtype=x.dtype)
        calls = {"torch": lambda: F.layer_norm(x, (K,), g, b), "ours": lambda: layernorm(x, g, b)}
        for name, fn in calls.items():
            checked(name, (fn(),), (layernorm_ref(x, g, b),), K)
    else:   # the transformer's two models step their own weights; bench_transformer checks their outputs
        import bench_transformer as bt

        ref, x = bt.reference(1, 128)
        calls = {impl: bt.train_call(bt.contender(ref, impl), x, "eager") for impl in ("torch", "ours")}
    return calls


def profile_table(fn: Callable[[], object], calls: int) -> str:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    rows = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:25]
    lines = ["| operator | self CPU us per call | calls per call |", "|---|---|---|"]
    lines += [f"| `{e.key}` | {e.self_cpu_time_total / calls:.1f} | {e.count / calls:g} |" for e in rows]
    return "\n".join(lines)


def run_case(case: str, calls: int) -> str:
    fns = case_calls(case)
    for fn in fns.values():   # warm up: plans handed to the C++ entries, cuBLAS handles, allocator pools
        for _ in range(10):
            fn()
    torch.cuda.synchronize()
    per = 50 if case == "transformer" else 200
    times = timing.pipelined_runs(fns, calls=per, repeats=7)
    out = [f"## {case}", "", "| impl | host us per call | pipelined us per call |", "|---|---|---|"]
    out += [f"| {name} | {t.host_us:.1f} | {t.pipelined_us:.1f} |" for name, t in times.items()]
    for name, fn in fns.items():
        out += ["", f"### {name}: torch.profiler, CPU, {calls} calls", "", profile_table(fn, calls)]
    print("\n".join(out[:6 + len(fns)]), flush=True)
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cases", nargs="*", help=f"any of {', '.join(CASES)} (default: all)")
    parser.add_argument("--calls", type=int, default=20, help="calls profiled per contender")
    args = parser.parse_args()
    if bad := [c for c in args.cases if c not in CASES]:
        parser.error(f"unknown case {bad[0]!r}; expected one of {', '.join(CASES)}")
    if not torch.cuda.is_available():
        raise SystemExit("profile_host needs a CUDA GPU")
    parts = ["# Host time per call, torch against ours (scripts/profile_host.py)", "",
             f"GPU: {reports.gpu_name()}; commit {reports.commit()}", ""]
    parts += [run_case(case, args.calls) + "\n" for case in args.cases or CASES]
    out = Path(os.environ.get("OUT_DIR") or ROOT / "results") / "profile_host.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(parts))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
