"""Many MAX graphs compiled at once: one module per package and device, new modules in parallel processes.

A MAX compile has a large fixed cost, even for a one-add graph, so ``load_groups`` puts each group's graphs (one
per op, each called alone as ``bridge.load_model``'s) into one ``max.graph.Module``: six ops cost about what one
does. MAX compiles one module at a time per process (two in threads overlap little), so when several modules are
new, all but the first compile in worker processes of their own (docs/learner_loop.md says why).

Each compiled module is saved as a MEF file in the project's cache (``modules/``, named by its ops' content keys,
MAX's version and the GPU's compute capability), published by an atomic rename with its SHA-256 beside it. A
rerun loads it in milliseconds instead of building its graphs again to find them in MAX's cache; one that does
not verify or load is removed and rebuilt, with a line saying so.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import pickle
import subprocess
import sys
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch

from ops.launch import bridge, cache, packages, progress
from ops.launch.bridge import GraphOp
from ops.launch.packages import MojoCompileError

Calls = Sequence[tuple[GraphOp, tuple[torch.dtype, ...]]]
WORKER_FAILED = 3   # a worker's exit code when its module does not compile (its log on stdout)
KEEP_SAVED = 200    # saved modules kept, the least recently used removed past it (each edit of a kernel adds one)


def load_groups(groups: Sequence[tuple[Calls, torch.device, str]]) -> list[int | MojoCompileError]:
    """Compile, or load saved, every (op, input dtypes) of each group's calls not yet loaded for its device: one
    MAX module per group, the new ones in parallel processes, under one progress line showing the labels. Groups
    whose packages are alike to the byte share one compile.

    Args:
        groups: (calls, device, label) per group: calls are (op, input dtypes); label names it on the line.

    Returns:
        Per group, how many graphs it compiled, or the MojoCompileError that stopped it (the others go on).
    """
    owner: dict[tuple, int] = {}   # model key -> the group that builds it
    plans = [_Plan(calls, device, label, owner, i) for i, (calls, device, label) in enumerate(groups)]
    results: list[int | MojoCompileError] = [0] * len(plans)
    busy = sorted((p for p in plans if p.todo), key=lambda p: p.kind != "gpu")   # a GPU module takes longest
    if busy:
        with bridge.models_lock, ExitStack() as locks, progress.building(", ".join(p.label for p in busy)) as b:
            for plan in busy:
                locks.enter_context(cache.built_once(f"module {plan.keys}"))
            _build(busy, results, b)
    for plan in plans:   # a group whose graphs another built shares that one's failure
        errors = [results[j] for j in plan.borrowed(owner) if isinstance(results[j], MojoCompileError)]
        if errors and not isinstance(results[plan.me], MojoCompileError):
            results[plan.me] = errors[0]
    return results


def _build(busy: list[_Plan], results: list[int | MojoCompileError], build: progress.building) -> None:
    """Load each plan's saved module, or precompile its package and compile it: the first new one here, the
    others in workers at the same time, whose saved modules this process then loads. Fills ``results``."""
    new = []
    for plan in busy:
        if plan.load_saved():
            results[plan.me] = len(plan.todo)
            continue
        try:
            plan.libraries = [build.run(lambda p=p: packages.compile_package(p)) for p in plan.packages]
            new.append(plan)
        except MojoCompileError as e:   # the package itself does not compile
            results[plan.me] = e
    workers = [_Worker(plan) for plan in new[1:]]
    try:
        if new:
            results[new[0].me] = new[0].compile_here(build)
        for plan, worker in zip(new[1:], workers, strict=True):
            failed = worker.wait(build)
            results[plan.me] = failed or (len(plan.todo) if plan.load_saved() else plan.compile_here(build))
    finally:
        for worker in workers:
            worker.stop()


class _Plan:
    """What one group still needs: the ops not loaded for its device, their graphs' names and model keys."""

    def __init__(self, calls: Calls, device: torch.device, label: str, owner: dict[tuple, int], me: int) -> None:
        self.device, self.kind = device, bridge.device_kind(device)
        self.label, self.me = label, me
        self.wanted = [bridge.model_key(op, tuple(dt), device) for op, dt in calls]
        mine = [((op, tuple(dt)), key) for (op, dt), key in zip(calls, self.wanted, strict=True)
                if not bridge.loaded(key) and owner.setdefault(key, me) == me]
        self.todo = [call for call, _ in mine]
        self.keys = [key for _, key in mine]
        self.names = [f"{op.name}_{i}" for i, (op, _) in enumerate(self.todo)]
        self.packages = sorted({op.package for op, _ in self.todo})
        self.libraries: list[Path] = []
        self.saved = _saved_path(self.names, self.keys, device)

    def borrowed(self, owner: dict[tuple, int]) -> set[int]:
        """The other groups that build graphs this one needs."""
        return {owner[key] for key in self.wanted if key in owner} - {self.me}

    def load_saved(self) -> bool:
        """Keep the models of the saved module if there is one that verifies and loads; else remove it."""
        if not cache.verified(self.saved):   # a damaged one is removed, with a line
            return False
        try:
            models = bridge.session(self.device).load_all(str(self.saved))
            self._keep(models)
            cache.touch(self.saved)   # recently used: the last to be swept
            return True
        except (OSError, ValueError, RuntimeError, KeyError) as e:
            print(f"  {self.saved}: {e}; rebuilding it", file=sys.stderr)
            with contextlib.suppress(OSError):   # a read-only cache keeps it; the rebuilt one stays in memory
                self.saved.unlink(missing_ok=True)
            return False

    def compile_here(self, build: progress.building) -> int | MojoCompileError:
        """Compile the module in this process (MAX builds graphs in its context's thread), save it, keep it."""
        session = bridge.session(self.device)
        module = module_of(self.names, self.todo, self.device)
        try:
            compiled = build.run(lambda: session.compile(module, custom_extensions=self.libraries))
        except RuntimeError as e:
            return _compile_error(self.label, e)
        _save(compiled, self.saved)
        self._keep(session.init_all(compiled))
        return len(self.todo)

    def _keep(self, models: dict[str, Any]) -> None:
        for name, key in zip(self.names, self.keys, strict=True):
            bridge.keep(key, models[name])


