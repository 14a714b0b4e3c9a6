"""The direct launcher's PTX build: runs on any machine (no GPU), so CI exercises it."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from ops.bench.timing import captured, kernel_times
from ops.launch import bridge, direct, packages, plans
from ops.launch import ptx as ptxlib
from ops.layernorm import config as config
from ops.layernorm_linear import config as lnl_config

ROOT = Path(__file__).resolve().parent.parent

SPEC = config.reduce_spec(torch.float32, 768)


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh cache directory (and fresh source digests) for this test."""
    monkeypatch.setenv("OPS_CACHE_DIR", str(tmp_path / "cache"))
    packages.forget_digests()
    yield tmp_path / "cache"
    packages.forget_digests()


def test_build_writes_ptx_once(cache: Path) -> None:
    assert ptxlib.build([SPEC], "H100", quiet=True) == 1
    ptx = ptxlib.ptx_path(SPEC, "H100").read_text()
    assert ".target sm_90a" in ptx
    name = ptxlib.entry_name(ptx)
    assert name.startswith("kernels_layernorm_ln_bwd_reduc")   # the module and the (shortened) function name
    # the entry takes what KernelSpec.args says: four pointers, then two Int32
    params = ptx[ptx.index(name + "("):ptx.index(")", ptx.index(name + "("))]
    assert params.count(".param .u64") == 4 and params.count(".param .b32") == 2
    assert ptxlib.build([SPEC], "H100", quiet=True) == 0   # cached


