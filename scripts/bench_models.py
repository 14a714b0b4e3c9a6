"""Hugging Face models, patched by ``ops.apply_to`` against the same model unpatched, end to end (issue 71).

Each model is built from its real config's sizes with random weights (seed 0), bf16, on the GPU: a Llama-shaped one
(12 layers, hidden 1024), Qwen2.5-0.5B-shaped, GPT-2 small, OPT-125m (8x512 tokens each), ViT-base (32 images) and
BERT-base (8x512 tokens). Contenders, each a copy of the same weights: "hf" the model as Hugging Face builds it,
"hf:again" a second copy of it (the run's noise floor), "ours" after ``ops.apply_to`` (its norms replaced, the
Llama-family layers' residual add and the norm, first projection and activation of GPT-2's, ViT's and OPT's MLPs
fused; the report says which), and "liger:rms_norm" where Liger-Kernel has the model (its RMSNorm on that instance
alone: its RoPE and SwiGLU patches replace module-level functions, which would change "hf" too). Before timing,
every contender's logits are compared with a float32 copy's: none may be further from them than 1.5x "hf"'s own
bf16 distance. Phases, eager: "infer" (a
forward under no_grad) and "train" (forward, a mean-square loss of the logits, backward, SGD step); pipelined time
per call (back-to-back calls, one sync, divided; median of runs interleaved across contenders), its ratio to "hf"'s
(paired per round), and host time per call. Mode "compile": the same phases of ``torch.compile(model)`` ("hf",
"hf:again", whose compile inductor's cache mostly answers, and "ours"; "ours:compiled_ops" too with
--ab-compiled-rmsnorm: compiling takes minutes). Mode "generate":
``generate()`` of 128 new tokens, greedy, after a 32-token prompt, at batch 1 and 8 (phases "generate1", "generate8";
ms per call, median of 9 rounds in rotated order, vs_hf paired per round; below 1 is more tokens per second). Writes
results/transformer.{csv,md} (table bench_models; a run of some modes or models keeps the others').

    python scripts/bench_models.py                       (needs a CUDA GPU and transformers: pip install -e .[hf])
    python scripts/bench_models.py --models llama,gpt2   (some models, printed and written)
    python scripts/bench_models.py --modes compile,generate --models llama,qwen2
    python scripts/bench_models.py --modes compile --ab-compiled-rmsnorm llama
    python scripts/bench_models.py --models vit,opt --ab-residual vit,opt
    python scripts/bench_models.py --modes eager,generate --ab-shared llama,vit,opt,bert
"""

from __future__ import annotations

import argparse
import copy
import sys
from collections.abc import Callable
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from check_targets import COMPILED_MODELS, GENERATE_MODELS, MODEL_LIMITS  # noqa: E402
from torch import nn  # noqa: E402

import ops  # noqa: E402
from ops import hf_blocks  # noqa: E402
from ops.bench import reports  # noqa: E402
from ops.bench.timing import paired_ratio, pipelined_runs  # noqa: E402
from ops.rmsnorm import config as rmsnorm_config  # noqa: E402

OUT = ROOT / "results"
FIELDS = ("model", "mode", "phase", "impl", "tokens", "ms", "vs_hf", "host_ms", "rel_err", "patched")
MODES = ("eager", "compile", "generate")
# each mode's models without --models: those issue 71 sets targets for (check_targets.py, their one source)
MODE_MODELS = {"eager": tuple(MODEL_LIMITS), "compile": COMPILED_MODELS, "generate": GENERATE_MODELS}
TOKENS = (8, 512)
IMAGES = 32
# --ab-compiled-rmsnorm: the patched model compiled with COMPILED_RMSNORM "ours" (our ops in the graph), beside "ours"
AB_CONTENDER = "ours:compiled_ops"
RESIDUAL_CONTENDER = "ours:residual"   # --ab-residual: apply_to(projections=False), a residual add fused instead
SHARED_CONTENDER = "ours:shared"   # --ab-shared: apply_to with hf_blocks.SHARED_INPUT_PROJECTIONS on
PROMPT, NEW_TOKENS, GENERATE_BATCHES = 32, 128, (1, 8)
GENERATE_ROUNDS = 9   # at 5, the hf:again control strayed to 0.805-0.915 in two of four cases (H200, 8c90381)


