"""A GPT-2-small transformer (12 pre-LN blocks, d 768, 12 heads, bf16): torch modules against our drop-ins.

Ours is the same model with the same weights, ``ln_1`` + qkv and ``ln_2`` + fc1 replaced by
``FusedLayerNormLinear.from_torch`` and ``ln_f`` by ``LayerNorm.from_torch``; the two models' outputs (and,
for training, their first step's loss) are compared before anything is timed. Per mode (eager, CUDA graph,
torch.compile), phase (inference: one forward under ``no_grad``; training: forward, backward and an AdamW
step, ``capturable=True`` so that a CUDA graph captures the whole step) and size (1x128 and 8x512 tokens):
milliseconds per call, pipelined (back-to-back calls, one sync, divided; median of 11 runs, torch's and
ours interleaved so that the host's drift falls on both), tokens per
second, and ours over torch in the same mode. Writes results/transformer.{csv,md,png}.

    poe bench-transformer                          (needs a CUDA GPU)
    python scripts/bench_transformer.py --modes eager,cuda_graph     (keeps the CSV's other modes' rows)
    python scripts/bench_transformer.py --modes compile --layernorm-ab   (+ our LayerNorm ops under compile)
    python scripts/bench_transformer.py --modes compile --linear-ab   (+ our C++ Linear in compiled training)
    python scripts/bench_transformer.py --modes compile --gelu-ab   (+ ours with the MLP's GELU a kernel of its own)
    python scripts/bench_transformer.py --modes compile --ln-linear-ab   (+ our one-op LayerNorm+Linear in training)
    python scripts/bench_transformer.py --modes compile --inductor-form-ab   (+ training graphs in the "inductor" form)
    python scripts/bench_transformer.py --modes cuda_graph --capture-overlap-ab   (+ ours with less beside the chain)
    python scripts/bench_transformer.py --modes eager --processes 5   (medians over 5 fresh processes)
    python scripts/bench_transformer.py --modes compile --processes 5 --pin-core 4   (threads on CPU 4 while timed)
    python scripts/bench_transformer.py --breakdown   (device time per kind of kernel in a captured call)
    python scripts/bench_transformer.py --compile-kernels --gelu-ab   (kernels and device time per compiled call)
    python scripts/bench_transformer.py --modes compile --control --sizes 1x128 --processes 5
        (+ a second copy of torch's model, timed like a contender: the run's noise floor)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from gpt2_block import (  # noqa: E402 (the model, its contenders and its timed calls)
    CONTROL_IMPL,
    contender,
    infer_call,
    ours_from,
    reference,
    rel_err,
    train_call,
)
from transformer_kernels import (  # noqa: E402 (the kernel breakdowns)
    BREAKDOWN_OUT,
    COMPILE_KERNELS_OUT,
    breakdown,
    compile_kernels,
    write_breakdown,
    write_compile_kernels,
)

from ops.bench import results  # noqa: E402
from ops.bench.reports import appended, commit, gpu_name, write_report  # noqa: E402
from ops.bench.timing import Pipelined, check_pin_core, paired_ratio, pinned_threads, pipelined_runs  # noqa: E402
from ops.layernorm import config as layernorm_config  # noqa: E402
from ops.layernorm_linear import config as layernorm_linear_config  # noqa: E402

SIZES = ((1, 128), (8, 512))
MODES = ("eager", "cuda_graph", "compile")
REPEATS = 11   # interleaved runs per contender (median): the GPU machine's host speed drifts
FIELDS = ("mode", "phase", "tokens", "impl", "ms", "tokens_per_s", "vs_torch")
OUT = ROOT / "results" / "bench_transformer"
OVERLAP_AB_OUT = ROOT / "results" / "bench_transformer_capture_overlap"
ONE_STREAM_IMPL = "ours_one_stream"   # --capture-overlap-ab: ours captured with CAPTURED_WEIGHT_GRADS_BESIDE off
IN_CHAIN_IMPL = "ours_accumulate_in_chain"   # and with CAPTURED_GRADS_ACCUMULATED_BESIDE_MAX_ROWS 0
# --capture-overlap-ab's contenders: the C++ setter each calls while it is captured, its value, and the default's
CAPTURE_ABS = {ONE_STREAM_IMPL: ("set_capture_overlap", False, "CAPTURED_WEIGHT_GRADS_BESIDE"),
               IN_CHAIN_IMPL: ("set_accumulate_beside", 0, "CAPTURED_GRADS_ACCUMULATED_BESIDE_MAX_ROWS")}
CONTROL_OUT = ROOT / "results" / "bench_transformer_control"
SPREAD_FIELDS = ("vs_torch_min", "vs_torch_max")   # over the processes of a --processes run
RATIO_NOTE = ("in eager and compile, whose runs alternate, the median over rounds of the contender's run over "
              "torch's in the same round; in a CUDA graph, each timed alone, the ratio of the medians")   # vs_torch


@dataclass(frozen=True)
class Timing:
    """How a run timed its rows: ``repeats`` rounds per contender in each of ``processes`` fresh processes (medians
    over them), every thread pinned to CPU ``pin_core`` while timed (None: not pinned)."""

    processes: int = 1
    repeats: int = REPEATS
    pin_core: int | None = None

    def stamp(self) -> str:
        """A report's stamp: the GPU, the commit, the processes a --processes run took medians over, the pin."""
        spread = f"; medians over {self.processes} processes" if self.processes > 1 else ""
        rounds = f"; {self.repeats} rounds" if self.repeats != REPEATS else ""
        pin = f"; every thread pinned to CPU {self.pin_core} while timed" if self.pin_core is not None else ""
        return f"GPU: {gpu_name()}; commit {commit()}{spread}{rounds}{pin}"

    def flags(self) -> list[str]:
        """The flags that make a process of a --processes run time its rows as this one says."""
        return ["--repeats", str(self.repeats), *(["--pin-core", str(self.pin_core)] if self.pin_core is not None
                                                   else [])]


