"""Four probes of the GEMMs in GPT-2-small's captured 1x128 training step (issue 33's target 0.95), for the
fused modules' shapes (ln_1 + qkv: 768 -> 2304; ln_2 + fc1: 768 -> 3072; 128 rows, bf16), in a CUDA graph:

* ``lt_candidates``: 20 back-to-back GEMMs a graph (same operands: warm in L2), by every algorithm cuBLASLt's
  heuristics offer for the forward (with bias), dgrad and wgrad (with the bias gradient) GEMMs of our unfused
  route, against the first (what our plans take) and torch's ops;
* ``cold_weights``: LayerNorm then the GEMM over 24 distinct weights (each cold in L2, as in the model), over one
  weight (warm), and with a kernel that reads the weight into L2 on a side stream beside the LayerNorm;
* ``triton_gemm``: the forward GEMM by cuBLAS and by a plain triton kernel (one output tile a program, no split-K)
  at its fastest of TRITON_CONFIGS, cold and warm: whether a GEMM of our own could be faster at 128 rows;
* ``layernorm_prologue``: our LayerNorm + cuBLASLt (the unfused route) against a triton kernel with the LayerNorm
  in the GEMM's prologue, cold weights: what that fusion would save a module.

us: per GEMM (lt_candidates, triton_gemm) or per module (cold_weights, layernorm_prologue), median of 7
replays. Writes the table probe_captured_gemms (results/transformer.{csv,md}).

    python scripts/probe_captured_gemms.py      (needs a CUDA GPU and triton)
"""

from __future__ import annotations

import ctypes
import statistics
import sys
from collections.abc import Callable
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from ops.bench.reports import commit, gpu_name, write_report  # noqa: E402
from ops.bench.timing import captured  # noqa: E402

FIELDS = ("probe", "module", "gemm", "variant", "us", "note")
ROWS, K = 128, 768
MODULES = (("qkv", 2304), ("fc1", 3072))
COPIES = 24            # distinct weights per cold_weights pass: 24 x 4.7 MB is past the H100's 50 MB of L2
WARM_PROGRAMS = (132, 264, 528)
LAUNCHES = 20          # lt_candidates: GEMMs per captured graph
BF16, F32, COMPUTE_32F = 14, 0, 68            # cudaDataType / cublasComputeType_t
DESC_TRANSA, DESC_TRANSB, DESC_EPILOGUE, DESC_BIAS = 3, 4, 7, 8
PREF_WORKSPACE, PREF_REDUCTION_MASK = 1, 3
EPILOGUE = {"fwd_bias": 4, "dgrad": 1, "wgrad_bgrad": 512}
LT_WORKSPACE = 32 << 20   # ops/launch/direct.cpp: the backward's GEMMs (the forward's, here k <= 2n, ask for none)


NOTE = ("bf16, 128 rows, the fused modules' shapes (qkv: 768 -> 2304; fc1: 768 -> 3072), in a CUDA graph. "
        "lt_candidates: 20 back-to-back GEMMs a graph (operands warm in L2) by each algorithm cuBLASLt's heuristics "
        "offer (lt_first: the heuristics' choice, which our plans take; note: every candidate's us), and torch's ops "
        "(wgrad_bgrad: dy^T xn and dy.sum(0)). cold_weights: LayerNorm then the GEMM, 24 times a graph, over 24 "
        "distinct weights (cold in L2, as in the model) or one (warm), and with a triton kernel that reads the next "
        "weight into L2 on a side stream beside the LayerNorm. triton_gemm: the forward GEMM with bias, 24 a graph, by "
        "cuBLAS and by a plain triton kernel (one output tile a program, no split-K) at its fastest of 24 configs on "
        "the cold weights. layernorm_prologue: our unfused route's forward (our LayerNorm kernel, then cuBLASLt) "
        "against a triton kernel that takes each row's statistics from x, then normalizes x's tiles as they load "
        "(fastest of the same configs), 24 distinct weights a graph. us: per GEMM or per module, median of 7 "
        "replays.")


