"""README's performance section, generated from the committed reports in results/ (never typed by hand).

    python scripts/readme_tables.py          (rewrites the section between README's results markers)
    python scripts/readme_tables.py --check  (exit 1 when README's section is not what results/ gives)
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ops.bench.results import read_table, stamp_commit  # noqa: E402

README = ROOT / "README.md"
BEGIN = "<!-- results:begin (scripts/readme_tables.py writes this section from results/; do not edit) -->"
END = "<!-- results:end -->"
TRANSFORMER_COLUMNS = (("infer", "128"), ("infer", "4096"), ("train", "128"), ("train", "4096"))
HEADLINE_SHAPE = ("4096", "768", "3072")   # M, K, N of LayerNorm+Linear's headline rows


def transformer_table() -> list[str]:
    stamp, rows = read_table("bench_transformer")
    ratio = {(r["mode"], r["phase"], r["tokens"]): r["vs_torch"] for r in rows if r["impl"] == "ours"}
    out = ["GPT-2-small, bf16, ours / torch in the same mode, pipelined time per call",
           f"([results/transformer.md](results/transformer.md); {stamp.split(';')[1].strip()}):", "",
           "| mode | inference 1x128 | inference 8x512 | training 1x128 | training 8x512 |", "|---|---|---|---|---|"]
    for mode in ("eager", "cuda_graph", "compile"):
        out.append(f"| {mode} | " + " | ".join(ratio.get((mode, p, t), "-") for p, t in TRANSFORMER_COLUMNS) + " |")
    return out


def models_table() -> list[str]:
    """Hugging Face models after ``ops.apply_to`` (its defaults), ours / the unpatched model, eager, per model."""
    stamp, rows = read_table("bench_models")
    if not rows:
        return []
    ratio = {(r["model"], r["phase"], r["impl"]): r["vs_hf"] for r in rows if r.get("mode", "eager") == "eager"}
    gpu, commit, version = (part.strip() for part in stamp.split(";")[:3])
    out = ["Hugging Face models after `ops.apply_to(model)` (norms swapped, known blocks fused), bf16 eager, "
           "ours / the unpatched model,",
           f"pipelined time per call ([results/transformer.md](results/transformer.md); "
           f"{gpu.removeprefix('GPU: ')}, {commit}, {version}):", "",
           "| model | inference | training step | Liger's RMSNorm: inference | training step |",
           "|---|---|---|---|---|"]
    for model in dict.fromkeys(r["model"] for r in rows if r.get("mode", "eager") == "eager"):
        cells = [ratio.get((model, phase, impl), "-") for impl in ("ours", "liger:rms_norm")
                 for phase in ("infer", "train")]
        out.append(f"| {model} | " + " | ".join(cells) + " |")
    return out


def per_call_table() -> list[str]:
    ln_stamp, ln = read_table("bench_layernorm")
    lnl_stamp, lnl = read_table("bench_layernorm_linear")
    out = ["Per call, ours / torch eager, pipelined (back-to-back calls with their allocations, one sync;",
           "[results/layernorm.md](results/layernorm.md), "
           "[results/layernorm_linear.md](results/layernorm_linear.md), [results/rmsnorm.md](results/rmsnorm.md)):",
           "",
           "| call | dtype | ours / torch | commit |", "|---|---|---|---|"]
    for dtype in ("bfloat16", "float32"):
        v = [float(r["pipe_vs_torch"]) for r in ln if (r["kind"], r["impl"], r["dtype"]) == ("fwd", "ours", dtype)]
        if v:
            out.append(f"| LayerNorm forward, {len(v)} shapes | {dtype} | median {statistics.median(v):.3g}, "
                       f"worst {max(v):.3g} | {stamp_commit(ln_stamp, dtype)} |")
    for kind, label in (("fwd", "forward"), ("train", "training step (forward + backward)")):
        want = (kind, "ours", "bfloat16", *HEADLINE_SHAPE)
        for r in lnl:
            if (r["kind"], r["impl"], r["dtype"], r["M"], r["K"], r["N"]) == want:
                out.append(f"| LayerNorm+Linear {label}, {'x'.join(HEADLINE_SHAPE[:2])}->{HEADLINE_SHAPE[2]} | "
                           f"bfloat16 | {r['pipe_vs_torch']} | {stamp_commit(lnl_stamp, 'bfloat16')} |")
    big = [float(r["pipe_vs_torch"]) for r in lnl
           if (r["kind"], r["impl"], r["dtype"]) == ("fwd", "ours", "bfloat16") and int(r["M"]) >= 1024]
    if big:
        commit = stamp_commit(lnl_stamp, "bfloat16")
        out.append(f"| LayerNorm+Linear forward, {len(big)} shapes with M >= 1024 | bfloat16 | "
                   f"median {statistics.median(big):.3g}, worst {max(big):.3g} | {commit} |")
    out += rms_rows()
    out += ["", f"{ln_stamp.split(';')[0]}."]
    return out


def rms_rows() -> list[str]:
    """RMSNorm's, the add-and-norm's and RMSNorm+Linear's rows ([results/rmsnorm.md](results/rmsnorm.md)): forward and
    training step per shape set, and the add and norm, ours / torch, with their GPU when it is not the others'."""
    return (ratio_rows("bench_rmsnorm", (("fwd", "RMSNorm forward"), ("train", "RMSNorm training step"),
                                         ("add+rms_norm", "residual add + RMSNorm forward"),
                                         ("add+layer_norm", "residual add + LayerNorm forward")))
            + ratio_rows("bench_rmsnorm_linear", (("fwd", "RMSNorm+Linear forward"),
                                                  ("train", "RMSNorm+Linear training step"))))


def ratio_rows(table: str, kinds: tuple[tuple[str, str], ...]) -> list[str]:
    """Per (kind, label): ours / torch pipelined over ``table``'s bfloat16 shapes (median, worst), GPU and commit."""
    stamp, rows = read_table(table)
    gpu = stamp.split(";")[0].removeprefix("GPU: ")
    out = []
    for kind, label in kinds:
        v = [float(r["pipe_vs_torch"]) for r in rows
             if (r["kind"], r["impl"], r["dtype"]) == (kind, "ours", "bfloat16")]
        if v:
            out.append(f"| {label}, {len(v)} shapes ({gpu}) | bfloat16 | median {statistics.median(v):.3g}, "
                       f"worst {max(v):.3g} | {stamp_commit(stamp, ('bfloat16', kind))} |")
    return out


def render() -> str:
    return "\n".join([BEGIN, "", *transformer_table(), "", *models_table(), "", *per_call_table(), "", END])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="compare only")
    args = p.parse_args()
    text = README.read_text()
    if BEGIN not in text or END not in text:
        print(f"README.md has no results markers ({BEGIN!r} ... {END!r})", file=sys.stderr)
        return 1
    head, rest = text.split(BEGIN, 1)
    new = head + render() + rest.split(END, 1)[1]
    if args.check:
        if new != text:
            print("README.md's results section is not what results/ gives: run python scripts/readme_tables.py",
                  file=sys.stderr)
            return 1
        return 0
    README.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