@dataclass(frozen=True)
class CompileAB:
    """A contender of compile mode, asked for by ``flag``: ours with a knob that dynamo reads while tracing (and
    guards on, so each contender keeps its own graph) set to ``value``; its report sets it beside ours at the
    knob's default (its value when this module loads)."""

    flag: str
    config: ModuleType
    knob: str
    value: str | bool
    report: Path
    title: str
    says: str
    default: str | bool = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "default", getattr(self.config, self.knob))


COMPILE_ABS = {
    "ours_ln_op": CompileAB("--layernorm-ab", layernorm_config, "COMPILED_LAYERNORM", "ours",
                            ROOT / "results" / "bench_transformer_compiled_layernorm",
                            "GPT-2-small under torch.compile: whose LayerNorm the graph holds",
                            "our C++ LayerNorm ops in the graph"),
    "ours_cpp_linear": CompileAB("--linear-ab", layernorm_linear_config, "COMPILED_TRAINING_LINEAR", "ours",
                                 ROOT / "results" / "bench_transformer_compiled_linear",
                                 "GPT-2-small under torch.compile: whose Linear a training graph holds",
                                 "our C++ traced_linear in the unfused LayerNorm+Linear's training graph, "
                                 "linear_grads in its backward"),
    "ours_ln_linear_op": CompileAB("--ln-linear-ab", layernorm_linear_config, "COMPILED_TRAINING_LAYERNORM_LINEAR",
                                   "ours", ROOT / "results" / "bench_transformer_compiled_ln_linear",
                                   "GPT-2-small under torch.compile: one op for the LayerNorm+Linear in training",
                                   "our C++ traced_layernorm_linear in training graphs (one call each way, "
                                   "the MLP's GELU in its GEMM)"),
    "ours_inductor_form": CompileAB("--inductor-form-ab", layernorm_linear_config,
                                    "COMPILED_TRAINING_LAYERNORM_LINEAR", "inductor",
                                    ROOT / "results" / "bench_transformer_compiled_inductor_form",
                                    "GPT-2-small under torch.compile: training graphs in the \"inductor\" form",
                                    "ours with torch's LayerNorm and Linear in training graphs at every size, "
                                    "the MLP's GELU in our GEMM's epilogue (the default before 'auto')"),
    "ours_no_gelu_epilogue": CompileAB("--gelu-ab", layernorm_linear_config, "COMPILED_LINEAR_GELU", False,
                                       ROOT / "results" / "bench_transformer_compiled_gelu",
                                       "GPT-2-small under torch.compile: the MLP's GELU in the GEMM's epilogue",
                                       "the MLP's tanh GELU inductor's, after our C++ Linear in inference and "
                                       "torch's in training (the pass of ops/layernorm_linear/inductor.py off)"),
}


