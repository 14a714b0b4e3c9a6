"""Where GPT-2-small's device time goes, kernel by kernel (``bench_transformer.py --breakdown`` and
``--compile-kernels``): CUPTI's launches and device time per call of torch's model and ours, grouped by kind."""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from gpt2_block import contender, infer_call, reference, train_call  # noqa: E402

from ops.bench.reports import write_report  # noqa: E402

BREAKDOWN_OUT = ROOT / "results" / "bench_transformer_breakdown"
COMPILE_KERNELS_OUT = ROOT / "results" / "bench_transformer_compile_kernels"
COMPILE_KERNEL_FIELDS = ("phase", "tokens", "impl", "launches", "device_us")
# --breakdown: kernels by kind, from their names (the first pattern that matches; torch's and cuBLAS's names on the
# H100 with torch 2.11): our Mojo kernels, LayerNorm's, GEMMs, attention, the AdamW step, the rest.
KINDS = (("ours (Mojo)", r"^kernels_"), ("LayerNorm (torch)", r"layer_norm|LayerNorm|GammaBeta"),
         ("attention", r"sdpa|flash|fmha|attention"), ("GEMM (cuBLAS)", r"gemm|xmma|cutlass|nvjet|Bgrad|splitKreduce"),
         ("AdamW", r"multi_tensor|foreach|adam"), ("other", r""))
KERNEL_FIELDS = ("phase", "tokens", "impl", "kind", "kernel", "launches", "us")


def kind_of(name: str) -> str:
    return next(kind for kind, pattern in KINDS if re.search(pattern, name))


