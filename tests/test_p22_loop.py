"""The puzzle's loop as a learner meets it: progress while the kernels build, Ctrl-C, compile errors, exit codes,
never a stale verdict. Needs no GPU (on a GPU machine ``--check`` checks the GPU kernels too, which these
copies leave as stubs or as the solution's)."""

from __future__ import annotations

import io
import os
import pty
import re
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ops.launch import progress
from ops.puzzle.p22 import PROBLEMS, SOLUTIONS

ROOT = Path(__file__).resolve().parent.parent
P22 = [sys.executable, str(ROOT / "scripts" / "p22.py")]
HAS_GPU = torch.cuda.is_available()


def package_copy(tmp_path: Path, source: Path, marker: str) -> Path:
    """A copy of ``source`` with a comment that gives it a digest of its own (so it is built, not found cached)."""
    pkg = tmp_path / "op"
    shutil.copytree(source, pkg)
    init = pkg / "__init__.mojo"
    init.write_text(init.read_text() + f"# {marker} {tmp_path.name} {time.time_ns()}\n")
    return pkg


def edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, old
    path.write_text(text.replace(old, new, 1))


def p22(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*P22, *argv], cwd=ROOT, capture_output=True, text=True, stdin=subprocess.DEVNULL)


# ---------------------------------------------------------------- progress


class _Stream(io.StringIO):
    def __init__(self, tty: bool) -> None:
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


@pytest.mark.parametrize("tty", [True, False])
def test_progress_line_while_building(monkeypatch: pytest.MonkeyPatch, tty: bool) -> None:
    """A build past QUIET_S: one line rewritten in place on a terminal, plain lines when piped; its result returned."""
    stream = _Stream(tty)
    monkeypatch.setattr(progress, "_stream", stream)
    monkeypatch.setattr(progress, "QUIET_S", 0.3)
    with progress.building("p22 for cpu") as b:
        assert b.run(lambda: time.sleep(0.9) or 42) == 42
    out = stream.getvalue()
    if tty:
        assert out.startswith("\r\033[K  building p22 for cpu ... ") and out.count("\r\033[K") >= 2
        assert out.endswith(" done 1 s\n")
    else:
        assert "\r" not in out and "\033" not in out
        assert out.splitlines() == ["  building p22 for cpu ... 0 s", "  built p22 for cpu in 0.9 s"]


def test_progress_quiet_for_quick_builds_and_when_disabled(monkeypatch: pytest.MonkeyPatch) -> None:
    stream = _Stream(True)
    monkeypatch.setattr(progress, "_stream", stream)
    with progress.building("cached") as b:
        assert b.run(lambda: "model") == "model"
    assert stream.getvalue() == ""
    monkeypatch.setattr(progress, "_stream", None)
    with progress.building("off") as b:
        assert b.run(lambda: 7) == 7


def test_progress_passes_errors_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(progress, "_stream", _Stream(False))
    with pytest.raises(ValueError, match="broken kernel"), progress.building("x") as b:
        b.run(lambda: (_ for _ in ()).throw(ValueError("broken kernel")))


def test_check_on_a_terminal_shows_the_build(tmp_path: Path) -> None:
    """The real runner on a pseudo-terminal: the progress line updates in place while the package builds."""
    pkg = package_copy(tmp_path, PROBLEMS, "tty")
    pid, fd = pty.fork()
    if pid == 0:   # the child: the runner with the terminal as its stdout and stderr
        os.chdir(ROOT)
        os.execv(sys.executable, [*P22, "--check", "--package", str(pkg)])
    out = b""
    while True:
        ready, _, _ = select.select([fd], [], [], 300)
        try:
            chunk = os.read(fd, 4096) if ready else b""
        except OSError:   # the child closed the terminal
            chunk = b""
        if not chunk:
            break
        out += chunk
    _, status = os.waitpid(pid, 0)
    text = out.decode(errors="replace")
    assert os.waitstatus_to_exitcode(status) == 1, text   # the stubs give wrong answers
    line = re.compile(rf"\r\033\[K  building [^\r\n]*{re.escape(str(pkg))} for cpu ")
    assert len(line.findall(text)) >= 2, text   # rewritten in place as the seconds go by
    assert re.search(rf"{re.escape(str(pkg))} for cpu done \d+ s", text), text


# ---------------------------------------------------------------- Ctrl-C and recovery