def vs_torch(runs: dict[str, Pipelined], impl: str, mode: str) -> float:
    """``impl``'s time over torch's: where the contenders' runs were interleaved (eager, compile), the median of
    the rounds' ratios (``paired_ratio``); in a CUDA graph, where each was timed alone, the ratio of medians."""
    if mode == "cuda_graph":
        return runs[impl].pipelined_us / runs["torch"].pipelined_us
    return paired_ratio(runs[impl], runs["torch"])


def with_compile_knobs(impl: str, fn: Callable[[], object]) -> Callable[[], object]:
    """``fn`` run with every ``COMPILE_ABS`` knob at ``impl``'s value: its own contender's, else the default."""
    def call() -> object:
        for ab in COMPILE_ABS.values():
            setattr(ab.config, ab.knob, ab.default)
        if impl in COMPILE_ABS:   # after the defaults: two contenders may share a knob
            setattr(COMPILE_ABS[impl].config, COMPILE_ABS[impl].knob, COMPILE_ABS[impl].value)
        return fn()
    return call


@contextlib.contextmanager
def capture_knob(impl: str) -> Iterator[None]:
    """The C++ launcher's knob of ``CAPTURE_ABS[impl]`` at that contender's value while it is captured (read at
    capture: the graph keeps what it recorded), then back at layernorm_linear_config's; nothing for the others."""
    if impl not in CAPTURE_ABS:
        yield
        return
    from ops.launch import direct

    ops = direct.load_native().ops
    if ops is None:
        raise SystemExit("--capture-overlap-ab: the C++ launcher is not available")
    setter, value, default = CAPTURE_ABS[impl]
    getattr(ops, setter)(value)
    try:
        yield
    finally:
        getattr(ops, setter)(getattr(layernorm_linear_config, default))


def timed(fns: dict[str, Callable[[], object]], calls: int, timing: Timing) -> dict[str, Pipelined]:
    """``pipelined_runs`` of ``fns`` as ``timing`` says, pinned after one more call each (a pinned thread's first
    call can meet cold caches of its new CPU)."""
    with pinned_threads(timing.pin_core):
        if timing.pin_core is not None:
            for fn in fns.values():
                fn()
        return pipelined_runs(fns, calls=calls, repeats=timing.repeats)


def run(modes: list[str], compile_abs: tuple[str, ...] = (), overlap_ab: bool = False, control: bool = False,
        sizes: tuple[tuple[int, int], ...] = SIZES, timing: Timing = Timing()) -> list[dict]:
    rows = []
    for b, t in sizes:
        torch._dynamo.reset()   # each size compiled for itself, not as a dynamic-shape recompile of the last
        ref_model, x = reference(b, t)
        with torch.no_grad():
            err = rel_err(ours_from(ref_model)(x), ref_model(x))
        assert err < 2e-2, f"ours differs from torch at {b}x{t}: relative error {err:.3g}"
        print(f"{b}x{t}: outputs agree (relative error {err:.2e})", flush=True)
        for mode in modes:
            for phase in ("infer", "train"):
                calls = 50 if phase == "infer" else 10
                fns, runs = {}, {}
                impls = ("torch", "ours", *(compile_abs if mode == "compile" else ()),
                         *(CAPTURE_ABS if overlap_ab and mode == "cuda_graph" else ()),
                         *((CONTROL_IMPL,) if control else ()))
                for impl in impls:
                    model = contender(ref_model, impl)
                    with capture_knob(impl):
                        fn = (infer_call if phase == "infer" else train_call)(model, x, mode)
                    if mode == "compile" and compile_abs and impl not in ("torch", CONTROL_IMPL):   # ours' knobs
                        fn = with_compile_knobs(impl, fn)
                    fns[impl] = fn
                    for _ in range(3):
                        fns[impl]()
                    if mode == "cuda_graph":
                        # One captured graph at a time: two of torch's own models' graphs, replayed in turn,
                        # fault on this machine (an illegal address; not with CUDA_LAUNCH_BLOCKING=1), and a
                        # replay costs the host little, so interleaving has nothing to even out.
                        runs |= timed(fns, calls, timing)
                        del fns[impl], model
                        torch.cuda.synchronize()
                        torch.cuda.empty_cache()
                if mode != "cuda_graph":
                    runs = timed(fns, calls, timing)
                ms = {impl: r.pipelined_us / 1e3 for impl, r in runs.items()}
                for impl in impls:
                    rows.append({"mode": mode, "phase": phase, "tokens": b * t, "impl": impl,
                                 "ms": round(ms[impl], 4), "tokens_per_s": round(b * t / ms[impl] * 1e3),
                                 "vs_torch": round(vs_torch(runs, impl, mode), 3)})
                    pairs = zip(runs[impl].runs, runs["torch"].runs, strict=True)
                    per_round = " ".join(f"{x / y:.3f}" for x, y in pairs)
                    print(f"{mode:10} {phase:5} {b * t:>5} tokens {impl:5} {ms[impl]:8.3f} ms "
                          f"({rows[-1]['vs_torch']}; per round {per_round})", flush=True)
    return rows


