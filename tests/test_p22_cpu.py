"""The p22 CPU ops called without MAX (``ops/puzzle/p22_cpu.py``, how ``p22 --check`` checks the CPU kernels): each
op's own ``execute`` through a shared library gives the MAX route's outputs bit for bit on the check's shapes, writes
every element, and a package that does not compile is located and the rest still built."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ops.launch import bridge
from ops.launch.packages import MojoCompileError
from ops.puzzle.p22 import PROBLEMS, SOLUTIONS, P22Kernels, kernel_cases, make_inputs
from ops.puzzle.p22_cpu import OPS, P22Cpu
from ops.puzzle.p22_diagnose import ops_broken_by, parse_errors, region_of

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import p22 as cli  # noqa: E402


def test_every_cpu_op_gives_the_max_routes_outputs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each solution op through the shared library gives what its MAX op gives on the CPU, bit for bit, on every
    check shape (large-mean rows included), with no poisoned element left."""
    monkeypatch.setattr(bridge, "poison_outputs", True)
    by_max, by_harness = P22Kernels(SOLUTIONS), P22Cpu(SOLUTIONS)
    by_harness.build()
    for shape in cli.CHECK_SHAPES:
        inputs = make_inputs(*shape, mean=1e3 if shape[2] > 100 else 0.0, seed=0)
        want, got = kernel_cases(by_max, inputs), kernel_cases(by_harness, inputs)
        assert set(got) == set(OPS)
        for name, (y, _, _) in got.items():
            assert not y.isnan().any(), f"{name} {shape}"
            assert torch.equal(y, want[name][0]), f"{name} {shape}"


def test_the_stubs_build_and_leave_their_outputs_poisoned_or_wrong(monkeypatch: pytest.MonkeyPatch) -> None:
    """The untouched problems compile; their LayerNorm (a stubbed row_stats_cpu) is not the solution's."""
    monkeypatch.setattr(bridge, "poison_outputs", True)
    inputs = make_inputs(2, 3, 37, 7, seed=0)
    mine = kernel_cases(P22Cpu(PROBLEMS), inputs)["p22_layernorm"][0]
    theirs = kernel_cases(P22Cpu(SOLUTIONS), inputs)["p22_layernorm"][0]
    assert not torch.allclose(mine, theirs, equal_nan=False)


def test_a_cpu_op_that_does_not_compile_is_located_and_the_rest_build(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A SIMD width Mojo refuses only when it builds for the CPU (MAX names no place for it): the build's log gives
    the file, line and region; the ops it takes down are its file's and its importers'; the rest build and run."""
    monkeypatch.setenv("OPS_CACHE_DIR", str(tmp_path / "cache"))
    pkg = tmp_path / "op"
    shutil.copytree(SOLUTIONS, pkg)
    source = pkg / "layernorm.mojo"
    line = "    var mean = s / Float32(hidden)\n"
    bad = "    var v3 = SIMD[DType.float32, 3](1.0, 2.0, 3.0)\n"
    source.write_text(source.read_text().replace(line, line + bad, 1))
    with pytest.raises(MojoCompileError) as e:
        P22Cpu(pkg).build()
    problems = parse_errors(e.value.log)
    assert problems and problems[0].path == source.resolve(), e.value.log
    assert region_of(problems[0]) == "[row_stats_cpu]", e.value.log
    broken = ops_broken_by(pkg, problems)
    assert {"p22_layernorm", "p22_fused", "p22_fused_naive"} <= broken <= set(OPS) - {"p22_transpose"}, broken
    rest = P22Cpu(pkg, skip=frozenset(broken))
    w = torch.randn(5, 3)
    assert torch.equal(rest.transpose(w)[0], w.T)


def test_check_routes_give_the_same_report() -> None:
    """``p22 --check`` by the direct route and by MAX: the same exit code and the same per-kernel lines."""
    def report(route: str) -> tuple[int, list[str]]:
        got = subprocess.run([sys.executable, str(ROOT / "scripts" / "p22.py"), "--check", "--cpu", "--seed", "0",
                              "--check-route", route], cwd=ROOT, capture_output=True, text=True,
                             stdin=subprocess.DEVNULL, timeout=600)
        return got.returncode, [ln for ln in got.stdout.splitlines() if ln.startswith(("  pass", "  FAIL", "     "))]

    direct, by_max = report("direct"), report("max")
    assert direct == by_max and direct[0] == 1 and len(direct[1]) >= 6, (direct, by_max)