def test_ctrl_c_during_a_build_returns_at_once_and_the_next_run_works(tmp_path: Path) -> None:
    """SIGINT while the kernels compile: exit 130 within a second or two; then a rerun builds and gives the verdict."""
    pkg = package_copy(tmp_path, PROBLEMS, "interrupt")
    proc = subprocess.Popen([*P22, "--check", "--package", str(pkg)], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    assert proc.stdout is not None
    for line in proc.stdout:   # piped: a plain line once the build has run past a second
        if f"{pkg} for cpu ..." in line:
            break
    time.sleep(1.0)   # deep inside the build
    sent = time.perf_counter()
    proc.send_signal(signal.SIGINT)
    rest = proc.stdout.read()
    assert proc.wait(timeout=30) == 130, rest
    assert time.perf_counter() - sent < 3.0
    assert "interrupted" in rest
    again = p22("--check", "--package", str(pkg))
    assert again.returncode == 1, again.stdout + again.stderr
    assert "pass p22_transpose" in again.stdout and "FAIL p22_layernorm" in again.stdout


def test_killed_build_leaves_nothing_that_breaks_the_next_run(tmp_path: Path) -> None:
    """SIGKILL mid-build (no handler runs at all): the rerun is correct."""
    pkg = package_copy(tmp_path, SOLUTIONS, "kill")
    proc = subprocess.Popen([*P22, "--check", "--package", str(pkg)], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
    time.sleep(6.0)
    proc.kill()
    proc.wait()
    again = p22("--check", "--package", str(pkg))
    assert again.returncode == 0, again.stdout + again.stderr
    assert again.stdout.count("pass p22_") == 6 * (2 if HAS_GPU else 1)


def test_a_damaged_saved_module_is_rebuilt(tmp_path: Path) -> None:
    """A saved module cut short, or whose checksum does not match: said in a line, rebuilt, the verdict right."""
    pkg = package_copy(tmp_path, SOLUTIONS, "damaged")
    env = dict(os.environ, OPS_CACHE_DIR=str(tmp_path / "cache"))

    def check() -> subprocess.CompletedProcess[str]:
        return subprocess.run([*P22, "--check", "--package", str(pkg), "--cpu", "--check-route", "max"], cwd=ROOT,
                              capture_output=True, text=True, stdin=subprocess.DEVNULL, env=env)

    assert check().returncode == 0
    saved = sorted((tmp_path / "cache" / "modules").glob("*.mef"))
    assert len(saved) == 2   # the learner's module and the solution's
    saved[0].write_bytes(saved[0].read_bytes()[:1000])
    saved[1].with_name(saved[1].name + ".sha256").write_text("0" * 64 + "\n")
    got = check()
    assert got.returncode == 0, got.stdout + got.stderr
    assert got.stderr.count("does not match its checksum") == 2, got.stderr
    again = check()
    assert again.returncode == 0 and "checksum" not in again.stderr, again.stderr


# ---------------------------------------------------------------- compile errors and stale verdicts


def test_syntax_error_exit_3_with_file_line_and_region(tmp_path: Path) -> None:
    pkg = package_copy(tmp_path, SOLUTIONS, "syntax")
    edit(pkg / "layernorm.mojo", "    var mean = s / Float32(hidden)\n", "    var mean = s / Float32(hidden) +\n")
    got = p22("--check", "--package", str(pkg))
    assert got.returncode == 3, got.stdout + got.stderr
    assert "Traceback" not in got.stdout + got.stderr
    lines = got.stdout.splitlines()
    first = next(i for i, ln in enumerate(lines) if ": error: " in ln)
    assert f"{pkg}/layernorm.mojo:" in lines[first] and ": in [row_stats_cpu]: error: " in lines[first], got.stdout
    assert lines.index(" on cpu:") > first   # the error comes before the per-kernel report
    assert "FAIL p22_layernorm    does not compile" in got.stdout
    assert "pass p22_transpose" in got.stdout   # the files the error leaves alone are still checked
    run = p22("--fused", "--package", str(pkg), "--cpu", "--no-bench")
    assert run.returncode == 3 and ": in [row_stats_cpu]: error: " in run.stdout, run.stdout + run.stderr


def test_device_only_error_located_and_the_other_kernels_still_checked(tmp_path: Path) -> None:
    """An error Mojo finds only when it builds for a device (MAX names no place): the harness finds file:line;
    --check reports every kernel it could build; the fix needs no cache to clear."""
    pkg = package_copy(tmp_path, SOLUTIONS, "device-only")
    good = (pkg / "layernorm.mojo").read_text()
    edit(pkg / "layernorm.mojo", "    var mean = s / Float32(hidden)\n",
         "    var mean = s / Float32(hidden)\n    var v3 = SIMD[DType.float32, 3](1.0, 2.0, 3.0)\n")
    got = p22("--check", "--package", str(pkg), "--cpu")
    assert got.returncode == 3, got.stdout + got.stderr
    assert "Traceback" not in got.stdout + got.stderr and "file an issue" not in got.stdout
    assert f"{pkg}/layernorm.mojo:" in got.stdout and "in [row_stats_cpu]: error: SIMD vector length" in got.stdout
    for given in ("p22_transpose", "p22_matmul", "p22_bias_add"):
        assert f"pass {given}" in got.stdout
    for broken in ("p22_layernorm", "p22_fused ", "p22_fused_naive"):
        assert f"FAIL {broken.strip():16s} does not compile" in got.stdout
    (pkg / "layernorm.mojo").write_text(good)
    fixed = p22("--check", "--package", str(pkg), "--cpu")
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr


def test_an_edited_stub_is_always_rebuilt(tmp_path: Path) -> None:
    """Right, then wrong by one edit inside a fill-in region: the second verdict is about the edit, never stale."""
    pkg = package_copy(tmp_path, SOLUTIONS, "stale")
    assert p22("--check", "--package", str(pkg), "--cpu").returncode == 0
    assert p22("--unfused", "--package", str(pkg), "--cpu", "--no-bench").returncode == 0
    edit(pkg / "layernorm.mojo", "    return (mean, rsqrt(ss / Float32(hidden) + EPS))",
         "    return (mean, rsqrt(ss / Float32(hidden + 1) + EPS))")
    got = p22("--check", "--package", str(pkg), "--cpu")
    assert got.returncode == 1, got.stdout + got.stderr
    assert "FAIL p22_layernorm" in got.stdout and "pass p22_transpose" in got.stdout
    run = p22("--unfused", "--package", str(pkg), "--cpu", "--no-bench")
    assert run.returncode == 1 and "unfused  on cpu : max abs err" in run.stdout and "FAIL" in run.stdout, run.stdout


def test_a_learner_package_equal_to_the_solution_builds_once(tmp_path: Path) -> None:
    """Solved to the byte: the learner's graphs are the solution's (one build, not a lock taken twice)."""
    pkg = tmp_path / "op"
    shutil.copytree(SOLUTIONS, pkg)
    got = subprocess.run([*P22, "--check", "--package", str(pkg)], cwd=ROOT, capture_output=True, text=True,
                         stdin=subprocess.DEVNULL, timeout=300)
    assert got.returncode == 0, got.stdout + got.stderr


# ---------------------------------------------------------------- exit codes


@pytest.mark.parametrize("argv", [["--batch", "0", "--unfused"], ["--unfused", "--variant", "fast"], [],
                                  ["--fused", "--seq", "x"]])
def test_usage_errors_exit_4(argv: list[str]) -> None:
    got = p22(*argv)
    assert got.returncode == 4, got.stdout + got.stderr
    assert "p22: error:" in got.stderr


def test_sizes_beyond_memory_are_refused_before_allocating() -> None:
    start = time.perf_counter()
    got = p22("--solution", "--unfused", "--cpu", "--hidden", "1000000", "--out", "1000000")
    assert got.returncode == 4, got.stdout + got.stderr
    assert "--hidden 1000000 --out 1000000: this run needs about" in got.stderr and "GB" in got.stderr
    assert time.perf_counter() - start < 30


def test_help_lists_the_exit_codes() -> None:
    got = p22("--help")
    assert got.returncode == 0
    for code in ("0 every result correct", "1 a wrong result", "2 a needed kernel is still a stub",
                 "3 a kernel does not compile", "4 a usage error"):
        assert code in " ".join(got.stdout.split()), got.stdout


def test_learner_loop_quick() -> None:
    """The measuring script's steps on the caches already here: every exit code as the puzzle promises."""
    got = subprocess.run([sys.executable, str(ROOT / "scripts" / "learner_loop.py"), "--quick"], cwd=ROOT,
                         capture_output=True, text=True, stdin=subprocess.DEVNULL)
    assert got.returncode == 0, got.stdout + got.stderr
    assert got.stdout.count(" exit ") == 10


def test_learner_loop_keeps_bytecode_where_the_host_forbids_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under PYTHONDONTWRITEBYTECODE (the lent GPU machine's setting) the steps run as after a pip install: the variable
    dropped, bytecode kept in the run's folder, torch's compiled first, and the report says what the setting costs;
    without it nothing changes."""
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import learner_loop

    ran = []
    monkeypatch.setattr(learner_loop.subprocess, "run", lambda argv, env, check: ran.append(dict(env)))
    monkeypatch.delenv("PYTHONDONTWRITEBYTECODE", raising=False)
    env = {"PATH": "x"}
    assert learner_loop.bytecode_as_installed(env, tmp_path) is None and env == {"PATH": "x"} and not ran
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    env = dict(os.environ)
    line = learner_loop.bytecode_as_installed(env, tmp_path)
    assert "PYTHONDONTWRITEBYTECODE" not in env and env["PYTHONPYCACHEPREFIX"] == str(tmp_path / "pycache")
    assert len(ran) == 7 and ran[0] == env   # the warm-up that compiles, then 3 runs each way
    assert sum("PYTHONDONTWRITEBYTECODE" in e for e in ran) == 3
    assert re.search(r"take \d+\.\d s so, \d+\.\d s with bytecode kept", line), line