def across_processes(argv: list[str], processes: int) -> list[dict]:
    """This script's rows, run in ``processes`` fresh processes (a process's host can be a few percent off for
    its whole life, which interleaving within it cannot even out), as ``process_medians`` of them."""
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(processes):
            out = Path(tmp) / f"rows{i}.json"
            subprocess.run([sys.executable, __file__, *argv, "--rows-out", str(out)], check=True)
            runs.append(json.loads(out.read_text()))
    return process_medians(runs)


def process_medians(runs: list[list[dict]]) -> list[dict]:
    """Per (mode, phase, tokens, impl): the median ms over the runs, and the median of each run's ratio to torch
    (each ratio compares contenders timed side by side in one process), with those ratios' range."""
    by_key: dict[tuple, list[dict]] = {}
    for rows in runs:
        for r in rows:
            by_key.setdefault((r["mode"], r["phase"], r["tokens"], r["impl"]), []).append(r)
    out = []
    for (mode, phase, tokens, impl), rs in by_key.items():
        ms = statistics.median(float(r["ms"]) for r in rs)
        ratios = [float(r["vs_torch"]) for r in rs]
        out.append({"mode": mode, "phase": phase, "tokens": tokens, "impl": impl, "ms": round(ms, 4),
                    "tokens_per_s": round(int(tokens) / ms * 1e3), "vs_torch": round(statistics.median(ratios), 3),
                    "vs_torch_min": min(ratios), "vs_torch_max": max(ratios)})
    return out


def write_ab(rows: list[dict], mode: str, impls: tuple[str, ...], out: Path, title: str, contenders: str,
             timing: Timing) -> None:
    """The ``mode`` rows of torch, ours and the A/B contenders ``impls`` side by side: the evidence for defaults."""
    keep = ("torch", "ours", *impls)
    write_report(out, [only(r, FIELDS) for r in rows if r["mode"] == mode and r["impl"] in keep],
                 FIELDS, timing.stamp(), title,
                 f"bf16, as bench_transformer. {contenders} Pipelined ms per call, median of {timing.repeats} "
                 f"runs; vs_torch = the contender's time over torch's ({RATIO_NOTE}).")


def write_compile_ab(rows: list[dict], impl: str, timing: Timing) -> None:
    """Evidence for a compile-mode knob's default: ours with it against the contender ``impl``."""
    ab = COMPILE_ABS[impl]
    module = ab.config.__name__.rsplit(".", 1)[-1]
    write_ab(rows, "compile", (impl,), ab.report, ab.title,
             f"ours: the default ({module}.{ab.knob} = {ab.default!r}); {impl}: {ab.says} ({ab.knob} = "
             f"{ab.value!r}), interleaved with the others.", timing)


def write_overlap_ab(rows: list[dict], timing: Timing) -> None:
    """Evidence for CAPTURED_WEIGHT_GRADS_BESIDE and CAPTURED_GRADS_ACCUMULATED_BESIDE_MAX_ROWS: ours with both
    against CAPTURE_ABS' contenders, each with one off, in a CUDA graph."""
    c = layernorm_linear_config
    write_ab(rows, "cuda_graph", tuple(CAPTURE_ABS), OVERLAP_AB_OUT,
             "GPT-2-small in a CUDA graph: gradient work beside the backward's chain, or in it",
             f"ours: the defaults (layernorm_linear_config.CAPTURED_WEIGHT_GRADS_BESIDE = "
             f"{c.CAPTURED_WEIGHT_GRADS_BESIDE}: the unfused backward forks dW and db onto a side stream under "
             f"capture; CAPTURED_GRADS_ACCUMULATED_BESIDE_MAX_ROWS = {c.CAPTURED_GRADS_ACCUMULATED_BESIDE_MAX_ROWS}: "
             "under capture, forwards of at most that many rows make their parameters' AccumulateGrad nodes on "
             f"streams of their own); {ONE_STREAM_IMPL}: the same model captured with the first off; "
             f"{IN_CHAIN_IMPL}: with the second at 0. One graph at a time, each contender captured and timed in "
             "turn.", timing)