def kernel_rows(kernels: dict[str, tuple[int, float]], calls: int, **where: object) -> list[dict]:
    """``kernel_times``' kernels over ``calls`` calls as rows of ``KERNEL_FIELDS`` (launches per call, the kind
    as ``KINDS`` says), each with ``where`` (phase, tokens, impl)."""
    return [{**where, "kind": kind_of(name), "kernel": name[:90], "launches": count // calls, "us": round(us, 2)}
            for name, (count, us) in kernels.items()]


def breakdown(sizes: tuple[tuple[int, int], ...]) -> list[dict]:
    """Per size and phase, torch and ours captured (CUDA graph) as ``run`` times them: CUPTI's device time per
    call of each kind of kernel (``KINDS``), and the busiest kernels, into the bench_transformer_breakdown table
    (results/transformer.md)."""
    from ops.bench.timing import kernel_times

    rows = []
    for b, t in sizes:
        ref_model, x = reference(b, t)
        for phase in ("infer", "train"):
            for impl in ("torch", "ours"):
                model = contender(ref_model, impl)
                fn = (infer_call if phase == "infer" else train_call)(model, x, "cuda_graph")
                rows += kernel_rows(kernel_times(fn, calls=5), 5, phase=phase, tokens=b * t, impl=impl)
                del fn, model
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
    return rows


def compile_kernels(sizes: tuple[tuple[int, int], ...], compile_abs: tuple[str, ...],
                    with_knobs: Callable[[str, Callable[[], object]], Callable[[], object]]
                    ) -> tuple[list[dict], list[dict]]:
    """Per size and phase, torch's model, ours and the contenders ``compile_abs`` under torch.compile as ``run`` builds
    them: CUPTI's kernel launches and device time per call (counts, not host timings: the compile rows' pipelined
    times are host-bound and noisy), and every kernel (``KERNEL_FIELDS``), for
    the bench_transformer_compile_kernels table and its _kernels table (results/transformer.md)."""
    from ops.bench.timing import kernel_times

    rows, every = [], []
    for b, t in sizes:
        torch._dynamo.reset()
        ref_model, x = reference(b, t)
        for phase in ("infer", "train"):
            for impl in ("torch", "ours", *compile_abs):
                fn = (infer_call if phase == "infer" else train_call)(contender(ref_model, impl), x, "compile")
                kernels = kernel_times(fn if impl == "torch" else with_knobs(impl, fn), calls=5)
                rows.append({"phase": phase, "tokens": b * t, "impl": impl,
                             "launches": sum(count for count, _ in kernels.values()) // 5,
                             "device_us": round(sum(us for _, us in kernels.values()), 1)})
                every += kernel_rows(kernels, 5, phase=phase, tokens=b * t, impl=impl)
                print(rows[-1], flush=True)
                del fn
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
    return rows, every


def write_breakdown(rows: list[dict], stamp: str) -> None:
    """Per (phase, tokens): each kind's device us per call, torch and ours, and its share of torch's total; and
    every kernel (``KERNEL_FIELDS``) with its kind as ``KINDS`` says."""
    for r in rows:
        r["kind"], r["us"] = kind_of(r["kernel"]), float(r["us"])
    sums: dict[tuple, float] = {}
    for r in rows:
        for kind in (r["kind"], "all"):
            key = (r["phase"], r["tokens"], kind, r["impl"])
            sums[key] = sums.get(key, 0.0) + r["us"]
    table = []
    for phase, tokens in dict.fromkeys((r["phase"], r["tokens"]) for r in rows):
        total = sums[(phase, tokens, "all", "torch")]
        for kind in [k for k, _ in KINDS] + ["all"]:
            t, o = sums.get((phase, tokens, kind, "torch"), 0.0), sums.get((phase, tokens, kind, "ours"), 0.0)
            table.append({"phase": phase, "tokens": tokens, "kind": kind, "torch_us": round(t, 1),
                          "ours_us": round(o, 1), "torch_share": round(t / total, 3),
                          "ours_minus_torch_over_torch_total": round((o - t) / total, 3)})
    fields = tuple(table[0])
    busiest = sorted(rows, key=lambda r: -r["us"])
    top = "; ".join(f"{r['phase']} {r['tokens']} {r['impl']}: {r['kernel'][:50]} {r['us']} us" for r in busiest[:8])
    write_report(BREAKDOWN_OUT, table, fields, stamp, "GPT-2-small captured in a CUDA graph: device time by kind",
                 "bf16, the models of bench_transformer, each call captured (torch.cuda.graph) and replayed: CUPTI "
                 "kernel time per call (5 calls), summed per kind of kernel by name (scripts/bench_transformer.py "
                 "KINDS). The kinds' sums count overlapping kernels twice, so 'all' can exceed the pipelined time. "
                 f"ours_minus_torch_over_torch_total: what that kind moves the ratio ours / torch by. Busiest: {top}.")
    write_report(BREAKDOWN_OUT.with_name(BREAKDOWN_OUT.name + "_kernels"), rows, KERNEL_FIELDS, stamp,
                 "GPT-2-small captured: every kernel", "Per phase, tokens and model: CUPTI us per call, launches.")


def write_compile_kernels(rows: list[dict], kernels: list[dict], stamp: str) -> None:
    """``compile_kernels``' rows into the bench_transformer_compile_kernels table and every kernel into its _kernels
    table (results/transformer.csv)."""
    write_report(COMPILE_KERNELS_OUT, rows, COMPILE_KERNEL_FIELDS, stamp,
                 "GPT-2-small under torch.compile: kernels per call",
                 "bf16, the models of bench_transformer compiled as its compile rows are (ours_*: the compile "
                 "A/B contenders asked for, each with its knob at its contender's value). CUPTI over 5 calls "
                 "after a warm-up: kernels launched per call (memsets included) and their device time summed, "
                 f"in us per call. Every kernel: the {COMPILE_KERNELS_OUT.name}_kernels table.")
    write_report(COMPILE_KERNELS_OUT.with_name(COMPILE_KERNELS_OUT.name + "_kernels"), kernels, KERNEL_FIELDS,
                 stamp, "GPT-2-small under torch.compile: every kernel",
                 "Per phase, tokens and model: CUPTI us per call, launches per call.")