def configs(transformers: object) -> dict[str, tuple[Callable[[], nn.Module], str]]:
    """Per model: how to build it (random weights) and its input kind ("ids" or "pixels")."""
    t = transformers
    return {
        "llama": (lambda: t.LlamaForCausalLM(t.LlamaConfig(hidden_size=1024, intermediate_size=2816,
                                                            num_hidden_layers=12, num_attention_heads=16,
                                                            num_key_value_heads=16, vocab_size=32000)), "ids"),
        "qwen2": (lambda: t.Qwen2ForCausalLM(t.Qwen2Config(hidden_size=896, intermediate_size=4864,
                                                            num_hidden_layers=24, num_attention_heads=14,
                                                            num_key_value_heads=2, vocab_size=151936,
                                                            tie_word_embeddings=True)), "ids"),
        "gpt2": (lambda: t.GPT2LMHeadModel(t.GPT2Config()), "ids"),
        "opt": (lambda: t.OPTForCausalLM(t.OPTConfig()), "ids"),
        "vit": (lambda: t.ViTForImageClassification(t.ViTConfig()), "pixels"),
        "bert": (lambda: t.BertForMaskedLM(t.BertConfig()), "ids"),
    }


def liger_patch(name: str) -> Callable[[nn.Module], None] | None:
    """Liger-Kernel's RMSNorm on one instance of ``name``, or None where Liger is missing or has no such model."""
    try:
        import liger_kernel.transformers as lk
    except ImportError:
        return None
    apply = {"llama": getattr(lk, "apply_liger_kernel_to_llama", None),
             "qwen2": getattr(lk, "apply_liger_kernel_to_qwen2", None)}.get(name)
    if apply is None:
        return None
    return lambda m: apply(rope=False, swiglu=False, cross_entropy=False, fused_linear_cross_entropy=False,
                           rms_norm=True, model=m)


def logits_of(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = model(x)
    return out.logits


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max())


def contenders(name: str, build: Callable[[], nn.Module], ab: bool = False, ab_residual: bool = False,
               ab_shared: bool = False) -> tuple[dict[str, nn.Module], dict[str, str]]:
    """The contenders' models (bf16, on the GPU, the same weights) and what each patch did; ``ab``: also AB_CONTENDER,
    patched alike; ``ab_residual``: also RESIDUAL_CONTENDER; ``ab_shared``: also SHARED_CONTENDER."""
    torch.manual_seed(0)
    base = build().eval()
    models = {"hf": base, "hf:again": copy.deepcopy(base)}
    patched = {"hf": "", "hf:again": ""}
    patches = {"ours": {}} | ({AB_CONTENDER: {}} if ab else {}) | (
        {RESIDUAL_CONTENDER: {"projections": False}} if ab_residual else {}) | (
        {SHARED_CONTENDER: {}} if ab_shared else {})
    for impl, how in patches.items():
        models[impl] = copy.deepcopy(base)
        with mock.patch.object(hf_blocks, "SHARED_INPUT_PROJECTIONS", impl == SHARED_CONTENDER):
            report = ops.apply_to(models[impl], **how).report
        patched[impl] = (f"{len(report.replaced)} norms replaced, {len(report.fused)} blocks fused, "
                         f"{len(report.skipped)} skipped")
    if (patch := liger_patch(name)) is not None:
        models["liger:rms_norm"] = copy.deepcopy(base)
        patch(models["liger:rms_norm"])
        patched["liger:rms_norm"] = "Liger's RMSNorm on this instance"
    return {k: m.to("cuda", torch.bfloat16) for k, m in models.items()}, patched