def only(row: dict, fields: tuple[str, ...]) -> dict:
    return {k: row[k] for k in fields}


def write_control(rows: list[dict], timing: Timing) -> None:
    """torch, ours and CONTROL_IMPL side by side: how far the ratio of two copies of one model strays from 1."""
    fields = (*FIELDS, *SPREAD_FIELDS) if timing.processes > 1 else FIELDS
    write_report(CONTROL_OUT, [only(r, fields) for r in rows], fields, timing.stamp(),
                 "GPT-2-small: torch's model against a copy of itself (the noise floor of vs_torch)",
                 f"bf16, as bench_transformer. {CONTROL_IMPL}: a second torch model with the same weights, built, "
                 "compiled or captured and timed like a contender, interleaved with torch and ours; its vs_torch "
                 f"would be 1 on a quiet machine. Pipelined ms per call, median of {timing.repeats} runs; vs_torch: "
                 f"{RATIO_NOTE}"
                 f"{'; vs_torch_min and _max: the range of the per-process ratios' if timing.processes > 1 else ''}.")


def write(rows: list[dict], modes: list[str], timing: Timing) -> None:
    """The CSV and markdown table (rows of modes not run now kept from the earlier report) and the PNG."""
    rows = [only(r, FIELDS) for r in rows if r["impl"] in ("torch", "ours")]
    rows, kept = appended(OUT.name, ",".join(modes), rows, column="mode")
    rows = sorted(rows, key=lambda r: (MODES.index(r["mode"]), r["phase"], int(r["tokens"]), r["impl"]))
    stamp = timing.stamp() + kept
    write_report(OUT, rows, FIELDS, stamp, "GPT-2-small transformer: torch modules against our drop-ins",
                 f"bf16, 12 pre-LN blocks (d 768, 12 heads, SDPA). Pipelined ms per call (median of {REPEATS} "
                 "runs, or as many as a run's stamp says: torch's and ours interleaved in eager and compile, timed one "
                 "after the other in a CUDA graph; a run stamped \"medians over N processes\" then took the median "
                 "over N fresh processes, of the ms and of each process's vs_torch; one stamped \"pinned\" had every "
                 "thread of its processes on one CPU while timing, after compiling and capturing); train = forward + "
                 "backward + AdamW. vs_torch = ours / torch in the same mode: where the runs were interleaved, the "
                 "median over rounds of ours' run over torch's in the same round (runs at 9e07bd4 and earlier: the "
                 "ratio of the medians). A stamp naming several runs says which modes' rows each wrote.")
    try:
        plot(rows, stamp)
    except ImportError:
        print("matplotlib missing: no PNG")