class Heuristic(ctypes.Structure):
    _fields_ = [("algo", ctypes.c_uint64 * 8), ("workspace", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


def graph_us(body: Callable[[], object], per: int = 1, reps: int = 7) -> float:
    """``body`` captured once (``ops.bench.timing.captured``, after one warm-up call), replayed twice per timing: us per
    ``per``."""
    g, _ = captured(body, warmup=1)
    times = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        g.replay()
        g.replay()
        e1.record()
        torch.cuda.synchronize()
        times.append(e0.elapsed_time(e1) * 1e3 / (2 * per))
    return statistics.median(times)


class Lt:
    """cuBLASLt by ctypes: one GEMM of our unfused route's three, and its heuristics' candidates."""

    def __init__(self) -> None:
        self.lib = next(lib for lib in map(_load, ("libcublasLt.so.13", "libcublasLt.so.12")) if lib is not None)
        self.handle = ctypes.c_void_p()
        self._ok(self.lib.cublasLtCreate(ctypes.byref(self.handle)), "create")

    @staticmethod
    def _ok(status: int, what: str) -> None:
        if status != 0:
            raise RuntimeError(f"cublasLt {what}: status {status}")

    def _set(self, fn: Callable, obj: ctypes.c_void_p, attr: int, value: object) -> None:
        self._ok(fn(obj, attr, ctypes.byref(value), ctypes.sizeof(value)), f"attribute {attr}")

    def candidates(self, gemm: str, n_out: int) -> tuple[list[Callable[[], None]], list]:
        """One call per heuristic candidate (first: the heuristics' choice) of ``gemm`` for the module of
        ``n_out`` outputs, on tensors it keeps; and those tensors."""
        # cuBLAS's column-major terms, as ops/launch/native/cublaslt.h's make_gemm_plan: fwd D[N, M] = W^T xn;
        # dgrad dxn[K, M] = W dy; wgrad dW[K, N] = xn dy^T
        m, n, k, ta, tb = {"fwd_bias": (n_out, ROWS, K, 1, 0), "dgrad": (K, ROWS, n_out, 0, 0),
                           "wgrad_bgrad": (K, n_out, ROWS, 0, 1)}[gemm]
        desc = ctypes.c_void_p()
        self._ok(self.lib.cublasLtMatmulDescCreate(ctypes.byref(desc), COMPUTE_32F, F32), "desc")
        set_desc = self.lib.cublasLtMatmulDescSetAttribute
        self._set(set_desc, desc, DESC_TRANSA, ctypes.c_int32(ta))
        self._set(set_desc, desc, DESC_TRANSB, ctypes.c_int32(tb))
        self._set(set_desc, desc, DESC_EPILOGUE, ctypes.c_uint32(EPILOGUE[gemm]))
        bias = torch.zeros(max(m, n), device="cuda", dtype=torch.bfloat16)
        if EPILOGUE[gemm] != 1:
            self._set(set_desc, desc, DESC_BIAS, ctypes.c_void_p(bias.data_ptr()))
        layouts = []
        for r, c in ((k, m) if ta else (m, k), (n, k) if tb else (k, n), (m, n)):
            layout = ctypes.c_void_p()
            self._ok(self.lib.cublasLtMatrixLayoutCreate(ctypes.byref(layout), BF16, ctypes.c_uint64(r),
                                                         ctypes.c_uint64(c), ctypes.c_int64(r)), "layout")
            layouts.append(layout)
        workspace = 0 if gemm == "fwd_bias" else LT_WORKSPACE
        pref = ctypes.c_void_p()
        self._ok(self.lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "preference")
        self._set(self.lib.cublasLtMatmulPreferenceSetAttribute, pref, PREF_WORKSPACE, ctypes.c_uint64(workspace))
        self._set(self.lib.cublasLtMatmulPreferenceSetAttribute, pref, PREF_REDUCTION_MASK, ctypes.c_uint32(7))
        found, count = (Heuristic * 32)(), ctypes.c_int()
        self._ok(self.lib.cublasLtMatmulAlgoGetHeuristic(self.handle, desc, *layouts, layouts[2], pref, 32, found,
                                                         ctypes.byref(count)), "heuristic")
        a = torch.randn(m * k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(k * n, device="cuda", dtype=torch.bfloat16)
        d = torch.empty(m * n, device="cuda", dtype=torch.bfloat16)
        ws = torch.empty(max(workspace, 1), device="cuda", dtype=torch.uint8)
        one, zero = ctypes.c_float(1.0), ctypes.c_float(0.0)

        def call(i: int) -> Callable[[], None]:
            def run() -> None:
                stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
                self._ok(self.lib.cublasLtMatmul(
                    self.handle, desc, ctypes.byref(one), ctypes.c_void_p(a.data_ptr()), layouts[0],
                    ctypes.c_void_p(b.data_ptr()), layouts[1], ctypes.byref(zero), ctypes.c_void_p(d.data_ptr()),
                    layouts[2], ctypes.c_void_p(d.data_ptr()), layouts[2], ctypes.byref(found[i].algo),
                    ctypes.c_void_p(ws.data_ptr()), ctypes.c_size_t(found[i].workspace), stream), "matmul")
            return run
        return [call(i) for i in range(count.value)], [a, b, d, ws, bias]


def _load(name: str) -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
    except OSError:
        return None


def torch_gemm(gemm: str, n_out: int) -> Callable[[], object]:
    """torch's ops for ``gemm`` (the bias gradient as torch's Linear backward makes it: a column sum)."""
    x = torch.randn(ROWS, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n_out, K, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n_out, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(ROWS, n_out, device="cuda", dtype=torch.bfloat16)
    return {"fwd_bias": lambda: F.linear(x, w, b), "dgrad": lambda: dy @ w,
            "wgrad_bgrad": lambda: (dy.t() @ x, dy.sum(0))}[gemm]


def repeated(call: Callable[[], object]) -> Callable[[], None]:
    """LAUNCHES back-to-back calls: one graph of them, so that the graph's own launch does not count."""
    def body() -> None:
        for _ in range(LAUNCHES):
            call()
    return body


def lt_candidates() -> list[dict]:
    lt, rows = Lt(), []
    for module, n_out in MODULES:
        for gemm in EPILOGUE:
            calls, _keep = lt.candidates(gemm, n_out)
            times = [graph_us(repeated(call), per=LAUNCHES) for call in calls]
            best = min(range(len(times)), key=times.__getitem__)
            note = f"{len(times)} candidates: " + " ".join(f"{t:.2f}" for t in times)
            torch_us = graph_us(repeated(torch_gemm(gemm, n_out)), per=LAUNCHES)
            for variant, us in (("torch", torch_us), ("lt_first", times[0]),
                                (f"lt_best (candidate {best})", times[best])):
                rows.append({"probe": "lt_candidates", "module": module, "gemm": gemm, "variant": variant,
                             "us": round(us, 2), "note": note if variant == "lt_first" else ""})
    return rows


TRITON_CONFIGS = [(bm, bn, bk, stages) for bm in (64, 128) for bn in (16, 32, 64) for bk in (64, 128)
                  for stages in (3, 4)]   # (BLOCK_M, BLOCK_N, BLOCK_K, num_stages), 4 warps


@cache
def triton_linear() -> object:
    """y = xn W^T + b, one [BM, BN] output tile a program, no split-K; with NORM, xn = LayerNorm(x) in the
    prologue: the program first takes its rows' mean and rstd from x (which L2 holds), then normalizes x's tiles
    as they load."""
    import triton.language as tl
    from triton import jit

    @jit
    def linear_bias(x_ptr, g_ptr, be_ptr, w_ptr, b_ptr, y_ptr, n, k, eps, BM: tl.constexpr,  # noqa: N803
                    BN: tl.constexpr, BK: tl.constexpr, NORM: tl.constexpr):  # noqa: N803
        rm = tl.program_id(0) * BM + tl.arange(0, BM)
        rn = tl.program_id(1) * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        mean = tl.zeros((BM,), dtype=tl.float32)
        rstd = tl.zeros((BM,), dtype=tl.float32)
        if NORM:
            s1 = tl.zeros((BM,), dtype=tl.float32)
            s2 = tl.zeros((BM,), dtype=tl.float32)
            for k0 in range(0, k, BK):
                a = tl.load(x_ptr + rm[:, None] * k + (k0 + rk)[None, :]).to(tl.float32)
                s1 += tl.sum(a, 1)
                s2 += tl.sum(a * a, 1)
            mean = s1 / k
            rstd = 1.0 / tl.sqrt(s2 / k - mean * mean + eps)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, k, BK):
            a = tl.load(x_ptr + rm[:, None] * k + (k0 + rk)[None, :])
            if NORM:
                gk = tl.load(g_ptr + k0 + rk).to(tl.float32)
                bk = tl.load(be_ptr + k0 + rk).to(tl.float32)
                a = ((a.to(tl.float32) - mean[:, None]) * rstd[:, None] * gk[None, :] + bk[None, :]).to(tl.bfloat16)
            w = tl.load(w_ptr + rn[:, None] * k + (k0 + rk)[None, :])
            acc += tl.dot(a, tl.trans(w))
        acc += tl.load(b_ptr + rn).to(tl.float32)[None, :]
        tl.store(y_ptr + rm[:, None] * n + rn[None, :], acc.to(tl.bfloat16))

    return linear_bias


class GemmPasses:
    """COPIES forward calls of one module's shape a graph, over distinct weights or one: the GEMM by cuBLAS
    (F.linear) or by ``triton_linear`` at one of TRITON_CONFIGS, or LayerNorm + GEMM by ours (``layernorm_linear``
    under no_grad: our LayerNorm kernel, then cuBLASLt) or by ``triton_linear`` with NORM."""

    def __init__(self, n_out: int) -> None:
        self.n_out = n_out
        self.ws = [torch.randn(n_out, K, device="cuda", dtype=torch.bfloat16) for _ in range(COPIES)]
        self.bs = [torch.randn(n_out, device="cuda", dtype=torch.bfloat16) for _ in range(COPIES)]
        self.x = torch.randn(ROWS, K, device="cuda", dtype=torch.bfloat16)
        self.g = 1 + 0.1 * torch.randn(K, device="cuda", dtype=torch.bfloat16)
        self.be = 0.1 * torch.randn(K, device="cuda", dtype=torch.bfloat16)
        self.y = torch.empty(ROWS, n_out, device="cuda", dtype=torch.bfloat16)

    def by_triton(self, i: int, cfg: tuple[int, int, int, int], norm: bool = False) -> torch.Tensor:
        bm, bn, bk, stages = cfg
        triton_linear()[(ROWS // bm, self.n_out // bn)](self.x, self.g, self.be, self.ws[i], self.bs[i], self.y,
                                                        self.n_out, K, 1e-5, BM=bm, BN=bn, BK=bk, NORM=norm,
                                                        num_warps=4, num_stages=stages)
        return self.y

    def by_cublas(self, i: int) -> torch.Tensor:
        return F.linear(self.x, self.ws[i], self.bs[i])

    def by_ours(self, i: int) -> torch.Tensor:
        from ops.layernorm_linear import layernorm_linear

        with torch.no_grad():
            return layernorm_linear(self.x, self.g, self.be, self.ws[i], self.bs[i])

    def run(self, distinct: bool, call: Callable[..., torch.Tensor], *args: object) -> Callable[[], None]:
        def body() -> None:
            for i in range(COPIES):
                call(i if distinct else 0, *args)
        return body

    def fastest(self, norm: bool) -> tuple[tuple[int, int, int, int], float]:
        """The TRITON_CONFIGS entry fastest on cold weights, and its us; each checked against cuBLAS (or ours)
        first."""
        want = self.by_ours(1) if norm else self.by_cublas(1)
        for cfg in TRITON_CONFIGS:
            torch.testing.assert_close(self.by_triton(1, cfg, norm), want, rtol=2e-2, atol=0.5)
        times = {cfg: graph_us(self.run(True, self.by_triton, cfg, norm), per=COPIES) for cfg in TRITON_CONFIGS}
        best = min(times, key=times.__getitem__)
        return best, times[best]


class ModulePasses(GemmPasses):
    """``GemmPasses``' tensors, as LayerNorm (torch's) then the GEMM (cuBLAS), optionally with the next weight read
    into L2 on a side stream beside the LayerNorm (``read_into_l2``: a triton kernel)."""

    def __init__(self, n_out: int, read_into_l2: Callable, cdiv: Callable[[int, int], int]) -> None:
        super().__init__(n_out)
        self.sink = torch.empty(max(WARM_PROGRAMS), device="cuda", dtype=torch.int32)
        self.side = torch.cuda.Stream()
        self.read_into_l2, self.cdiv = read_into_l2, cdiv

    def warm(self, i: int, programs: int) -> None:
        words = self.ws[i].view(torch.int32).view(-1)
        self.read_into_l2[(programs,)](words, self.sink, words.numel(), BLOCK=1024,
                                       ITERS=self.cdiv(words.numel(), programs * 1024))

    def warm_all(self) -> None:
        for i in range(COPIES):
            self.warm(i, WARM_PROGRAMS[1])

    def layernorm_gemm(self, distinct: bool, programs: int = 0) -> Callable[[], None]:
        def body() -> None:
            for i in range(COPIES):
                j = i if distinct else 0
                main = torch.cuda.current_stream()
                if programs:
                    self.side.wait_stream(main)
                    with torch.cuda.stream(self.side):
                        self.warm(j, programs)
                xn = F.layer_norm(self.x, (K,), self.g, self.be)
                if programs:
                    main.wait_stream(self.side)
                F.linear(xn, self.ws[j], self.bs[j])
        return body


def cold_weights() -> list[dict]:
    import triton
    import triton.language as tl

    @triton.jit
    def read_into_l2(w_ptr, out_ptr, n, BLOCK: tl.constexpr, ITERS: tl.constexpr):  # noqa: N803
        pid = tl.program_id(0)
        acc = tl.zeros([BLOCK], dtype=tl.int32)
        for i in range(ITERS):
            offs = (pid * ITERS + i) * BLOCK + tl.arange(0, BLOCK)
            acc = acc | tl.load(w_ptr + offs, mask=offs < n, other=0, eviction_policy="evict_last")
        tl.store(out_ptr + pid, tl.max(acc, 0))

    rows = []
    for module, n_out in MODULES:
        passes = ModulePasses(n_out, read_into_l2, triton.cdiv)
        variants = {"layernorm + GEMM, 24 weights (cold)": passes.layernorm_gemm(True),
                    "layernorm + GEMM, one weight (warm)": passes.layernorm_gemm(False),
                    "L2-warming kernel alone": passes.warm_all}
        for p in WARM_PROGRAMS:
            variants[f"warming kernel ({p} programs) beside layernorm, then GEMM"] = passes.layernorm_gemm(True, p)
        for variant, body in variants.items():
            rows.append({"probe": "cold_weights", "module": module, "gemm": "fwd_bias", "variant": variant,
                         "us": round(graph_us(body, per=COPIES), 2), "note": ""})
    return rows


def triton_gemm() -> list[dict]:
    """The forward GEMM by ``triton_linear`` at its fastest of TRITON_CONFIGS on cold weights, against cuBLAS."""
    rows = []
    for module, n_out in MODULES:
        p = GemmPasses(n_out)
        best, cold_us = p.fastest(norm=False)
        for variant, us in (("cuBLAS (F.linear), 24 weights (cold)", graph_us(p.run(True, p.by_cublas), per=COPIES)),
                            ("cuBLAS (F.linear), one weight (warm)", graph_us(p.run(False, p.by_cublas), per=COPIES)),
                            ("triton, best config, 24 weights (cold)", cold_us),
                            ("triton, best config, one weight (warm)",
                             graph_us(p.run(False, p.by_triton, best), per=COPIES))):
            rows.append({"probe": "triton_gemm", "module": module, "gemm": "fwd_bias", "variant": variant,
                         "us": round(us, 2), "note": f"best (BLOCK_M, BLOCK_N, BLOCK_K, stages): {best}"
                         if variant.startswith("triton, best config, 24") else ""})
    return rows


def layernorm_prologue() -> list[dict]:
    """Our unfused forward (our LayerNorm kernel, then cuBLASLt) against ``triton_linear`` with the LayerNorm in the
    GEMM's prologue, at its fastest of TRITON_CONFIGS; 24 distinct weights a graph."""
    rows = []
    for module, n_out in MODULES:
        p = GemmPasses(n_out)
        best, us = p.fastest(norm=True)
        for variant, t in (("ours: our LayerNorm, then cuBLASLt (cold)", graph_us(p.run(True, p.by_ours), per=COPIES)),
                           ("triton: LayerNorm in the GEMM's prologue (cold)", us)):
            rows.append({"probe": "layernorm_prologue", "module": module, "gemm": "fwd_bias", "variant": variant,
                         "us": round(t, 2),
                         "note": f"best (BLOCK_M, BLOCK_N, BLOCK_K, stages): {best}" if "triton" in variant else ""})
    return rows


def main() -> int:
    if not torch.cuda.is_available():
        print("probe_captured_gemms: needs a CUDA GPU")
        return 1
    rows = lt_candidates() + cold_weights() + triton_gemm() + layernorm_prologue()
    for r in rows:
        print(f"{r['probe']:14s} {r['module']:4s} {r['gemm']:12s} {r['variant']:58s} {r['us']:7.2f}", flush=True)
    stamp = f"GPU: {gpu_name()}; commit {commit()}; torch {torch.__version__}"
    write_report("probe_captured_gemms", rows, FIELDS, stamp,
                 "GPT-2-small's captured 1x128 step: four probes of the fused modules' GEMMs", NOTE)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