def checked(name: str, models: dict[str, nn.Module], ref: nn.Module, x: torch.Tensor) -> dict[str, float]:
    """Each contender's logits' distance from the float32 model's (relative to its largest); fail loudly where one is
    further than 1.5x the unpatched bf16 model's."""
    with torch.no_grad():
        want = logits_of(ref, x.float() if x.is_floating_point() else x)
        errs = {k: rel_err(logits_of(m, x), want) for k, m in models.items()}
    if any(e > 1.5 * errs["hf"] + 1e-3 for e in errs.values()):
        raise SystemExit(f"{name}: logits too far from float32's: {errs}")
    return errs


def calls(models: dict[str, nn.Module], x: torch.Tensor, phase: str) -> dict[str, Callable[[], object]]:
    """Each contender's timed call of ``phase``."""
    out = {}
    for k, m in models.items():
        if phase == "infer":
            def infer(m: nn.Module = m) -> object:
                with torch.no_grad():
                    return logits_of(m, x)
            out[k] = infer
        else:
            opt = torch.optim.SGD(m.parameters(), lr=1e-6)

            def step(m: nn.Module = m, opt: torch.optim.Optimizer = opt) -> object:
                loss = logits_of(m, x).float().square().mean()
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                return loss
            out[k] = step
    return out


def bench(name: str, build: Callable[[], nn.Module], kind: str, mode: str, ab: bool = False,
          ab_residual: bool = False, ab_shared: bool = False) -> list[dict]:
    """The rows of one model in one mode: its contenders checked against float32, then timed; ``ab`` (mode "compile"):
    AB_CONTENDER too; ``ab_residual`` (mode "eager"): RESIDUAL_CONTENDER too; ``ab_shared`` (modes "eager" and
    "generate"): SHARED_CONTENDER too."""
    models, patched = contenders(name, build, ab and mode == "compile", ab_residual and mode == "eager",
                                 ab_shared and mode != "compile")
    torch.manual_seed(1)
    x = (torch.randint(0, 1000, TOKENS, device="cuda") if kind == "ids"
         else torch.randn(IMAGES, 3, 224, 224, device="cuda", dtype=torch.bfloat16))
    ref = copy.deepcopy(models["hf"]).float()
    errs = checked(name, models, ref, x)
    del ref
    if mode == "generate":
        return generated(name, models, patched, errs) if kind == "ids" else []
    if mode == "compile":
        models = {k: torch.compile(m) for k, m in models.items() if k in ("hf", "hf:again", "ours", AB_CONTENDER)}
    rows = []
    for phase in ("infer", "train"):
        fns = calls(models, x, phase)
        if AB_CONTENDER in fns:
            fns[AB_CONTENDER] = with_compiled_rmsnorm("ours", fns[AB_CONTENDER])
        for fn in fns.values():   # warm: the first calls load kernels and plans (and compile)
            fn(), fn()
        runs = pipelined_runs(fns, calls=3 if phase == "train" else 5, repeats=7, device=x.device)
        tokens = x.shape[0] * (x.shape[1] if kind == "ids" else 1)
        for impl, r in runs.items():
            rows.append({"model": name, "mode": mode, "phase": phase, "impl": impl, "tokens": tokens,
                         "ms": round(r.pipelined_us / 1e3, 3), "vs_hf": round(paired_ratio(r, runs["hf"]), 3),
                         "host_ms": round(r.host_us / 1e3, 3), "rel_err": round(errs[impl], 5),
                         "patched": patched[impl]})
        print(f"{name} {mode} {phase}: " + " | ".join(f"{r['impl']} {r['ms']} ms ({r['vs_hf']})"
                                                     for r in rows[-len(runs):]), flush=True)
    return rows


def with_compiled_rmsnorm(form: str, fn: Callable[[], object]) -> Callable[[], object]:
    """``fn`` run with ``COMPILED_RMSNORM`` set to ``form`` (what its compiled graph traces, at every compile)."""
    def call() -> object:
        before, rmsnorm_config.COMPILED_RMSNORM = rmsnorm_config.COMPILED_RMSNORM, form
        try:
            return fn()
        finally:
            rmsnorm_config.COMPILED_RMSNORM = before
    return call