def plot(rows: list[dict], stamp: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ours = [r for r in rows if r["impl"] == "ours"]
    labels = [f"{r['mode']}\n{r['phase']} {r['tokens']}" for r in ours]
    fig, ax = plt.subplots(figsize=(max(6, len(ours) * 0.9), 4))
    ax.bar(range(len(ours)), [float(r["vs_torch"]) for r in ours])
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(range(len(ours)), labels, fontsize=7)
    ax.set_ylabel("ours / torch (time, lower is better)")
    ax.set_title(f"GPT-2-small, bf16 - {stamp}", fontsize=8)
    fig.tight_layout()
    fig.savefig(results.RESULTS / f"{results.family_of(OUT.name)}.png", dpi=110)
    plt.close(fig)


def parsed_modes(arg: str) -> list[str]:
    """--modes' list, each one of MODES."""
    modes = arg.split(",")
    if any(m not in MODES for m in modes):
        raise SystemExit(f"--modes: each of {MODES}")
    return modes


def parsed_sizes(arg: str) -> tuple[tuple[int, int], ...]:
    """--sizes' (batch, tokens) pairs, each one of SIZES."""
    named = {f"{b}x{t}": (b, t) for b, t in SIZES}
    if any(size not in named for size in arg.split(",")):
        raise SystemExit(f"--sizes: each of {', '.join(named)}")
    return tuple(named[size] for size in arg.split(","))


def write_reports(rows: list[dict], args: argparse.Namespace, modes: list[str],
                  sizes: tuple[tuple[int, int], ...], timing: Timing) -> None:
    """The reports the run's flags ask for: the control's, the main one (all sizes), the A/Bs'."""
    if args.control:
        write_control(rows, timing)
    if set(sizes) == set(SIZES):
        write(rows, modes, timing)
    if "compile" in modes:
        for impl in args.compile_abs:
            write_compile_ab(rows, impl, timing)
    if args.capture_overlap_ab and "cuda_graph" in modes:
        write_overlap_ab(rows, timing)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    for impl, ab in COMPILE_ABS.items():
        p.add_argument(ab.flag, action="append_const", const=impl, dest="compile_abs", default=[],
                       help=f"compile mode: also ours with {ab.says} (table {ab.report.name})")
    p.add_argument("--capture-overlap-ab", action="store_true",
                   help=f"cuda_graph mode: also ours captured with dW and db on the captured stream, and with "
                        f"the parameters' gradients accumulated on it (table {OVERLAP_AB_OUT.name})")
    p.add_argument("--control", action="store_true",
                   help=f"also a second copy of torch's model, timed as a contender (table {CONTROL_OUT.name})")
    p.add_argument("--sizes", default=",".join(f"{b}x{t}" for b, t in SIZES),
                   help="comma-separated BxT of those benchmarked (fewer: only the A/B and control reports)")
    p.add_argument("--repeats", type=int, default=REPEATS, help="interleaved runs per contender (median)")
    p.add_argument("--pin-core", type=int, metavar="CPU",
                   help="pin every thread to this CPU while timing (after compiling and capturing): runs vary less")
    p.add_argument("--processes", type=int, default=1,
                   help="run in this many fresh processes; report the medians over them")
    p.add_argument("--rows-out", help=argparse.SUPPRESS)   # a process of --processes: its rows, as JSON
    p.add_argument("--breakdown", action="store_true",
                   help=f"captured calls' device time by kind of kernel instead (table {BREAKDOWN_OUT.name})")
    p.add_argument("--compile-kernels", action="store_true",
                   help=f"compiled calls' kernel launches and device time instead (table {COMPILE_KERNELS_OUT.name})")
    p.add_argument("--breakdown-from", action="store_true",
                   help=f"rewrite the {BREAKDOWN_OUT.name} table from the committed {BREAKDOWN_OUT.name}_kernels table")
    args = p.parse_args()
    if args.breakdown:
        write_breakdown(breakdown(SIZES), Timing().stamp())
        return
    if args.compile_kernels:
        rows, kernel_rows = compile_kernels(SIZES, tuple(args.compile_abs), with_compile_knobs)
        write_compile_kernels(rows, kernel_rows, Timing().stamp())
        return
    if args.breakdown_from:   # the kernels of an earlier --breakdown, their kinds as KINDS says now
        stamp, kernel_rows = results.read_table(BREAKDOWN_OUT.name + "_kernels")
        write_breakdown(kernel_rows, stamp)
        return
    modes, sizes = parsed_modes(args.modes), parsed_sizes(args.sizes)
    if args.pin_core is not None:   # before compiling for minutes
        try:
            check_pin_core(args.pin_core, "--pin-core")
        except ValueError as e:
            raise SystemExit(str(e)) from None
    compile_abs = tuple(args.compile_abs)
    timing = Timing(args.processes, args.repeats, args.pin_core)
    if args.processes > 1:
        flags = [*(COMPILE_ABS[impl].flag for impl in compile_abs),
                 *(["--capture-overlap-ab"] if args.capture_overlap_ab else []),
                 *(["--control"] if args.control else []), "--sizes", args.sizes, *timing.flags()]
        rows = across_processes(["--modes", args.modes, *flags], args.processes)
    else:
        rows = run(modes, compile_abs, args.capture_overlap_ab, args.control, sizes, timing)
    if args.rows_out:
        Path(args.rows_out).write_text(json.dumps(rows))
        return
    write_reports(rows, args, modes, sizes, timing)


if __name__ == "__main__":
    main()