def _compile_error(label: str, e: RuntimeError) -> MojoCompileError:
    """MAX's own message is the cause; its wrapper says only "file an issue"."""
    log = str(e.__cause__ or e)
    return MojoCompileError(f"MAX could not compile {label}:\n{log}", log=log)


def _saved_path(names: Sequence[str], keys: Sequence[tuple], device: torch.device) -> Path:
    """Where the module of these graphs is saved: named by their keys, MAX's version and the GPU's capability."""
    gpu = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    what = repr((list(names), list(keys), cache.tool_version("max"), gpu))
    return cache.cache_dir() / "modules" / f"{hashlib.sha256(what.encode()).hexdigest()[:32]}.mef"


def _save(compiled: Any, path: Path) -> None:
    """Write ``compiled`` to ``path`` with its checksum (``cache.publish``), unless the cache is read-only; past
    ``KEEP_SAVED`` modules, the least recently used removed."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        staging = path.with_name(f".{path.name}.{os.getpid()}")
        compiled.export_mef(str(staging))
        cache.publish(staging, path)
    except OSError as e:
        if e.errno in cache.READ_ONLY:
            return   # a read-only cache: the module runs from memory, compiled again by the next process
        raise
    saved = sorted(path.parent.glob("*.mef"), key=lambda f: f.stat().st_mtime)
    for old in saved[:-KEEP_SAVED]:
        for f in (old, old.with_name(old.name + ".sha256")):
            f.unlink(missing_ok=True)


def module_of(names: Sequence[str], calls: Calls, device: torch.device) -> Any:
    """A ``max.graph.Module`` holding one graph per (op, input dtypes), each named by ``names``."""
    from max.graph import Module

    kind, index = bridge.device_kind(device), device.index or 0
    module = Module()
    for name, (op, dtypes) in zip(names, calls, strict=True):
        bridge.build_multi_graph(name, [(op, dtypes)], kind, index, module=module)
    return module


class _Worker:
    """A process compiling one plan's module and saving it (``python -m ops.launch.together``)."""

    def __init__(self, plan: _Plan) -> None:
        root = str(bridge.ROOT)
        env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.proc = subprocess.Popen([sys.executable, "-m", "ops.launch.together"], cwd=root, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        assert self.proc.stdin is not None
        job = (plan.names, plan.todo, str(plan.device), plan.libraries, plan.saved)
        self.proc.stdin.write(pickle.dumps(job))
        self.proc.stdin.close()
        self.label = plan.label

    def wait(self, build: progress.building) -> MojoCompileError | None:
        """The worker's compile error, or None (saved; or it broke otherwise, and this process compiles it)."""
        assert self.proc.stdout is not None
        out = build.run(lambda: self.proc.stdout.read().decode(errors="replace"))
        self.proc.wait()
        if self.proc.returncode == WORKER_FAILED:
            return MojoCompileError(f"MAX could not compile {self.label}:\n{out}", log=out)
        return None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _worker_main() -> int:
    names, calls, device, libraries, saved = pickle.loads(sys.stdin.buffer.read())
    device = torch.device(device)
    module = module_of(names, calls, device)
    try:
        compiled = bridge.session(device).compile(module, custom_extensions=libraries)
    except RuntimeError as e:
        print(_compile_error("", e).log)
        return WORKER_FAILED
    _save(compiled, saved)
    return 0


if __name__ == "__main__":
    sys.exit(_worker_main())