def generated(name: str, models: dict[str, nn.Module], patched: dict[str, str], errs: dict[str, float]) -> list[dict]:
    """Mode "generate": each contender's ``generate()`` of NEW_TOKENS greedy tokens per batch, ms per call: after one
    warm call of the full length each, GENERATE_ROUNDS rounds with the contenders' order rotated (``pipelined_runs``,
    one call a run), medians, and vs_hf paired per round."""
    rows = []
    for batch in GENERATE_BATCHES:
        ids = torch.randint(0, 1000, (batch, PROMPT), device="cuda")

        def run(m: nn.Module, ids: torch.Tensor = ids) -> None:
            out = m.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                             pad_token_id=0)
            assert out.shape[1] == PROMPT + NEW_TOKENS
        fns = {k: (lambda m=m: run(m)) for k, m in models.items()}
        for fn in fns.values():   # warm, at the timed length: the KV cache's sizes, the kernels' first calls
            fn()
        runs = pipelined_runs(fns, calls=1, repeats=GENERATE_ROUNDS)
        rows += [{"model": name, "mode": "generate", "phase": f"generate{batch}", "impl": k,
                  "tokens": batch * NEW_TOKENS, "ms": round(r.pipelined_us / 1e3, 2),
                  "vs_hf": round(paired_ratio(r, runs["hf"]), 3), "host_ms": "", "rel_err": round(errs[k], 5),
                  "patched": patched[k]} for k, r in runs.items()]
        print(f"{name} generate batch {batch}: " + " | ".join(f"{r['impl']} {r['ms']} ms ({r['vs_hf']})"
                                                            for r in rows[-len(runs):]), flush=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", help="comma-separated (default: each mode's MODE_MODELS); the table keeps the "
                                         "other models' rows of the modes run, and other modes' rows")
    parser.add_argument("--modes", default="eager", help=f"comma-separated, of {','.join(MODES)}")
    parser.add_argument("--ab-compiled-rmsnorm", default="", metavar="MODELS",
                        help=f"mode compile, for these models (comma-separated): also {AB_CONTENDER}, compiled with "
                             "COMPILED_RMSNORM 'ours'")
    parser.add_argument("--ab-residual", default="", metavar="MODELS",
                        help=f"mode eager, for these models (comma-separated): also {RESIDUAL_CONTENDER}, patched with "
                             "projections=False (ViT's and OPT's residual add fused instead of their MLP's projection)")
    parser.add_argument("--ab-shared", default="", metavar="MODELS",
                        help=f"modes eager and generate, for these models (comma-separated): also {SHARED_CONTENDER}, "
                             "patched with SHARED_INPUT_PROJECTIONS on (q/k/v and gate/up as one linears)")
    args = parser.parse_args()
    modes = args.modes.split(",")
    if unknown := set(modes) - set(MODES):
        parser.error(f"--modes: {sorted(unknown)} not of {list(MODES)}")
    if not torch.cuda.is_available():
        print("bench_models needs a CUDA GPU", file=sys.stderr)
        return 2
    import transformers

    table = configs(transformers)
    stamp = f"GPU: {reports.gpu_name()}; commit {reports.commit()}; transformers {transformers.__version__}; bf16"
    rows: list[dict] = []
    for mode in modes:
        for name in args.models.split(",") if args.models else MODE_MODELS[mode]:   # written after each model
            rows += bench(name, *table[name], mode, name in args.ab_compiled_rmsnorm.split(","),
                          name in args.ab_residual.split(","), name in args.ab_shared.split(","))
            kept, kept_stamp = reports.appended("bench_models", ",".join(modes), rows, "mode",
                                                ("model", args.models) if args.models else None)
            reports.write_report(OUT / "bench_models", kept, FIELDS, stamp + kept_stamp,
                                 "Hugging Face models, patched by ops.apply_to (scripts/bench_models.py)",
                                 __doc__.split("\n\n")[1].replace("\n", " "))
    reports.print_rows(rows, FIELDS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