def test_edited_kernel_is_rebuilt(cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A changed kernel source gives a new cache directory: the old PTX is never launched for it."""
    package = tmp_path / "kernels"
    shutil.copytree(bridge.LIBRARY, package)
    monkeypatch.setattr(ptxlib, "LIBRARY", package)
    before = ptxlib.ptx_dir("H100")
    src = package / "layernorm.mojo"
    src.write_text(src.read_text() + "\n# edited\n")
    packages.forget_digests()
    assert ptxlib.ptx_dir("H100") != before
    assert ptxlib.build([SPEC], "H100", quiet=True) == 1


def test_every_default_kernel_has_a_spec() -> None:
    """poe build-kernels covers what the choice functions launch, and each spec names a real kernel."""
    specs = config.all_specs()
    assert len(specs) == len(set(specs))
    assert {s.name for s in specs} >= {"ln_fwd_regs", "ln_fwd_cluster", "ln_fwd_loop", "ln_bwd_regs", "ln_bwd_loop",
                                       "ln_bwd_reduce", "ln_fwd_row_thread", "ln_fwd_block_smem"}
    source = (bridge.LIBRARY / "layernorm.mojo").read_text()
    assert all(f"def {s.name}[" in source for s in specs)
    # what the choice functions pick at odd and even shapes, few rows and many, aligned or not, is among them
    aligned = lambda h, dtype, vec_ok: vec_ok and h % config.vector_width(dtype) == 0   # noqa: E731
    chosen = {config.fwd_launch(rows, h, dtype, aligned(h, dtype, vec_ok), variant).spec(dtype, act)
              for dtype in config.DTYPES for act in config.ACTS for variant in config.VARIANTS
              for rows in (1, 7, 131, 132, 4096) for h in (1, 37, 768, 1023, 1025, 4096, 65536, 131072)
              for vec_ok in (True, False)}
    chosen |= {config.bwd_launch(parts, h, dtype, aligned(h, dtype, vec_ok)).spec(dtype, act)
               for dtype in config.DTYPES for act in config.ACTS for parts in (1, 128, 132, 264, 1584)
               for h in (1, 37, 768, 1025, 4096, 65536) for vec_ok in (True, False)}
    assert chosen <= set(specs), sorted(s.expr for s in chosen - set(specs))


# Constants the config modules take from the kernel sources (ops/launch/mojo_constants.py), by kernel module.
READ = {"layernorm_linear": ("TILE_THREADS", "TILE_ROWS", "TILE_COLS", "STAGE_THREADS_PER_ROW", "MMA_STAGES",
                                 "MMA_STEP_K", "MMA_SMEM_BYTES", "FINISH_ROWS", "FINISH_COLS", "FOLD_THREADS"),
            "layernorm_linear_sm90": ("PREP_WARPS", "WG_TILE_ROWS", "WG_TILE_COLS", "WG_SLOT_K", "WG_STAGES",
                                      "WG_THREADS", "WG_ROWS", "WG_BOX", "WG_EXT_COLS", "WG_SMEM_BYTES"),
            "layernorm": ("REDUCE_NARROW_MAX_H", "REDUCE_NARROW_COLS", "REDUCE_NARROW_LEVELS", "REDUCE_WIDE_COLS",
                          "REDUCE_WIDE_LEVELS", "TRANSPOSE_TILE", "TRANSPOSE_THREADS")}
CONFIGS = {"layernorm_linear": lnl_config, "layernorm_linear_sm90": lnl_config, "layernorm": config}


def test_kernel_constants_are_read_as_mojo_defines_them(cache: Path) -> None:
    """The config modules launch what the Mojo host code launches: the constants they read from the kernel sources
    (ops/launch/mojo_constants.py) are the values Mojo itself prints, and every fused, Hopper and copy instantiation
    builds to PTX whose entry takes the arguments its spec lists (pointers, 32-bit scalars, 128-byte TMA descriptors
    aligned to 64)."""
    from mojo.run import subprocess_run_mojo

    names = [(module, name) for module, names in READ.items() for name in names]
    program = cache / "constants.mojo"
    program.parent.mkdir(parents=True)
    program.write_text("".join(f"from kernels.{m} import {n}\n" for m, n in names)
                       + "\ndef main():\n" + "".join(f"    print({n})\n" for _, n in names))
    proc = subprocess_run_mojo(["run", "-I", str(bridge.LIBRARY.parent), str(program)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert dict(zip([n for _, n in names], map(int, proc.stdout.split()), strict=True)) == {
        n: getattr(CONFIGS[m], n) for m, n in names}
    specs = [*lnl_config.all_specs(), *(config.transpose_spec(d) for d in config.DTYPES)]
    assert ptxlib.build(specs, "H100", quiet=True) == len(specs)
    for spec in specs:
        ptx = ptxlib.ptx_path(spec, "H100").read_text()
        head = ptx[ptx.index(".visible .entry"):]
        params = head[:head.index(")")]
        assert params.count(".param .u64") == spec.args.count("p"), spec.expr
        assert params.count(".param .b32") + params.count(".param .f32") == spec.args.count("i") + spec.args.count(
            "f"), spec.expr
        assert params.count(".param .align 64 .b8") == spec.args.count("t"), spec.expr


def test_unknown_architecture_has_no_build() -> None:
    with pytest.raises(ptxlib.NoBuildError, match="sm_75"):
        ptxlib.target_for((7, 5))
    assert ptxlib.target_for((9, 0)) == ("H100", "sm_90a")


def test_argument_layout() -> None:
    """Pointers 8-aligned, Int32/Float32 4-aligned, TMA descriptors 64-aligned, as the PTX params are."""
    fmt, offsets, size = direct._layout("pif t".replace(" ", ""))
    assert offsets == [0, 8, 12, 64] and size == 192


# ---------------------------------------------------------------- the C++ entries (ops/launch/direct.cpp)

class _Recorder:
    """Stands in for torch.ops.mojo_direct: records each setter's call."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []

    def __getattr__(self, name: str) -> object:
        return lambda value: self.calls.append((name, value))


def test_on_native_load_runs_at_loading_or_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A hook given before the C++ entries load runs when they do; one given after, at once."""
    monkeypatch.setattr(direct, "_on_load", [])
    monkeypatch.setattr(direct.NATIVE, "ops", None)
    seen: list[object] = []
    direct.on_native_load(seen.append)
    assert seen == [] and direct._on_load == [seen.append]
    fake = _Recorder()
    monkeypatch.setattr(direct.NATIVE, "ops", fake)
    direct.on_native_load(seen.append)
    assert seen == [fake]


def test_layernorm_linear_hands_its_tuning_to_the_cpp_side() -> None:
    """ops.layernorm_linear registers its tuning of the C++ GEMMs when imported (checked in a fresh interpreter,
    before anything loads the C++ entries), with its config's values."""
    from ops import layernorm_linear as LL

    code = ("from ops import layernorm_linear as LL; from ops.launch import direct;"
            "print(direct.NATIVE.ops is None and LL.launch.configure_native in direct._on_load)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "True", out.stdout + out.stderr
    fake = _Recorder()
    LL.launch.configure_native(fake)
    assert fake.calls == [("set_gemm_tuning", lnl_config.LT_NO_WORKSPACE_MAX_K_PER_N),
                          ("set_capture_overlap", lnl_config.CAPTURED_WEIGHT_GRADS_BESIDE),
                          ("set_accumulate_beside", lnl_config.CAPTURED_GRADS_ACCUMULATED_BESIDE_MAX_ROWS)]


def test_native_builds_loads_and_declines_what_it_does_not_take() -> None:
    """The C++ library builds against the installed torch (CI has a compiler) and loads; its entries return None
    (the Python route runs) for CPU tensors, and its plan tables fill and clear."""
    native = direct.load_native()
    assert native.ops is not None, "the C++ launcher did not build (see the warning)"
    x, w, b = torch.randn(4, 8), torch.ones(8), torch.zeros(8)
    assert native.layernorm(x, w, b, 1e-5, 0) is None
    assert native.layernorm_linear(x, w, b, torch.randn(3, 8), None, 1e-5, 0) is None
    assert native.layernorm_bwd_with_plan(torch.ones(4, 8), x, w, b, torch.zeros(4), torch.ones(4), 0) == []
    native.ops.clear_plans()
    native.ops.set_fwd_plan(4, 8, torch.bfloat16, True, 0, 0, 1, [1, 1, 1], 32, 1)
    native.ops.set_linear_algo(4, 8, 3, torch.bfloat16, 0, 0, False, False, True)
    native.ops.set_fused_plan(4, 8, 3, torch.bfloat16, 0, 0, 31, lnl_config.KIND_FUSED16, [1, 2], [1, 1, 1, 2, 1, 1],
                              [256, 128], [0, 1024], [1, 64, 4096, 128, 1], None, torch.zeros(3))
    with pytest.raises(RuntimeError, match="inconsistent"):
        native.ops.set_fused_plan(4, 8, 3, torch.bfloat16, 0, 0, 31, 1, [1, 2], [1, 1, 1], [256], [0], [], None,
                                  torch.zeros(3))
    assert native.ops.plan_counts() == [1, 0, 1, 1]
    native.ops.clear_plans()
    assert native.ops.plan_counts() == [0, 0, 0, 0]


class _NoReads:
    """A stand-in for ``direct.NATIVE`` that fails any read of an entry."""

    def __getattr__(self, name: str) -> object:
        raise AssertionError(f"NATIVE.{name} read while torch.compile traces")


def test_no_native_entry_read_while_compiling(monkeypatch: pytest.MonkeyPatch) -> None:
    """While dynamo traces, the public entries do not read the C++ entries: dynamo guards on what a traced frame
    reads, and on torch 2.11 a guard on a builtin function fails the compile (AssertionError 'Unexpected type'),
    which broke torch.compile of a model with our modules on the H100."""
    from ops import layernorm as L
    from ops import layernorm_linear as LL

    monkeypatch.setattr(direct, "NATIVE", _NoReads())
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    x, w, b = torch.randn(4, 8), torch.ones(8), torch.zeros(8)
    with torch.no_grad():
        assert torch.allclose(L.layernorm_fwd(x, w, b)[0], torch.nn.functional.layer_norm(x, (8,), w, b), atol=1e-5)
        assert L.layernorm(x, w, b).shape == (4, 8)
        assert LL.layernorm_linear(x, w, b, torch.randn(3, 8)).shape == (4, 3)


def test_native_plans_cleared_together(monkeypatch: pytest.MonkeyPatch) -> None:
    """``remember`` hands each plan over once, and at PLANS_MAX clears Python's record and the C++ tables
    together (a plan Python believes handed over is never missing there)."""
    native = direct.load_native().ops
    plans.forget_plans()
    monkeypatch.setattr(plans, "PLANS_MAX", 2)
    calls = []

    def register(rows: int) -> object:
        return lambda ops: (calls.append(rows), ops.set_fwd_plan(rows, 8, torch.float32, True, 0, 0, 1, [1, 1, 1],
                                                                 32, 1))
    for rows in (1, 2, 1, 2):
        plans.remember(("ln_fwd", rows), register(rows))
    assert calls == [1, 2] and native.plan_counts()[0] == 2
    plans.remember(("ln_fwd", 3), register(3))   # the third: both sides cleared, then 3 kept
    assert native.plan_counts()[0] == 1 and plans._native_keys == {("ln_fwd", 3)}
    plans.forget_plans()


def test_native_library_follows_its_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An edited C++ source or part (or another torch) gets another library path: an old build is never
    loaded for it."""
    before = direct.native_library_path()
    src = tmp_path / "direct.cpp"
    src.write_text(direct.NATIVE_SOURCE.read_text() + "\n// edited\n")
    monkeypatch.setattr(direct, "NATIVE_SOURCE", src)
    edited = direct.native_library_path()
    parts = tmp_path / "native"
    shutil.copytree(direct.NATIVE_PARTS, parts)
    (parts / "layernorm.h").write_text((parts / "layernorm.h").read_text() + "\n// edited\n")
    monkeypatch.setattr(direct, "NATIVE_PARTS", parts)
    part_edited = direct.native_library_path()
    monkeypatch.setattr(torch, "__version__", "0.0.0")
    assert len({before, edited, part_edited, direct.native_library_path()}) == 4


@pytest.mark.parametrize("with_bias", [True, False])
def test_traced_linear_fake_and_autograd_kernel(with_bias: bool) -> None:
    """``mojo_direct.traced_linear`` (torch.compile's Linear in a training graph, COMPILED_TRAINING_LINEAR): its
    fake and its C++ autograd kernel (whose backward is ``linear_grads``) pass ``torch.library.opcheck``, and
    gradcheck in float64 on the CPU, where both ops run torch's GEMMs (a GPU test runs their cuBLASLt plans)."""
    from ops import layernorm_linear as LL

    assert direct.load_native().ops is not None, "the C++ launcher did not build (see the warning)"
    assert LL.traced.native_linear_traceable()
    torch.manual_seed(0)
    xn = torch.randn(2, 5, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 8, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(3, dtype=torch.float64, requires_grad=True) if with_bias else None
    torch.library.opcheck(torch.ops.mojo_direct.traced_linear.default, (xn, w, bias))
    plain, dy = (xn.detach(), w.detach()), torch.randn(2, 5, 3, dtype=torch.float64)
    for weight_grad in (True, False):   # False: a frozen weight, dweight empty
        torch.library.opcheck(torch.ops.mojo_direct.linear_grads.default, (dy, *plain, with_bias, weight_grad))
    assert torch.autograd.gradcheck(lambda *t: torch.ops.mojo_direct.traced_linear(*t, bias), (xn, w))
    if with_bias:
        assert torch.autograd.gradcheck(lambda b: torch.ops.mojo_direct.traced_linear(xn, w, b), (bias,))


@pytest.mark.parametrize("with_bias", [True, False])
def test_linear_gelu_fake_and_cpu_result(with_bias: bool) -> None:
    """``mojo_direct.linear_gelu`` (what the inductor pass puts in place of linear and a tanh GELU): its fake passes
    ``torch.library.opcheck``, and on the CPU (torch's ops) it is bitwise ``F.gelu(F.linear(..), "tanh")``."""
    from ops import layernorm_linear as LL

    assert direct.load_native().ops is not None, "the C++ launcher did not build (see the warning)"
    assert LL.traced.native_linear_traceable()
    torch.manual_seed(0)
    xn, w = torch.randn(2, 5, 8), torch.randn(3, 8)
    bias = torch.randn(3) if with_bias else None
    torch.library.opcheck(torch.ops.mojo_direct.linear_gelu.default, (xn, w, bias))
    want = torch.nn.functional.gelu(torch.nn.functional.linear(xn, w, bias), approximate="tanh")
    assert torch.equal(torch.ops.mojo_direct.linear_gelu(xn, w, bias), want)


@pytest.mark.parametrize("bias_grad_in_gemm", [True, False])
@pytest.mark.parametrize("shape", [(2, 5, 8), (8,)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_traced_linear_gelu_fake_and_autograd_kernel(with_bias: bool, shape: tuple[int, ...],
                                                     bias_grad_in_gemm: bool) -> None:
    """``mojo_direct.traced_linear_gelu`` (the pass's GEMM with GELU in a training graph): it and its forward and
    backward ops (``linear_gelu_aux``: GELU's output and input; ``linear_gelu_grads``) pass ``opcheck``, and its C++
    autograd kernel gradcheck in float64 on the CPU (torch's ops there; a GPU test runs the cuBLASLt plans), with
    db from the GEMM's op or from torch's sum (``bias_grad_in_gemm``), for x of any rank."""
    from ops import layernorm_linear as LL

    assert direct.load_native().ops is not None and LL.traced.native_linear_traceable()
    ops = torch.ops.mojo_direct
    torch.manual_seed(0)
    xn = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 8, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(3, dtype=torch.float64, requires_grad=True) if with_bias else None
    torch.library.opcheck(ops.traced_linear_gelu.default, (xn, w, bias, bias_grad_in_gemm))
    y, h = ops.linear_gelu_aux(xn, w, bias)
    assert torch.equal(h, torch.nn.functional.linear(xn, w, bias))
    assert torch.equal(y, torch.nn.functional.gelu(h, approximate="tanh"))
    dy = torch.randn_like(y)
    plain = [None if t is None else t.detach() for t in (xn, w, bias, h)]
    torch.library.opcheck(ops.linear_gelu_aux.default, tuple(plain[:3]))
    for weight_grad in (True, False):   # False: a frozen weight, dweight empty
        torch.library.opcheck(ops.linear_gelu_grads.default, (dy, plain[0], plain[1], plain[3], with_bias, weight_grad))
    assert torch.autograd.gradcheck(lambda *t: ops.traced_linear_gelu(*t, bias, bias_grad_in_gemm), (xn, w))
    if with_bias:
        assert torch.autograd.gradcheck(lambda b: ops.traced_linear_gelu(xn, w, b, bias_grad_in_gemm), (bias,))


def _call_targets(gm: torch.fx.GraphModule) -> list:
    """The ops ``gm``'s graph calls, in order."""
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def _aot_graphs(fn: Callable, args: list, names: tuple[str, ...]) -> list[torch.fx.GraphModule]:
    """``fn(*args)`` through AOTAutograd, its graphs run as they are: asserts that the gradients of its sum equal
    eager autograd's for the args that want one (each named by ``names``) and returns its forward and backward
    graphs."""
    from functorch.compile import aot_function, make_boxed_func

    graphs = []

    def keep(gm: torch.fx.GraphModule, _: object) -> Callable:
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    wanted = [(name, a) for name, a in zip(names, args, strict=True) if a is not None and a.requires_grad]
    leaves = [a for _, a in wanted]
    got = torch.autograd.grad(aot_function(fn, fw_compiler=keep, bw_compiler=keep)(*args).sum(), leaves)
    for (name, _), g, want in zip(wanted, got, torch.autograd.grad(fn(*args).sum(), leaves), strict=True):
        assert torch.equal(g, want), name
    return graphs


def _aot_call_targets(fn: Callable, args: list, names: tuple[str, ...]) -> list[list]:
    """``_aot_graphs``' checks; the ops its forward and backward graphs call."""
    return [_call_targets(gm) for gm in _aot_graphs(fn, args, names)]


@pytest.mark.parametrize("bias_grad_in_gemm", [True, False])
def test_traced_linear_gelu_backward_graph(bias_grad_in_gemm: bool) -> None:
    """AOTAutograd's backward graph of ``traced_linear_gelu`` with a bias: ``linear_gelu_grads`` (db in the GEMM's
    epilogue), or torch's ``gelu_backward`` and ``sum`` (for inductor to make one kernel) and ``linear_grads`` without
    db; its gradients equal eager autograd's."""
    from ops import layernorm_linear as LL

    assert direct.load_native().ops is not None and LL.traced.native_linear_traceable()
    ops = torch.ops.mojo_direct
    args = _linear_leaves()
    fn = lambda *t: ops.traced_linear_gelu(*t, bias_grad_in_gemm)  # noqa: E731
    backward = set(_aot_call_targets(fn, args, ("x", "w", "b"))[1])
    assert (ops.linear_gelu_grads.default in backward) == bias_grad_in_gemm, backward
    assert ({torch.ops.aten.gelu_backward.default, torch.ops.aten.sum.dim_IntList, ops.linear_grads.default}
            <= backward) == (not bias_grad_in_gemm), backward


def _linear_leaves() -> list:
    """float64 CPU leaves (xn [4, 5, 8], W [3, 8], bias [3]) that want grads."""
    torch.manual_seed(0)
    return [torch.randn(*s, dtype=torch.float64, requires_grad=True) for s in ((4, 5, 8), (3, 8), (3,))]


def _layernorm_linear_leaves(shape: tuple[int, ...], with_bias: bool) -> list:
    """float64 CPU leaves (x of ``shape``, LayerNorm's weight and bias, W [3, K], bias or None) that want grads."""
    torch.manual_seed(0)
    k = shape[-1]
    leaves = [torch.randn(*s, dtype=torch.float64, requires_grad=True) for s in (shape, (k,), (k,), (3, k))]
    return [*leaves, torch.randn(3, dtype=torch.float64, requires_grad=True) if with_bias else None]


@pytest.mark.parametrize("act", [0, 1])
@pytest.mark.parametrize("shape", [(2, 5, 8), (8,)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_traced_layernorm_linear_fake_and_autograd_kernel(with_bias: bool, shape: tuple[int, ...], act: int) -> None:
    """``mojo_direct.traced_layernorm_linear`` (the training graph's one-op LayerNorm+Linear, act 1 with the tanh
    GELU): it and its forward and backward ops pass ``opcheck``; y, xn, the statistics and GELU's input equal torch's
    ops' (float64 on the CPU: torch's ops there; a GPU test runs ours), and its C++ autograd kernel gradchecks, for x
    of any rank."""
    from ops import layernorm_linear as LL

    assert direct.load_native().ops is not None and LL.traced.native_linear_traceable()
    ops, F = torch.ops.mojo_direct, torch.nn.functional
    x, lnw, lnb, w, bias = leaves = _layernorm_linear_leaves(shape, with_bias)
    torch.library.opcheck(ops.traced_layernorm_linear.default, (*leaves, 1e-5, act))
    plain = [None if t is None else t.detach() for t in leaves]
    torch.library.opcheck(ops.layernorm_linear_train_fwd.default, (*plain, 1e-5, act))
    y, xn, mean, rstd, h = ops.layernorm_linear_train_fwd(*plain, 1e-5, act)
    want_xn = F.layer_norm(plain[0], shape[-1:], plain[1], plain[2], 1e-5)
    torch.testing.assert_close(xn, want_xn, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(mean, plain[0].mean(-1), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(rstd, (plain[0].var(-1, unbiased=False) + 1e-5).rsqrt(), rtol=1e-12, atol=1e-12)
    want_h = F.linear(xn, plain[3], plain[4])
    assert torch.equal(h, want_h if act else h.new_empty(0))
    assert torch.equal(y, F.gelu(want_h, approximate="tanh") if act else want_h)
    dy = torch.randn_like(y)
    for weight_grad in (True, False):   # False: a frozen weight, dweight empty
        torch.library.opcheck(ops.layernorm_linear_grads.default, (dy, plain[0], xn, *plain[1:4], mean, rstd, h, act,
                                                                   with_bias, weight_grad))
    wanted = [t for t in leaves if t is not None]
    assert torch.autograd.gradcheck(lambda *t: ops.traced_layernorm_linear(*t[:4], t[4] if with_bias else None,
                                                                           1e-5, act), tuple(wanted))


@pytest.mark.parametrize("act", [0, 1])
def test_traced_layernorm_linear_backward_graph(act: int) -> None:
    """AOTAutograd's graphs of ``traced_layernorm_linear``: one op each way (``layernorm_linear_train_fwd``, then
    ``layernorm_linear_grads``), and gradients equal to eager autograd's."""
    from ops import layernorm_linear as LL

    assert direct.load_native().ops is not None and LL.traced.native_linear_traceable()
    ops = torch.ops.mojo_direct
    args = _layernorm_linear_leaves((4, 5, 8), True)
    fn = lambda *t: ops.traced_layernorm_linear(*t, 1e-5, act)  # noqa: E731
    graphs = _aot_call_targets(fn, args, ("x", "lnw", "lnb", "w", "b"))
    forward, backward = ([t for t in g if getattr(t, "namespace", None) == "mojo_direct"] for g in graphs)
    assert forward == [ops.layernorm_linear_train_fwd.default], graphs[0]
    assert backward == [ops.layernorm_linear_grads.default], graphs[1]


@pytest.mark.parametrize("frozen", [("w",), ("b",), ("w", "b")])
@pytest.mark.parametrize("op", ["traced_linear", "traced_linear_gelu", "traced_layernorm_linear"])
def test_traced_backward_skips_a_frozen_parameters_gradient(op: str, frozen: tuple[str, ...]) -> None:
    """A weight or bias that wants no gradient (fine-tuning part of a model): the traced ops' backward graph asks its
    gradients' op for no dW (weight_grad False: no GEMM for it) and no db, and the inputs that want gradients get
    eager autograd's."""
    from ops import layernorm_linear as LL

    assert direct.load_native().ops is not None and LL.traced.native_linear_traceable()
    ops = torch.ops.mojo_direct
    if op == "traced_layernorm_linear":
        args, names = _layernorm_linear_leaves((4, 5, 8), True), ("x", "lnw", "lnb", "w", "b")
        fn, grads_op = (lambda *t: ops.traced_layernorm_linear(*t, 1e-5, 1)), ops.layernorm_linear_grads.default
    else:
        args = _linear_leaves()
        names, fn = ("xn", "w", "b"), getattr(ops, op)
        grads_op = ops.linear_grads.default if op == "traced_linear" else ops.linear_gelu_grads.default
    for name, a in zip(names, args, strict=True):
        a.requires_grad_(name not in frozen)
    backward = _aot_graphs(fn, args, names)[1]
    calls = [n for n in backward.graph.nodes if n.target == grads_op]
    assert len(calls) == 1, backward.graph
    schema = {a.name: i for i, a in enumerate(grads_op._schema.arguments)}
    given = calls[0].args
    wants = {flag: given[schema[flag]] if len(given) > schema[flag] else calls[0].kwargs.get(flag, True)
             for flag in ("weight_grad", "bias_grad")}
    assert wants == {"weight_grad": "w" not in frozen, "bias_grad": "b" not in frozen}, calls[0]


@pytest.fixture
def free_pre_grad_pass() -> Iterator[None]:
    """Inductor's pre-grad custom pass emptied for the test and restored after, by its ``config.patch``
    (monkeypatch would delete the entry on undo: a ConfigModule's options are not in its ``__dict__``)."""
    from torch._inductor import config as inductor_config

    with inductor_config.patch(pre_grad_custom_pass=None):
        yield


def _gelu_after(linear: object, approximate: str = "tanh", second_user: bool = False) -> torch.fx.GraphModule:
    """A graph of ``gelu(linear(xn, w, b))`` as dynamo records it (``torch._C._nn.gelu``), with the Linear's output
    also returned where ``second_user``."""
    def f(xn: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> object:
        y = linear(xn, w, b)
        out = torch._C._nn.gelu(y, approximate=approximate)
        return (out, y) if second_user else out
    return torch.fx.symbolic_trace(f)


@pytest.mark.parametrize(("case", "fused"), [("ours", 1), ("ours_overload", 1), ("erf", 0),
                                             ("second_user", 0), ("torch_linear", 0), ("switched_off", 0)])
def test_gelu_epilogue_pass_rewrites_only_our_linears_tanh_gelu(case: str, fused: int,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """ops/layernorm_linear/inductor.py: a tanh GELU that is our Linear's only user becomes ``linear_gelu``, with the
    graph's results unchanged (bitwise, on the CPU); the erf GELU, a Linear used twice, torch's own Linear, and
    everything while COMPILED_LINEAR_GELU is off stay as they are."""
    from ops import layernorm_linear as LL
    from ops.layernorm_linear import config as layernorm_linear_config
    from ops.layernorm_linear import inductor as LLI

    assert direct.load_native().ops is not None and LL.traced.native_linear_traceable()
    ours = torch.ops.mojo_direct.linear
    gm = {"ours": lambda: _gelu_after(ours), "ours_overload": lambda: _gelu_after(ours.default),
          "erf": lambda: _gelu_after(ours, "none"), "second_user": lambda: _gelu_after(ours, second_user=True),
          "torch_linear": lambda: _gelu_after(torch.nn.functional.linear),
          "switched_off": lambda: _gelu_after(ours)}[case]()
    monkeypatch.setattr(layernorm_linear_config, "COMPILED_LINEAR_GELU", case != "switched_off")
    torch.manual_seed(0)
    args = (torch.randn(4, 8), torch.randn(3, 8), torch.randn(3))
    before = gm(*args)
    had = _call_targets(gm)
    LLI.PASS(gm.graph)
    gm.recompile()
    after = _call_targets(gm)
    assert after.count(torch.ops.mojo_direct.linear_gelu.default) == fused
    assert after == had if not fused else len(after) == len(had) - 1
    assert all(torch.equal(a, b) for a, b in zip(torch.utils._pytree.tree_leaves(gm(*args)),
                                                 torch.utils._pytree.tree_leaves(before), strict=True))


@pytest.mark.parametrize(("case", "unfused"), [("auto", True), ("sm90_by_name", False), ("float32", False),
                                               ("our_compiled_layernorm", False)])
def test_gelu_epilogue_pass_unfuses_the_fused_inference_forward(case: str, unfused: bool,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A tanh GELU after ``layernorm_linear_infer`` (auto's fused or Hopper forward) of 16-bit x becomes torch's
    ``layer_norm`` then ``linear_gelu`` (bitwise the unfused expression, on the CPU); an algo asked for by name,
    float32 x, and our own compiled LayerNorm keep the forward and inductor's GELU."""
    from ops import layernorm_linear as LL
    from ops.layernorm import config as layernorm_config
    from ops.layernorm_linear import inductor as LLI

    assert direct.load_native().ops is not None and LL.traced.native_linear_traceable()
    ops = torch.ops.mojo_direct
    algo = LL.config.ALGO_IDS["sm90" if case == "sm90_by_name" else "auto"]
    dtype = torch.float32 if case == "float32" else torch.bfloat16
    monkeypatch.setattr(layernorm_config, "COMPILED_LAYERNORM", "ours" if case == "our_compiled_layernorm" else
                        "inductor")
    gm = torch.fx.symbolic_trace(lambda x, lnw, lnb, w, b: torch._C._nn.gelu(
        ops.layernorm_linear_infer(x, lnw, lnb, w, b, 1e-5, algo), approximate="tanh"))
    torch.manual_seed(0)
    args = [t.to(dtype) for t in (torch.randn(4, 8) * 3 + 1, 1 + torch.randn(8) / 5, torch.randn(8) / 5,
                                  torch.randn(6, 8), torch.randn(6))]
    next(iter(gm.graph.nodes)).meta["example_value"] = args[0]
    assert LLI.fuse_linear_gelu(gm.graph) == unfused
    gm.recompile()
    targets = _call_targets(gm)
    if not unfused:
        assert targets == [ops.layernorm_linear_infer, torch._C._nn.gelu]
        return
    assert targets == [getattr, torch.nn.functional.layer_norm, ops.linear_gelu.default]
    x, lnw, lnb, w, b = args
    want = torch.nn.functional.gelu(torch.nn.functional.linear(
        torch.nn.functional.layer_norm(x, (8,), lnw, lnb, 1e-5), w, b), approximate="tanh")
    assert torch.equal(gm(*args), want)


@pytest.mark.parametrize("training_linear", ["inductor", "ours"])
def test_gelu_epilogue_pass_on_training_marks(training_linear: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """In a training graph the pass turns ``gelu(traced_linear)`` (tanh) into ``traced_linear_gelu`` and each other
    ``traced_linear`` (a mark) back into ``F.linear``, unless COMPILED_TRAINING_LINEAR is "ours", which keeps it; the
    values and gradients stay (bitwise, on the CPU)."""
    from ops import layernorm_linear as LL
    from ops.layernorm_linear import config as layernorm_linear_config
    from ops.layernorm_linear import inductor as LLI

    assert direct.load_native().ops is not None and LL.traced.native_linear_traceable()
    ops = torch.ops.mojo_direct
    monkeypatch.setattr(layernorm_linear_config, "COMPILED_TRAINING_LINEAR", training_linear)
    monkeypatch.setattr(layernorm_linear_config, "COMPILED_LINEAR_GELU", True)

    def f(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        a = ops.traced_linear(x, w1, b1)
        return ops.traced_linear(torch._C._nn.gelu(a, approximate="tanh"), w2, None)
    gm = torch.fx.symbolic_trace(f)
    torch.manual_seed(0)
    args = [torch.randn(4, 8, dtype=torch.float64, requires_grad=True), torch.randn(6, 8, dtype=torch.float64),
            torch.randn(6, dtype=torch.float64), torch.randn(3, 6, dtype=torch.float64)]
    before = torch.autograd.grad(gm(*args).sum(), args[0])[0]
    LLI.PASS(gm.graph)
    gm.recompile()
    targets = _call_targets(gm)
    second = ops.traced_linear if training_linear == "ours" else torch._C._nn.linear
    assert targets == [ops.traced_linear_gelu.default, second]
    assert torch.equal(torch.autograd.grad(gm(*args).sum(), args[0])[0], before)


def test_gelu_epilogue_pass_puts_the_gelu_into_the_one_op_layernorm_linear() -> None:
    """The pass turns ``gelu(traced_layernorm_linear(..))`` (tanh, its only user) into ``traced_layernorm_linear(..,
    act=1)``; the values and gradients stay (bitwise, on the CPU). A second user keeps the GELU apart."""
    from ops import layernorm_linear as LL
    from ops.layernorm_linear import inductor as LLI

    assert direct.load_native().ops is not None and LL.traced.native_linear_traceable()
    ops = torch.ops.mojo_direct
    args = _layernorm_linear_leaves((4, 8), True)

    def alone(x: torch.Tensor, lnw: torch.Tensor, lnb: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> object:
        return torch._C._nn.gelu(ops.traced_layernorm_linear(x, lnw, lnb, w, b, 1e-5), approximate="tanh")

    def used_twice(x: torch.Tensor, lnw: torch.Tensor, lnb: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> object:
        y = ops.traced_layernorm_linear(x, lnw, lnb, w, b, 1e-5)
        return torch._C._nn.gelu(y, approximate="tanh") + y

    for second_user, f in ((False, alone), (True, used_twice)):
        gm = torch.fx.symbolic_trace(f)
        before = gm(*args)
        grads = torch.autograd.grad(before.sum(), args)
        assert LLI.fuse_linear_gelu(gm.graph) == (0 if second_user else 1)
        gm.recompile()
        (node,) = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in (
            ops.traced_layernorm_linear, ops.traced_layernorm_linear.default)]
        assert node.args[6:] == (() if second_user else (1,)), node.args
        after = gm(*args)
        assert torch.equal(after, before)
        assert all(torch.equal(a, b) for a, b in zip(torch.autograd.grad(after.sum(), args), grads, strict=True))


@pytest.mark.parametrize("rows, in_gemm", [(None, True), (128, False), (4094, False), (4096, True), (8192, True)])
def test_gelu_epilogue_pass_picks_where_the_bias_grad_is_made(rows: int | None, in_gemm: bool) -> None:
    """``traced_linear_gelu``'s ``bias_grad_in_gemm`` from the pass: True from COMPILED_GELU_BIAS_GRAD_IN_GEMM_MIN_ROWS
    rows of x up (x as 2 x rows/2 x 8, so rows count every dimension but the last) and where x's shape is unknown."""
    from ops import layernorm_linear as LL
    from ops.layernorm_linear import config as layernorm_linear_config
    from ops.layernorm_linear import inductor as LLI

    assert layernorm_linear_config.COMPILED_GELU_BIAS_GRAD_IN_GEMM_MIN_ROWS == 4096
    assert direct.load_native().ops is not None and LL.traced.native_linear_traceable()
    ops = torch.ops.mojo_direct
    gm = torch.fx.symbolic_trace(lambda x, w: torch._C._nn.gelu(ops.traced_linear(x, w, w[0]), approximate="tanh"))
    if rows is not None:
        next(iter(gm.graph.nodes)).meta["example_value"] = torch.empty(2, rows // 2, 8, device="meta")
    assert LLI.fuse_linear_gelu(gm.graph) == 1
    (node,) = [n for n in gm.graph.nodes if n.target is ops.traced_linear_gelu.default]
    assert node.args[3] is in_gemm


@pytest.mark.parametrize(("knob", "rows", "form"), [("auto", 1, "torch"), ("auto", 128, "torch"),
                                                    ("auto", 4095, "torch"), ("auto", 4096, "ours"),
                                                    ("auto", 8192, "ours"), ("ours", 1, "ours"),
                                                    ("inductor", 8192, "inductor"), ("torch", 8192, "torch")])
def test_compiled_training_form(knob: str, rows: int, form: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``compiled_training_form``: "auto" (the default) is "ours" from COMPILED_TRAINING_LAYERNORM_LINEAR_MIN_ROWS rows
    up and "torch" below; a form named by the knob stands at every size."""
    from ops.layernorm_linear import config as layernorm_linear_config

    assert layernorm_linear_config.COMPILED_TRAINING_LAYERNORM_LINEAR == "auto"
    assert layernorm_linear_config.COMPILED_TRAINING_LAYERNORM_LINEAR_MIN_ROWS == 4096
    monkeypatch.setattr(layernorm_linear_config, "COMPILED_TRAINING_LAYERNORM_LINEAR", knob)
    assert layernorm_linear_config.compiled_training_form(rows) == form


def test_compiled_training_form_names_a_bad_knob(monkeypatch: pytest.MonkeyPatch) -> None:
    """A knob value that is no form is a ValueError naming the knob and the forms, not a silent default."""
    from ops.layernorm_linear import config as layernorm_linear_config

    monkeypatch.setattr(layernorm_linear_config, "COMPILED_TRAINING_LAYERNORM_LINEAR", "Ours")
    with pytest.raises(ValueError, match=r"COMPILED_TRAINING_LAYERNORM_LINEAR: expected one of .*'auto'.*'Ours'"):
        layernorm_linear_config.compiled_training_form(4096)


def test_gelu_epilogue_pass_installs_only_in_a_free_place(monkeypatch: pytest.MonkeyPatch,
                                                          free_pre_grad_pass: None) -> None:
    """The pass takes inductor's pre-grad custom pass only where none is set, once; a user's pass is left alone. Its
    cache key changes with each switch it reads."""
    from torch._inductor import config as inductor_config

    from ops.layernorm import config as layernorm_config
    from ops.layernorm_linear import config as layernorm_linear_config
    from ops.layernorm_linear import inductor as LLI

    assert LLI.install() and LLI.install() and inductor_config.pre_grad_custom_pass is LLI.PASS
    theirs = lambda graph: None  # noqa: E731
    inductor_config.pre_grad_custom_pass = theirs
    assert not LLI.install() and inductor_config.pre_grad_custom_pass is theirs
    on = LLI.PASS.uuid()
    monkeypatch.setattr(layernorm_linear_config, "COMPILED_LINEAR_GELU", False)
    off = LLI.PASS.uuid()
    monkeypatch.setattr(layernorm_config, "COMPILED_LAYERNORM", "ours")
    assert len({on, off, LLI.PASS.uuid()}) == 3


# ---------------------------------------------------------------- on the GPU: the C++ route

GPU_SHAPES = [(1, 7), (37, 1000), (4, 768), (2, 64, 1023), (3, 4096), (5, 12288)]


def _grads(y: torch.Tensor, inputs: list[torch.Tensor], dy: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return (y, *torch.autograd.grad(y, inputs, dy))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", config.DTYPES)
@pytest.mark.parametrize("shape", GPU_SHAPES)
def test_gpu_native_layernorm_is_the_python_route(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    """After a shape's first call (the Python route, which hands over the plan) the C++ entry takes the call and
    gives bitwise the Python route's output and gradients (the same kernels), with and without GELU; without a
    gradient to come too. Rows of 12288 bf16 take a clustered launch."""
    from ops.layernorm import layernorm, layernorm_bwd, layernorm_fwd
    from ops.layernorm.autograd import LayerNormFunction
    from ops.layernorm.config import ACTIVATIONS

    torch.manual_seed(0)
    h = shape[-1]
    x = (torch.randn(shape, device="cuda") * 3 + 1).to(dtype).requires_grad_()
    w, b = (torch.randn(h, device="cuda").to(dtype).requires_grad_() for _ in range(2))
    dy = torch.randn(shape, device="cuda").to(dtype)
    for activation in ("none", "gelu"):
        python = _grads(LayerNormFunction.apply(x, w, b, 1e-5, "fast", activation), [x, w, b], dy)
        layernorm(x, w, b, 1e-5, activation)   # the Python route; plans handed over
        assert direct.NATIVE.layernorm(x, w, b, 1e-5, ACTIVATIONS[activation]) is not None
        native = _grads(layernorm(x, w, b, 1e-5, activation), [x, w, b], dy)
        for name, got, want in zip(("y", "dx", "dweight", "dbias"), native, python, strict=True):
            assert torch.equal(got, want), f"{activation} {name}"
        with torch.no_grad():
            assert torch.equal(layernorm(x, w, b, 1e-5, activation), python[0])
            # the validated call (y, mean, rstd): the C++ entry too, with the statistics the backward reads
            assert direct.NATIVE.layernorm_with_stats(x, w, b, 1e-5, ACTIVATIONS[activation])
            y, mean, rstd = layernorm_fwd(x, w, b, 1e-5, "fast", activation)
            assert torch.equal(y, python[0])
            assert torch.equal(layernorm_bwd(dy, x, w, b, mean, rstd, activation)[0], python[1])
            # the functional backward: the C++ entry (plan handed over by the autograd call above), all three
            # gradients; a call it does not take (dy of another dtype) is left to Python, which names dy
            got = direct.NATIVE.layernorm_bwd_with_plan(dy, x, w, b, mean, rstd, ACTIVATIONS[activation])
            assert len(got) == 3
            for name, g, want in zip(("dx", "dweight", "dbias"), got, python[1:], strict=True):
                assert torch.equal(g, want), f"{activation} {name}"
            assert direct.NATIVE.layernorm_bwd_with_plan(dy.double(), x, w, b, mean, rstd, 0) == []
            with pytest.raises(TypeError, match="^dy"):
                layernorm_bwd(dy.double(), x, w, b, mean, rstd, activation)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows_k_n", [(7, 37, 5), (128, 768, 2304), (300, 1023, 64)])
@pytest.mark.parametrize("bias", [True, False])
def test_gpu_native_layernorm_linear_is_the_python_route(dtype: torch.dtype, rows_k_n: tuple[int, int, int],
                                                         bias: bool) -> None:
    """The unfused LayerNorm+Linear through the C++ entry: bitwise the Python route's output and five gradients
    (four without a bias), and its inference output."""
    from ops.layernorm_linear import FusedLayerNormLinear
    from ops.layernorm_linear.autograd import LayerNormLinearFunction
    from ops.layernorm_linear.config import ALGO_IDS

    rows, k, n = rows_k_n
    torch.manual_seed(0)
    seq = torch.nn.Sequential(torch.nn.LayerNorm(k), torch.nn.Linear(k, n, bias=bias)).to("cuda", dtype)
    m = FusedLayerNormLinear.from_torch(seq, algo="unfused")
    ln, lin = m[0], m[1]
    x = torch.randn(rows, k, device="cuda", dtype=dtype, requires_grad=True)
    dy = torch.randn(rows, n, device="cuda", dtype=dtype)
    inputs = [x, *m.parameters()]
    python = _grads(LayerNormLinearFunction.apply(x, ln.weight, ln.bias, lin.weight, lin.bias, ln.eps, "unfused"),
                    inputs, dy)
    m(x)   # the Python route; plans handed over
    assert direct.NATIVE.layernorm_linear(x, ln.weight, ln.bias, lin.weight, lin.bias, ln.eps,
                                          ALGO_IDS["unfused"]) is not None
    native = _grads(m(x), inputs, dy)
    for i, (got, want) in enumerate(zip(native, python, strict=True)):
        assert torch.equal(got, want), f"output {i}"
    with torch.no_grad():
        m(x)
        assert torch.equal(m(x), python[0])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows_k_n", [(1, 768, 3072), (7, 37, 5), (300, 1023, 64), (2048, 768, 2304)])
def test_gpu_linear_ops_values_and_fallbacks(dtype: torch.dtype, rows_k_n: tuple[int, int, int]) -> None:
    """The unfused route's Linear ops (cuBLASLt for 16-bit, torch's ops otherwise): y, dxn, dW and db (the
    weight GEMM's epilogue) against float64, outputs poisoned first; after 16-bit calls some shape runs on
    cuBLASLt; a weight or bias off 256-byte alignment, and float32, give torch's own results bitwise."""
    import torch.nn.functional as F

    from ops.tolerance import compare

    rows, k, n = rows_k_n
    torch.manual_seed(0)
    xn = torch.randn(rows, k, device="cuda", dtype=dtype)
    aligned_w = (torch.randn(n, k, device="cuda") / k ** 0.5).to(dtype)
    aligned_b = torch.randn(n, device="cuda", dtype=dtype)
    dy = torch.randn(rows, n, device="cuda", dtype=dtype)
    native = direct.load_native()
    y = native.linear(xn, aligned_w, aligned_b)
    dxn, dw, db = native.linear_grads(dy, xn, aligned_w, True)
    dxn_nb, dw_nb = native.linear_grads(dy, xn, aligned_w, False)
    x64, w64, dy64 = xn.double(), aligned_w.double(), dy.double()
    refs = {"y": (y, x64 @ w64.T + aligned_b.double(), k), "dxn": (dxn, dy64 @ w64, n),
            "dW": (dw, dy64.T @ x64, rows), "db": (db, dy64.sum(0), rows), "dW without db": (dw_nb, dy64.T @ x64, rows)}
    for name, (got, ref, reduction) in refs.items():
        assert (bad := compare(got, ref, dtype, reduction=reduction)) is None, f"{name}: {bad}"
    assert torch.equal(dxn_nb, dxn)   # one dxn GEMM, with or without the bias gradient
    if dtype == torch.float32:   # torch's ops, bitwise
        assert torch.equal(y, F.linear(xn, aligned_w, aligned_b)) and torch.equal(dw, dy.T @ xn)
    else:   # some shape (this one, or an earlier one in this process) runs on cuBLASLt
        assert native.ops.gemm_plan_count() > 0
        # torch's stricter reduced-precision setting (no 16-bit split-K reductions; plans of its own): right values
        matmul = torch.backends.cuda.matmul
        flag = "allow_bf16_reduced_precision_reduction" if dtype == torch.bfloat16 else \
            "allow_fp16_reduced_precision_reduction"
        before = getattr(matmul, flag)
        setattr(matmul, flag, False)
        try:
            strict = native.linear_grads(dy, xn, aligned_w, True)
        finally:
            setattr(matmul, flag, before)
        for name, got in zip(("dxn", "dW", "db"), strict, strict=True):
            ref, reduction = refs[name][1:]
            assert (bad := compare(got, ref, dtype, reduction=reduction)) is None, f"{name} (strict): {bad}"
    # a weight and bias 2 or 4 bytes off 256-byte alignment: torch's ops, bitwise
    off_w = torch.empty(n * k + 1, device="cuda", dtype=dtype)[1:].view(n, k).copy_(aligned_w)
    off_b = torch.empty(n + 1, device="cuda", dtype=dtype)[1:].copy_(aligned_b)
    assert torch.equal(native.linear(xn, off_w, off_b), F.linear(xn, off_w, off_b))
    got = native.linear_grads(dy, xn, off_w, True)
    for g, want in zip(got, (dy @ off_w, dy.T @ xn, dy.sum(0)), strict=True):
        assert torch.equal(g, want)


def _strided(base: torch.Tensor) -> dict[str, torch.Tensor]:
    """Views of base [64, 5, h] that the kernels do not take as they are (column-major: rows of h that are columns
    in memory, which ``copy_transposed`` copies where no gradient is to come)."""
    return {"transposed": base.transpose(0, 1), "cls-slice": base[:, 0], "expanded": base[0, 0].expand(3, 7, -1),
            "column-major": base.reshape(-1, base.shape[-1]).t().contiguous().t()}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_gpu_native_copies_column_major_x(dtype: torch.dtype) -> None:
    """An x whose last two dims are column-major (a transposed view of [..., h, r]) is copied by our
    ``copy_transposed`` on the C++ route, not by torch: bitwise the contiguous x's output (LayerNorm, the fused
    and unfused LayerNorm+Linear), 2-D, batched (leading dims one stride apart) and odd sizes; a batch whose
    leading dims are not one stride apart takes torch's copy, with the same values."""
    from ops.layernorm import layernorm
    from ops.layernorm_linear import FusedLayerNormLinear

    torch.manual_seed(0)
    # x [..., r, h] as a view of [..., h, r]; the last: its two leading dims swapped, not one stride apart
    for shape, one_stride in (((37, 1000), True), ((1023, 64), True), ((2, 3, 7, 768), True), ((2, 3, 5, 256), False)):
        *lead, r, h = shape
        base = torch.randn(*lead, h, r, device="cuda").to(dtype)
        x = base.transpose(-1, -2) if one_stride else base.permute(1, 0, 3, 2)
        assert x.stride(-2) == 1 and not x.is_contiguous()
        seq = torch.nn.Sequential(torch.nn.LayerNorm(h), torch.nn.Linear(h, 96)).to("cuda", dtype)
        ln = seq[0]
        calls = {"layernorm": lambda t, ln=ln: layernorm(t, ln.weight, ln.bias)}
        calls |= {a: FusedLayerNormLinear.from_torch(seq, algo=a) for a in ("fused", "unfused")}
        with torch.no_grad():
            for name, fn in calls.items():
                want = fn(x.contiguous())
                want = fn(x.contiguous())   # the second: the C++ route, plans handed over
                assert torch.equal(fn(x), want), (shape, name)
                kernels = kernel_times(lambda fn=fn, x=x: fn(x), 1)   # the CUDA kernels of a call, by name
                assert any("copy_transpo" in k for k in kernels) == one_stride, (shape, name, kernels)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_native_takes_strided_x(dtype: torch.dtype) -> None:
    """A strided x goes through the C++ entries with one copy (ops/launch/direct.cpp's dense), not back to Python:
    bitwise the contiguous x's output and gradients (LayerNorm, unfused LayerNorm+Linear), statistics and fused
    forward."""
    from ops.layernorm import layernorm, layernorm_fwd
    from ops.layernorm_linear import FusedLayerNormLinear
    from ops.layernorm_linear.config import ALGO_IDS

    torch.manual_seed(0)
    base = torch.randn(64, 5, 768, device="cuda").to(dtype)
    seq = torch.nn.Sequential(torch.nn.LayerNorm(768), torch.nn.Linear(768, 96)).to("cuda", dtype)
    unfused, fused = (FusedLayerNormLinear.from_torch(seq, algo=a) for a in ("unfused", "fused"))
    ln, lin = unfused[0], unfused[1]
    lnl_args = (ln.weight, ln.bias, lin.weight, lin.bias, ln.eps)
    for view, x0 in _strided(base).items():
        x, dense = x0.detach().requires_grad_(), x0.contiguous().requires_grad_()
        for fn, params, n in ((lambda t: layernorm(t, ln.weight, ln.bias), [ln.weight, ln.bias], 768),
                              (unfused, list(unfused.parameters()), 96)):
            dy = torch.randn(*x.shape[:-1], n, device="cuda").to(dtype)
            want = _grads(fn(dense), [dense, *params], dy)
            want = _grads(fn(dense), [dense, *params], dy)   # the second: the C++ route, plans handed over
            got = _grads(fn(x), [x, *params], dy)
            for i, (a, b) in enumerate(zip(got, want, strict=True)):
                assert torch.equal(a, b), f"{view}, {n}: output {i}"
        with torch.no_grad():
            assert direct.NATIVE.layernorm(x, ln.weight, ln.bias, ln.eps, 0) is not None, view
            want = unfused(dense)   # without a gradient to come: a plan of its own, handed over here
            got = direct.NATIVE.layernorm_linear(x, *lnl_args, ALGO_IDS["unfused"])
            assert got is not None and torch.equal(got, want), view
            stats = direct.NATIVE.layernorm_with_stats(x, ln.weight, ln.bias, ln.eps, 0)
            assert stats, view
            for a, b in zip(stats, layernorm_fwd(dense, ln.weight, ln.bias), strict=True):
                assert torch.equal(a, b), view
            want = fused(dense)   # the plan handed over
            f_ln, f_lin = fused[0], fused[1]
            assert direct.NATIVE.layernorm_linear(x, f_ln.weight, f_ln.bias, f_lin.weight, f_lin.bias, f_ln.eps,
                                                  ALGO_IDS["fused"]) is not None, view
            assert torch.equal(fused(x), want), view


FUSED_CASES = [("fused", torch.float32, (300, 1023, 64)), ("fused", torch.float32, (2, 3, 256, 5)),
               ("fused", torch.bfloat16, (2, 1024, 2048, 64)), ("fused", torch.float16, (129, 768, 37)),
               ("sm90", torch.bfloat16, (300, 768, 264)), ("sm90", torch.bfloat16, (2, 2048, 1024, 768))]


@pytest.mark.gpu
@pytest.mark.parametrize("algo,dtype,shape", FUSED_CASES)
@pytest.mark.parametrize("offset", [0, 1])
def test_gpu_fused_forwards_are_the_graph_route(algo: str, dtype: torch.dtype, shape: tuple[int, ...],
                                                offset: int) -> None:
    """The fused and Hopper forwards through the C++ entry (plans from ops/layernorm_linear/config.py) give
    bitwise what the MAX ops give (their Mojo host code's own launches): y, mean and rstd, with and without a
    bias, on 16-byte-aligned x and on x one element off (the unaligned variants; the Hopper kernel takes
    aligned x only); and the module's inference output is that y."""
    from ops import layernorm_linear as LL

    if algo == "sm90" and not LL.route.is_sm90(torch.device("cuda")):
        pytest.skip("needs an sm_90 GPU")
    if algo == "sm90" and offset:
        pytest.skip("the Hopper kernel takes 16-byte-aligned x only")
    torch.manual_seed(0)
    *lead, k, n = shape
    x = (torch.randn(torch.Size(lead).numel() * k + offset, device="cuda") * 2 + 3).to(dtype)[offset:].view(*lead, k)
    seq = torch.nn.Sequential(torch.nn.LayerNorm(k), torch.nn.Linear(k, n)).to("cuda", dtype)
    with torch.no_grad():
        for p in seq.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    ln, lin = seq[0], seq[1]
    graph_fwd = LL.launch.fused_fwd if algo == "fused" else LL.launch.sm90_fwd
    for bias in (lin.bias, None):
        full = LL.launch.zero_bias(lin.weight) if bias is None else bias
        want = [t.view(*lead, -1) for t in graph_fwd(x.view(-1, k), ln.weight, ln.bias, lin.weight, full, ln.eps)]
        got = LL.layernorm_linear_fwd(x, ln.weight, ln.bias, lin.weight, bias, ln.eps, algo)
        code = LL.config.ALGO_IDS[algo]
        assert direct.NATIVE.layernorm_linear_with_stats(x, ln.weight, ln.bias, lin.weight, full, ln.eps,
                                                         code), "the C++ entry did not take the call"
        for name, a, b in zip(("y", "mean", "rstd"), got, want, strict=True):
            assert torch.equal(a, b.view(a.shape)), name
        with torch.no_grad():
            assert torch.equal(LL.layernorm_linear(x, ln.weight, ln.bias, lin.weight, bias, ln.eps, algo), got[0])
            assert direct.NATIVE.layernorm_linear(x, ln.weight, ln.bias, lin.weight, bias, ln.eps,
                                                  LL.config.ALGO_IDS[algo]) is not None


@pytest.mark.gpu
@pytest.mark.parametrize("off", ["x", "weight"])
def test_gpu_auto_falls_back_to_unfused_not_fused(off: str) -> None:
    """auto in the Hopper region on x or a weight that the Hopper kernel cannot take (not 16-byte aligned: its
    TMA reads both) runs "unfused", bitwise, and hands the C++ entry no fused plan for them (it once ran the
    fused kernel there)."""
    from ops import layernorm_linear as LL

    if not LL.route.is_sm90(torch.device("cuda")):
        pytest.skip("needs an sm_90 GPU")
    torch.manual_seed(0)
    rows, k, n = LL.config.SM90_MIN_ROWS, 64, 768

    def values(rows: int, cols: int, misaligned: bool, scale: float = 1.0) -> torch.Tensor:
        """randn * scale [rows, cols], 2 bytes past an aligned start when misaligned."""
        flat = torch.randn(rows * cols + 1, device="cuda", dtype=torch.bfloat16) * scale
        return (flat[1:] if misaligned else flat[:-1]).view(rows, cols)

    x, w = values(rows, k, off == "x"), values(n, k, off == "weight", 1 / 8)
    g, b = torch.ones(k, device="cuda", dtype=x.dtype), torch.zeros(k, device="cuda", dtype=x.dtype)
    bias = torch.randn(n, device="cuda", dtype=x.dtype)
    assert LL.route.pick_algo("auto", x.device, x.dtype, rows, n, k) == "sm90"
    assert LL.route.sm90_unsupported(x, w) == f"needs {off} 16-byte aligned"
    for _ in range(2):
        got = LL.layernorm_linear_fwd(x, g, b, w, bias, 1e-5, "auto")
        want = LL.layernorm_linear_fwd(x, g, b, w, bias, 1e-5, "unfused")
        for a, c in zip(got, want, strict=True):
            assert torch.equal(a, c)
    assert direct.NATIVE.layernorm_linear_with_stats(x, g, b, w, bias, 1e-5, LL.config.ALGO_IDS["auto"]) == []


@pytest.mark.gpu
@pytest.mark.parametrize("algo", ["fused", "sm90"])
def test_gpu_cuda_graph_fused_inference(algo: str) -> None:
    """A captured inference forward of the fused or Hopper op (C++ entry) replays right on new input."""
    from ops import layernorm_linear as LL

    if algo == "sm90" and not LL.route.is_sm90(torch.device("cuda")):
        pytest.skip("needs an sm_90 GPU")
    torch.manual_seed(0)
    m = LL.FusedLayerNormLinear(2048, 64, algo=algo).to("cuda", torch.bfloat16)
    x = torch.randn(512, 2048, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        graph, y = captured(lambda: m(x), warmup=2)
        x.copy_(torch.randn_like(x) * 4 + 1)
        graph.replay()
        assert torch.equal(y, m(x))


@pytest.mark.gpu
def test_gpu_cuda_graph_auto_fill_region_runs_unfused() -> None:
    """Below SM90_MIN_ROWS, where eager auto runs "sm90", a captured auto runs "unfused" (sm90_region): the
    replay on new input gives the unfused route's y bitwise, and eager calls after the capture still run sm90."""
    from ops import layernorm_linear as LL

    cuda, bf16, rows, k, n = torch.device("cuda"), torch.bfloat16, LL.config.SM90_FILL_ROWS, 768, 3072
    if not LL.route.is_sm90(cuda) or LL.route.pick_algo("auto", cuda, bf16, rows, n, k) != "sm90":
        pytest.skip("needs an sm_90 GPU whose grid this shape fills")
    torch.manual_seed(0)
    m = LL.FusedLayerNormLinear(k, n).to(cuda, bf16)
    torch.nn.init.normal_(m[0].weight, 1.0, 0.2)
    x = torch.randn(rows, k, device=cuda, dtype=bf16)
    ln, lin = m[0], m[1]
    with torch.no_grad():
        graph, y = captured(lambda: m(x), warmup=2)
        x.copy_(torch.randn_like(x) * 4 + 1)
        graph.replay()
        unfused = LL.layernorm_linear(x, ln.weight, ln.bias, lin.weight, lin.bias, ln.eps, "unfused")
        sm90 = LL.layernorm_linear(x, ln.weight, ln.bias, lin.weight, lin.bias, ln.eps, "sm90")
        assert not torch.equal(unfused, sm90)   # the two routes round differently: the check below can fail
        assert torch.equal(y, unfused)
        assert torch.equal(m(x), sm90)


def _small_model(dtype: torch.dtype) -> torch.nn.Module:
    from ops.layernorm import LayerNorm
    from ops.layernorm_linear import FusedLayerNormLinear

    torch.manual_seed(0)
    return torch.nn.Sequential(FusedLayerNormLinear(96, 192), torch.nn.GELU(), FusedLayerNormLinear(192, 96),
                               LayerNorm(96)).to("cuda", dtype)


def _outputs_and_grads(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """y, then the gradients of sum(y) that its backward left on x and the model's parameters."""
    y.float().sum().backward()
    return (y.detach().clone(), x.grad.clone(), *(p.grad.clone() for p in model.parameters()))


def _eager_reference(model: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The model's output and gradients on x's values, eager on the current stream."""
    model.zero_grad(set_to_none=True)
    x2 = x.detach().clone().requires_grad_()
    return _outputs_and_grads(model, x2, model(x2))


@pytest.mark.gpu
def test_gpu_cuda_graph_forward_and_backward() -> None:
    """``torch.cuda.graph`` captures a forward and backward through our modules; replayed on new input it gives
    what eager gives on that input."""
    model = _small_model(torch.bfloat16)
    x = torch.randn(64, 96, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    def step() -> torch.Tensor:
        y = model(x)
        y.float().sum().backward()
        return y

    def clear_grads() -> None:
        model.zero_grad(set_to_none=True)
        x.grad = None
    # warm-up: plans made, the C++ entries take the calls
    graph, y = captured(step, before_capture=clear_grads)
    new = torch.randn_like(x)
    with torch.no_grad():
        x.copy_(new)
    graph.replay()
    got = (y.clone(), x.grad.clone(), *(p.grad.clone() for p in model.parameters()))
    for i, (a, b) in enumerate(zip(got, _eager_reference(model, new), strict=True)):
        assert torch.equal(a, b), f"output {i}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gpu_side_stream_runs_after_its_producer(dtype: torch.dtype) -> None:
    """Under ``torch.cuda.stream(s)`` our calls, forward and backward, run on s after what was queued there before
    them: x is written on s behind a sleep of some milliseconds (the default stream does not wait), then the model
    runs on s; a launch on another stream would read x's poison. The results equal eager's on the default stream
    (float32: the Python route's launches; bf16: the C++ route and cuBLASLt)."""
    model = _small_model(dtype)
    src = torch.randn(256, 96, device="cuda", dtype=dtype)
    want = _eager_reference(model, src)
    model.zero_grad(set_to_none=True)
    x = torch.full_like(src, float("nan")).requires_grad_()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        torch.cuda._sleep(50_000_000)
        with torch.no_grad():
            x.copy_(src)
        got = _outputs_and_grads(model, x, model(x))
    torch.cuda.current_stream().wait_stream(s)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a, b), f"output {i}"


@pytest.mark.gpu
def test_gpu_make_graphed_callables() -> None:
    """``torch.cuda.make_graphed_callables`` of a model of ours (its forward and backward graphs captured
    separately): replayed on new inputs, the outputs and gradients are eager's."""
    model = _small_model(torch.bfloat16)
    x = torch.randn(64, 96, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    graphed = torch.cuda.make_graphed_callables(model, (x,))
    for _ in range(2):
        new = torch.randn_like(x).requires_grad_()
        model.zero_grad(set_to_none=True)
        got = _outputs_and_grads(model, new, graphed(new))
        for i, (a, b) in enumerate(zip(got, _eager_reference(model, new), strict=True)):
            assert torch.equal(a, b), f"output {i}"


def _eager_train_step(module: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """x's and module's gradients of sum(module(x)) in eager, from the second call (the first makes the plans; the
    second runs the C++ entry, as a captured graph does)."""
    for _ in range(2):
        module.zero_grad(set_to_none=True)
        x.grad = None
        module(x).float().sum().backward()
    return tuple(t.grad.clone() for t in (x, *module.parameters()))


def _captured_train_step(module: torch.nn.Module, x: torch.Tensor, dot: Path) -> tuple[torch.Tensor, ...]:
    """x's and module's gradients of sum(module(x)) from a captured forward and backward (``captured``: warm-up on a
    side stream first) replayed on x's values now, with the graph written to ``dot`` (cudaGraphDebugDotPrint)."""
    new = x.detach().clone()

    def step() -> None:
        module.zero_grad(set_to_none=False)
        x.grad = None
        module(x).float().sum().backward()
    graph, _ = captured(step, warmup=2, keep_graph=True)
    with torch.no_grad():
        x.copy_(torch.randn_like(x))
        graph.replay()
        x.copy_(new)
        graph.replay()
    graph.debug_dump(str(dot))
    return tuple(t.grad.clone() for t in (x, *module.parameters()))


def _forks(dot: Path) -> int:
    """How many nodes of a graph's DOT dump have more than one successor."""
    import collections
    import re

    edges = re.findall(r'^\s*"?(\w+)"?\s*->\s*"?(\w+)"?', dot.read_text(), re.M)
    assert edges, "no edges in the dump"
    return sum(1 for n in collections.Counter(a for a, _ in edges).values() if n > 1)


@pytest.mark.gpu
@pytest.mark.parametrize("rows, k, n", [(128, 768, 2304), (4096, 768, 3072)])
def test_gpu_cuda_graph_backward_runs_weight_grads_beside(rows: int, k: int, n: int, tmp_path: Path) -> None:
    """Under capture, the unfused backward (C++ entry) forks dW and db onto a side stream: the captured graph has a
    fork with CAPTURED_WEIGHT_GRADS_BESIDE and none without, and both graphs give eager's gradients bitwise."""
    from ops.layernorm_linear import FusedLayerNormLinear

    torch.manual_seed(0)
    m = FusedLayerNormLinear(k, n).to("cuda", torch.bfloat16)
    torch.nn.init.normal_(m[0].weight, 1.0, 0.2)
    torch.nn.init.normal_(m[0].bias, 0.0, 0.2)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    want = _eager_train_step(m, x)
    assert lnl_config.CAPTURED_WEIGHT_GRADS_BESIDE
    got = {}
    torch.ops.mojo_direct.set_accumulate_beside(0)   # only this fork in the graph
    try:
        for beside in (True, False):
            torch.ops.mojo_direct.set_capture_overlap(beside)
            got[beside] = _captured_train_step(m, x, tmp_path / f"{beside}.dot")
    finally:
        torch.ops.mojo_direct.set_capture_overlap(lnl_config.CAPTURED_WEIGHT_GRADS_BESIDE)
        torch.ops.mojo_direct.set_accumulate_beside(lnl_config.CAPTURED_GRADS_ACCUMULATED_BESIDE_MAX_ROWS)
    assert _forks(tmp_path / "True.dot") >= 1
    assert _forks(tmp_path / "False.dot") == 0
    for beside, grads in got.items():
        for i, (a, b) in enumerate(zip(grads, want, strict=True)):
            assert torch.equal(a, b), f"beside={beside}: gradient {i}"


def _module_768(kind: str) -> torch.nn.Module:
    """A seeded bf16 CUDA module of ours over 768 features: FusedLayerNormLinear(768, 2304) or LayerNorm(768)."""
    from ops.layernorm import LayerNorm
    from ops.layernorm_linear import FusedLayerNormLinear

    torch.manual_seed(0)
    m = FusedLayerNormLinear(768, 2304) if kind == "layernorm_linear" else LayerNorm(768)
    return m.to("cuda", torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("module_kind", ["layernorm_linear", "layernorm"])
def test_gpu_cuda_graph_accumulates_param_grads_beside(module_kind: str, tmp_path: Path) -> None:
    """Under capture, a forward of at most CAPTURED_GRADS_ACCUMULATED_BESIDE_MAX_ROWS rows makes its parameters'
    AccumulateGrad nodes on streams of their own: the graph forks more than with the limit at 0, both give eager's
    gradients bitwise, and torch's stream-mismatch warning is off while the captured backward accumulates and on
    again after it."""
    rows = 128
    assert rows <= lnl_config.CAPTURED_GRADS_ACCUMULATED_BESIDE_MAX_ROWS
    m = _module_768(module_kind)
    x = torch.randn(rows, 768, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    want = _eager_train_step(m, x)
    warn_on = torch._C._warn_on_accumulate_grad_stream_mismatch
    assert warn_on()
    seen: list[bool] = []   # the warning's switch as each parameter's gradient is accumulated
    hooks = [p.register_post_accumulate_grad_hook(lambda _: seen.append(warn_on())) for p in m.parameters()]
    got = {}
    torch.ops.mojo_direct.set_capture_overlap(False)   # only the accumulators' forks in the graph
    try:
        for max_rows in (lnl_config.CAPTURED_GRADS_ACCUMULATED_BESIDE_MAX_ROWS, 0):
            torch.ops.mojo_direct.set_accumulate_beside(max_rows)
            seen.clear()
            got[max_rows] = _captured_train_step(m, x, tmp_path / f"{max_rows}.dot")
            assert warn_on()
            # the captured step's accumulations (after the warm-up's) ran with the warning off only when beside
            assert seen[-len(hooks):] == [max_rows == 0] * len(hooks)
    finally:
        torch.ops.mojo_direct.set_capture_overlap(lnl_config.CAPTURED_WEIGHT_GRADS_BESIDE)
        torch.ops.mojo_direct.set_accumulate_beside(lnl_config.CAPTURED_GRADS_ACCUMULATED_BESIDE_MAX_ROWS)
        for h in hooks:
            h.remove()
    assert _forks(tmp_path / "0.dot") == 0
    assert _forks(tmp_path / f"{lnl_config.CAPTURED_GRADS_ACCUMULATED_BESIDE_MAX_ROWS}.dot") >= 1
    for max_rows, grads in got.items():
        for i, (a, b) in enumerate(zip(grads, want, strict=True)):
            assert torch.equal(a, b), f"limit {max_rows}: gradient {i}"


@pytest.mark.gpu
@pytest.mark.parametrize("module_kind", ["layernorm_linear", "layernorm"])
@pytest.mark.parametrize("held", [False, True])
def test_gpu_cuda_graph_autograd_grad_with_accumulators_beside(module_kind: str, held: bool) -> None:
    """torch.autograd.grad of a captured forward whose parameters' AccumulateGrad nodes were made beside (the
    LayerNorm's column sums then left on their stream) gives eager's gradients bitwise, as does a capture whose
    parameters' nodes were held from before (as DDP holds them, made on a stream of its own: they keep it)."""
    m = _module_768(module_kind)
    params = tuple(m.parameters())
    with torch.no_grad():
        for p in params:
            p.add_(torch.randn_like(p), alpha=0.2)
    x = torch.randn(128, 768, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(128, m(x).shape[-1], device="cuda", dtype=torch.bfloat16)

    def grads() -> tuple[torch.Tensor, ...]:
        return torch.autograd.grad(m(x), (x, *params), dy)
    for _ in range(2):   # the first call makes the plans
        before = [t.clone() for t in grads()]
    with torch.cuda.stream(torch.cuda.Stream()):   # held nodes run on the stream current when they were made
        nodes = [p.view_as(p).grad_fn.next_functions[0][0] for p in params] if held else []   # noqa: F841
    graph, out = captured(grads, warmup=2)
    with torch.no_grad():
        x.copy_(torch.randn_like(x))
    graph.replay()
    x_now = x.detach().clone().requires_grad_()
    want = torch.autograd.grad(m(x_now), (x_now, *params), dy)
    for i, (a, b) in enumerate(zip(out, want, strict=True)):
        assert torch.equal(a, b), f"gradient {i}"
    assert not torch.equal(before[0], want[0])   # the replay read the new x


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_gpu_compile_fullgraph(mode: str, compiled_layernorm: str) -> None:
    """``torch.compile(fullgraph=True)`` of a model with our modules (no graph break: the device queries are
    constants to dynamo; the LayerNorms inductor's or our C++ ops, as COMPILED_LAYERNORM says), forward and
    backward as in eager."""
    model = _small_model(torch.bfloat16)
    x = torch.randn(2, 32, 96, device="cuda", dtype=torch.bfloat16)
    eager_x = x.clone().requires_grad_()
    want_y = model(eager_x)
    want_y.float().pow(2).mean().backward()
    want = (want_y, eager_x.grad, *(p.grad for p in model.parameters()))
    torch._dynamo.reset()   # one process runs many compiled tests: their recompiles must not add up to the limit
    compiled = torch.compile(model, fullgraph=True, mode=mode)
    for _ in range(3):
        model.zero_grad(set_to_none=True)
        cx = x.clone().requires_grad_()
        y = compiled(cx)
        y.float().pow(2).mean().backward()
    got = (y, cx.grad, *(p.grad for p in model.parameters()))
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2, msg=f"output {i}")
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), want_y.detach(), rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize(("dtype", "algo", "with_bias"), [(torch.bfloat16, "sm90", True),
                                                          (torch.float32, "fused", False)])
def test_gpu_compiled_inference_calls_the_cpp_op(dtype: torch.dtype, algo: str, with_bias: bool) -> None:
    """Inference of the fused and Hopper forwards under torch.compile: the graph calls the C++ op
    ``mojo_direct.layernorm_linear_infer`` (no Python per call), which gives eager's y bitwise, also on the
    call before Python has handed it a plan (its fallback through the torch.library op)."""
    from torch._inductor.utils import run_and_get_code

    from ops.layernorm_linear import layernorm_linear

    torch.manual_seed(0)
    x = torch.randn(4, 256, 768, device="cuda", dtype=dtype)
    lnw, lnb = torch.randn(768, device="cuda", dtype=dtype), torch.randn(768, device="cuda", dtype=dtype)
    w = torch.randn(512, 768, device="cuda", dtype=dtype) / 28
    bias = torch.randn(512, device="cuda", dtype=dtype) if with_bias else None
    direct.load_native()
    plans.forget_plans()
    torch._dynamo.reset()
    fn = torch.compile(lambda x: layernorm_linear(x, lnw, lnb, w, bias, 1e-5, algo), fullgraph=True)
    with torch.no_grad():
        first, codes = run_and_get_code(fn, x)
        again = fn(x)
        want = layernorm_linear(x, lnw, lnb, w, bias, 1e-5, algo)
    assert any("mojo_direct.layernorm_linear_infer" in code for code in codes)
    assert torch.equal(first, want) and torch.equal(again, want)


def _unfused_case(with_bias: bool) -> tuple[torch.Tensor | None, ...]:
    """The compiled unfused tests' inputs, bf16 on the GPU, seeded: x [3, 37, 768] (mean 1, spread 3), the
    LayerNorm's weight and bias near 1 and 0, the Linear's weight [1000, 768] and bias [1000] (or None)."""
    torch.manual_seed(0)
    k, n = 768, 1000
    x = torch.randn(3, 37, k, device="cuda", dtype=torch.bfloat16) * 3 + 1
    lnw = 1 + 0.2 * torch.randn(k, device="cuda", dtype=torch.bfloat16)
    lnb = 0.2 * torch.randn(k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / 28
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16) if with_bias else None
    return x, lnw, lnb, w, bias


@pytest.mark.gpu
@pytest.mark.parametrize("with_bias", [True, False])
def test_gpu_compiled_unfused_training_calls_the_cpp_linear(with_bias: bool,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Unfused training under torch.compile (COMPILED_TRAINING_LINEAR "ours"): the forward's GEMM is the C++
    ``mojo_direct.traced_linear`` and the backward's the C++ ``linear_grads`` (no mm or addmm of torch's), and y
    and all five gradients are the float64 reference's within bf16's tolerance, on the second call too; with
    "inductor" the graph holds torch's GEMMs."""
    from torch._inductor.utils import run_and_get_code

    from ops.layernorm_linear import layernorm_linear
    from ops.reference import layernorm_linear_grads_ref, layernorm_linear_ref, layernorm_stats_ref
    from ops.tolerance import compare

    x, lnw, lnb, w, bias = _unfused_case(with_bias)
    k, n = w.shape[1], w.shape[0]
    dy = torch.randn(3, 37, n, device="cuda", dtype=torch.bfloat16)
    leaves = [t.clone().requires_grad_() for t in (x, lnw, lnb, w, bias) if t is not None]
    direct.load_native()
    ref_bias = bias if with_bias else torch.zeros(n, device="cuda", dtype=torch.bfloat16)
    want_y = layernorm_linear_ref(*(t.double() for t in (x, lnw, lnb, w, ref_bias)))
    want = layernorm_linear_grads_ref(x, lnw, lnb, w, ref_bias, dy)[:len(leaves)]
    reductions = (n * k, 111 * n, 111 * n, 111, 111)
    cond = float(layernorm_stats_ref(x)[1].max())

    for choice in ("ours", "inductor"):
        monkeypatch.setattr(lnl_config, "COMPILED_TRAINING_LINEAR", choice)
        torch._dynamo.reset()
        fwd = torch.compile(lambda *t: layernorm_linear(*t[:4], t[4] if with_bias else None, 1e-5, "unfused"),
                            fullgraph=True)

        def step(fwd: object) -> torch.Tensor:
            for t in leaves:
                t.grad = None
            y = fwd(*leaves)
            y.backward(dy)
            return y

        for call in range(2):
            if call == 0:
                y, codes = run_and_get_code(step, fwd)
            else:
                y = step(fwd)
            assert (bad := compare(y, want_y, torch.bfloat16, reduction=k)) is None, f"{choice} y: {bad}"
            for i, (leaf, r, red) in enumerate(zip(leaves, want, reductions[:len(leaves)], strict=True)):
                assert (bad := compare(leaf.grad, r, torch.bfloat16, reduction=red,
                                       cond=cond if i == 0 else 1.0)) is None, f"{choice} call {call} grad {i}: {bad}"
        code = "\n".join(codes)
        ours = "mojo_direct.traced_linear" in code and "mojo_direct.linear_grads" in code
        assert ours == (choice == "ours"), choice
        assert ("extern_kernels.mm" in code or "extern_kernels.addmm" in code) == (choice == "inductor"), choice


@pytest.mark.gpu
def test_gpu_compiled_unfused_inference_calls_the_cpp_linear() -> None:
    """Unfused inference under torch.compile: the graph's GEMM is the C++ op ``mojo_direct.linear`` (the eager
    route's cuBLASLt plan), not torch's addmm, and y is eager's within bf16 rounding (the LayerNorm is
    inductor's); on the second call too."""
    from torch._inductor.utils import run_and_get_code

    from ops.layernorm_linear import layernorm_linear

    x, lnw, lnb, w, bias = _unfused_case(with_bias=True)
    direct.load_native()
    torch._dynamo.reset()
    fn = torch.compile(lambda x: layernorm_linear(x, lnw, lnb, w, bias, 1e-5, "unfused"), fullgraph=True)
    with torch.no_grad():
        first, codes = run_and_get_code(fn, x)
        again = fn(x)
        want = layernorm_linear(x, lnw, lnb, w, bias, 1e-5, "unfused")
    assert any("mojo_direct.linear.default" in code for code in codes)
    assert not any("addmm" in code for code in codes)
    torch.testing.assert_close(first, want, rtol=2e-2, atol=2e-2)
    assert torch.equal(again, first)


@pytest.mark.gpu
@pytest.mark.parametrize("with_bias", [True, False])
def test_gpu_compiled_inference_puts_tanh_gelu_in_the_gemm(with_bias: bool, monkeypatch: pytest.MonkeyPatch,
                                                           free_pre_grad_pass: None) -> None:
    """Compiled inference of ``gelu(FusedLayerNormLinear-like call, approximate="tanh")``: the graph calls
    ``mojo_direct.linear_gelu`` (GELU in the GEMM's epilogue, ops/layernorm_linear/inductor.py) and no separate
    Linear, and matches the float64 reference on both calls; the erf GELU, and the tanh one with
    COMPILED_LINEAR_GELU off, keep ``mojo_direct.linear`` and inductor's GELU."""
    from torch._inductor.utils import run_and_get_code

    from ops.layernorm_linear import layernorm_linear
    from ops.reference import gelu_ref, layernorm_linear_ref
    from ops.tolerance import compare

    x, lnw, lnb, w, bias = _unfused_case(with_bias)
    n, k = w.shape
    ref_bias = bias if with_bias else torch.zeros(n, device="cuda", dtype=torch.bfloat16)
    direct.load_native()
    for approximate, switch, fused in (("tanh", True, True), ("none", True, False), ("tanh", False, False)):
        monkeypatch.setattr(lnl_config, "COMPILED_LINEAR_GELU", switch)
        torch._dynamo.reset()
        fn = torch.compile(lambda x, a=approximate: torch.nn.functional.gelu(
            layernorm_linear(x, lnw, lnb, w, bias, 1e-5, "unfused"), approximate=a), fullgraph=True)
        want = gelu_ref(layernorm_linear_ref(*(t.double() for t in (x, lnw, lnb, w, ref_bias))),
                        "gelu_tanh" if approximate == "tanh" else "gelu")
        with torch.no_grad():
            y, codes = run_and_get_code(fn, x)
            again = fn(x)
        code = "\n".join(codes)
        case = f"{approximate}, switch {switch}"
        assert ("mojo_direct.linear_gelu.default" in code) == fused, case
        assert ("mojo_direct.linear.default" in code) == (not fused), case
        for got in (y, again):
            assert (bad := compare(got, want, torch.bfloat16, reduction=k)) is None, f"{case}: {bad}"


@pytest.mark.gpu
@pytest.mark.parametrize("algo", ["auto", "sm90"])
def test_gpu_compiled_inference_gelu_after_the_hopper_forward(algo: str, free_pre_grad_pass: None) -> None:
    """GPT-2-small's 8x512 MLP input (bf16, 768 -> 3072), where auto picks the Hopper forward: compiled inference of
    ``gelu(.., approximate="tanh")`` after it holds inductor's LayerNorm and ``linear_gelu`` instead with "auto",
    and keeps the Hopper forward with "sm90" asked for by name; both match the float64 reference."""
    from torch._inductor.utils import run_and_get_code

    from ops.layernorm_linear import layernorm_linear
    from ops.layernorm_linear.route import pick_algo
    from ops.reference import gelu_ref, layernorm_linear_ref
    from ops.tolerance import compare

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Hopper forward needs an sm_90 GPU")
    torch.manual_seed(0)
    k, n = 768, 3072
    x = torch.randn(8, 512, k, device="cuda", dtype=torch.bfloat16) * 3 + 1
    lnw, lnb = (1 + 0.2 * torch.randn(k, device="cuda")).bfloat16(), (0.2 * torch.randn(k, device="cuda")).bfloat16()
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / 28
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    assert pick_algo("auto", x.device, x.dtype, 4096, n, k) == "sm90"
    direct.load_native()
    torch._dynamo.reset()
    fn = torch.compile(lambda x: torch.nn.functional.gelu(layernorm_linear(x, lnw, lnb, w, bias, 1e-5, algo),
                                                         approximate="tanh"), fullgraph=True)
    with torch.no_grad():
        y, codes = run_and_get_code(fn, x)
    code = "\n".join(codes)
    assert ("mojo_direct.linear_gelu.default" in code) == (algo == "auto"), algo
    assert ("mojo_direct.layernorm_linear_infer" in code) == (algo == "sm90"), algo
    want = gelu_ref(layernorm_linear_ref(*(t.double() for t in (x, lnw, lnb, w, bias))), "gelu_tanh")
    assert (bad := compare(y, want, torch.bfloat16, reduction=k)) is None, f"{algo}: {bad}"


def _compiled_unfused_training(with_bias: bool, gelu: bool) -> str:
    """Compile the unfused LayerNorm+Linear (of ``_unfused_case``; with ``gelu``, the tanh GELU after it), run two
    training calls, and check y and every gradient against float64 autograd on both; returns inductor's code."""
    from torch._inductor.utils import run_and_get_code

    from ops.layernorm_linear import layernorm_linear
    from ops.reference import gelu_ref, layernorm_linear_ref, layernorm_stats_ref
    from ops.tolerance import compare

    x, lnw, lnb, w, bias = _unfused_case(with_bias)
    n, k = w.shape
    dy = torch.randn(3, 37, n, device="cuda", dtype=torch.bfloat16)
    leaves = [t.clone().requires_grad_() for t in (x, lnw, lnb, w, bias) if t is not None]
    refs = [t.detach().double().requires_grad_() for t in leaves]
    want_y = layernorm_linear_ref(*refs[:4], refs[4] if with_bias else torch.zeros(n, device="cuda",
                                                                                  dtype=torch.float64))
    want_y = gelu_ref(want_y, "gelu_tanh") if gelu else want_y
    want = torch.autograd.grad(want_y, refs, dy.double())
    reductions = (n * k, 111 * n, 111 * n, 111, 111)
    cond = float(layernorm_stats_ref(x)[1].max())
    direct.load_native()
    torch._dynamo.reset()

    def model(*t: torch.Tensor) -> torch.Tensor:
        y = layernorm_linear(*t[:4], t[4] if with_bias else None, 1e-5, "unfused")
        return torch.nn.functional.gelu(y, approximate="tanh") if gelu else y
    fwd = torch.compile(model, fullgraph=True)

    def step() -> torch.Tensor:
        for t in leaves:
            t.grad = None
        y = fwd(*leaves)
        y.backward(dy)
        return y

    y, codes = run_and_get_code(step)
    for call in range(2):
        y = step() if call else y
        assert (bad := compare(y, want_y, torch.bfloat16, reduction=k)) is None, f"call {call} y: {bad}"
        for i, (leaf, r, red) in enumerate(zip(leaves, want, reductions, strict=False)):
            bad = compare(leaf.grad, r, torch.bfloat16, reduction=red, cond=cond if i == 0 else 1.0)
            assert bad is None, f"call {call} grad {i}: {bad}"
    return "\n".join(codes)


@pytest.mark.gpu
@pytest.mark.parametrize("min_rows", [0, 4096])
@pytest.mark.parametrize("with_bias", [True, False])
def test_gpu_compiled_training_puts_tanh_gelu_in_the_gemm(with_bias: bool, min_rows: int,
                                                          monkeypatch: pytest.MonkeyPatch,
                                                          free_pre_grad_pass: None) -> None:
    """Compiled training of ``gelu(unfused LayerNorm+Linear, approximate="tanh")``: the forward graph calls
    ``linear_gelu_aux`` (GELU's output and input from one GEMM) and the backward ``linear_gelu_grads``, or with a
    bias and fewer rows (111) than COMPILED_GELU_BIAS_GRAD_IN_GEMM_MIN_ROWS ``linear_grads`` (db by inductor), with no
    torch GEMM for that Linear; y and every gradient match float64 autograd, on both calls."""
    monkeypatch.setattr(lnl_config, "COMPILED_GELU_BIAS_GRAD_IN_GEMM_MIN_ROWS", min_rows)
    monkeypatch.setattr(lnl_config, "COMPILED_TRAINING_LAYERNORM_LINEAR", "inductor")
    code = _compiled_unfused_training(with_bias, gelu=True)
    in_gemm = not with_bias or min_rows == 0
    assert "mojo_direct.linear_gelu_aux" in code and ("mojo_direct.linear_gelu_grads" in code) == in_gemm
    assert ("mojo_direct.linear_grads" in code) == (not in_gemm)
    assert "extern_kernels.mm" not in code and "extern_kernels.addmm" not in code


@pytest.mark.gpu
@pytest.mark.parametrize("knob", ["ours", "auto"])
@pytest.mark.parametrize("gelu", [False, True])
@pytest.mark.parametrize("with_bias", [True, False])
def test_gpu_compiled_training_one_op_layernorm_linear(with_bias: bool, gelu: bool, knob: str,
                                                       monkeypatch: pytest.MonkeyPatch,
                                                       free_pre_grad_pass: None) -> None:
    """With COMPILED_TRAINING_LAYERNORM_LINEAR "ours", or "auto" at COMPILED_TRAINING_LAYERNORM_LINEAR_MIN_ROWS rows
    (here lowered to the case's 111), compiled training of the unfused LayerNorm+Linear (and of the tanh GELU after
    it) calls one op each way, ``layernorm_linear_train_fwd`` and ``layernorm_linear_grads`` (the GELU inside them: no
    triton kernel of it), with no torch GEMM and no inductor LayerNorm; y and every gradient match float64 autograd,
    on both calls."""
    import re

    monkeypatch.setattr(lnl_config, "COMPILED_TRAINING_LAYERNORM_LINEAR", knob)
    monkeypatch.setattr(lnl_config, "COMPILED_TRAINING_LAYERNORM_LINEAR_MIN_ROWS", 111)
    code = _compiled_unfused_training(with_bias, gelu)
    assert "mojo_direct.layernorm_linear_train_fwd" in code and "mojo_direct.layernorm_linear_grads" in code
    assert "extern_kernels.mm" not in code and "extern_kernels.addmm" not in code
    assert not re.search(r"triton_\w*(gelu|layer_norm)", code), re.findall(r"triton_\w+", code)


@pytest.mark.gpu
@pytest.mark.parametrize("with_bias", [True, False])
def test_gpu_compiled_training_below_the_one_op_rows_is_torchs_program(with_bias: bool,
                                                                       free_pre_grad_pass: None) -> None:
    """With the default "auto" and fewer rows (111) than COMPILED_TRAINING_LAYERNORM_LINEAR_MIN_ROWS, compiled
    training of the unfused LayerNorm+Linear and the tanh GELU after it is torch's program: no op of ours, torch's
    GEMMs; y and every gradient match float64 autograd, on both calls."""
    assert lnl_config.COMPILED_TRAINING_LAYERNORM_LINEAR == "auto"
    assert lnl_config.COMPILED_TRAINING_LAYERNORM_LINEAR_MIN_ROWS > 111
    code = _compiled_unfused_training(with_bias, gelu=True)
    assert "mojo_direct" not in code and "extern_kernels.mm" in code
