"""The p22 kernels launched from their PTX (``ops/puzzle/p22_direct.py``, how ``p22 --check`` checks the GPU kernels):
built on any machine; on a GPU, each kernel's output is the MAX route's, bit for bit, on the check's shapes."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ops.launch import ptx
from ops.launch.packages import MojoCompileError
from ops.puzzle.p22 import PROBLEMS, SOLUTIONS, P22Kernels, kernel_cases, make_inputs
from ops.puzzle.p22_diagnose import ops_broken_by, parse_errors, region_of
from ops.puzzle.p22_direct import KERNELS, P22Direct

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import p22 as cli  # noqa: E402


def test_every_kernel_builds_to_ptx_for_the_h100(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The solution's six GPU kernels, and the problems' (stubs compile), each to PTX with its kernel entry, whose
    parameters are the ones ``KERNELS`` packs."""
    monkeypatch.setenv("OPS_CACHE_DIR", str(tmp_path / "cache"))
    for package in (SOLUTIONS, PROBLEMS):
        d = P22Direct(package)
        d.build("H100")
        assert set(d.specs) == set(KERNELS)
        for spec in d.specs.values():   # the entry takes what the launch packs: pointers as .u64, Int32 as .b32
            text = ptx.ptx_path(spec, "H100").read_text()
            entry = ptx.entry_name(text)
            params = text[text.index(entry + "("):text.index(")", text.index(entry + "("))]
            assert (params.count(".u64"), params.count(".b32")) == (spec.args.count("p"), spec.args.count("i")), spec


def test_a_kernel_that_does_not_compile_is_located_and_the_rest_build(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A type error in a GPU kernel's fill-in region: the PTX build's log gives its file, line and region; the ops
    it takes down are its file's and its importers'; the other kernels build without them."""
    monkeypatch.setenv("OPS_CACHE_DIR", str(tmp_path / "cache"))
    pkg = tmp_path / "op"
    shutil.copytree(SOLUTIONS, pkg)
    source = pkg / "transpose.mojo"
    source.write_text(source.read_text().replace("    barrier()\n", "    barrier()\n    var bad: Int = \"x\"\n", 1))
    with pytest.raises(MojoCompileError) as e:
        P22Direct(pkg).build("H100")
    problems = parse_errors(e.value.log)
    assert problems and problems[0].path == source.resolve() and region_of(problems[0]) == "transpose_kernel"
    broken = ops_broken_by(pkg, problems)
    assert broken == {"p22_transpose"}, broken
    rest = P22Direct(pkg, skip=frozenset(broken))
    rest.build("H100")
    assert set(rest.specs) == set(KERNELS) - broken


@pytest.mark.gpu
def test_gpu_direct_launches_give_the_max_routes_outputs() -> None:
    """Each solution kernel from its PTX gives what its MAX op gives on the GPU, bit for bit, on every check shape
    (the same kernel, grid and block)."""
    by_max, by_ptx = P22Kernels(SOLUTIONS), P22Direct(SOLUTIONS)
    by_ptx.build()
    for shape in cli.CHECK_SHAPES:
        inputs = make_inputs(*shape, device="cuda", mean=1e3 if shape[2] > 100 else 0.0, seed=0)
        want, got = kernel_cases(by_max, inputs), kernel_cases(by_ptx, inputs)
        for name, (y, _, _) in got.items():
            assert torch.equal(y, want[name][0]), f"{name} {shape}"


@pytest.mark.gpu
@pytest.mark.parametrize(("package", "code"), [(SOLUTIONS, 0), (PROBLEMS, 1)])
def test_gpu_check_through_ptx_gives_the_max_routes_verdicts(package: Path, code: int) -> None:
    """``p22 --check --check-route direct``: the solution passes on both devices, the stubs fail (exit 1)."""
    got = subprocess.run([sys.executable, str(ROOT / "scripts" / "p22.py"), "--check", "--package", str(package),
                          "--check-route", "direct"], cwd=ROOT, capture_output=True, text=True,
                         stdin=subprocess.DEVNULL, timeout=600)
    assert got.returncode == code, got.stdout + got.stderr
    assert " on cuda:" in got.stdout and (code or got.stdout.count("pass p22_") == 12), got.stdout
