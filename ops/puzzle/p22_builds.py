"""Building a p22 package for ``scripts/p22.py``, and its compile errors: through MAX (``build_reported``) or without
it (``DIRECT``: ``built_direct``, ``build_all_reported``), every build of a run at once under one progress line, each
compile error printed first and short (file:line:col, the fill-in region, the compiler's message, the kernels it takes
down)."""

from __future__ import annotations

import threading
from pathlib import Path

import torch

from ops.launch import bridge, progress, together
from ops.launch.bridge import ROOT
from ops.launch.packages import MojoCompileError
from ops.puzzle.p22 import P22Kernels
from ops.puzzle.p22_cpu import P22Cpu
from ops.puzzle.p22_diagnose import (
    CompileProblem,
    harness_errors,
    ops_broken_by,
    parse_errors,
    region_of,
    unlocated,
)
from ops.puzzle.p22_direct import P22Direct


def shown(path: Path) -> str:
    """``path`` as the runner prints it: from the repository's root where it lies inside."""
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def build_reported(jobs: list[tuple[P22Kernels, str]], partial: bool) -> dict[tuple[Path, str], frozenset[str]]:
    """Build every (kernels, device) of ``jobs``, all at once; print each compile error first and short.

    Returns, for each job whose package does not compile, the ops that could not be built. With ``partial``
    (``--check``) the package's other ops are built without them, so that they can still be checked.
    """
    done = together.load_groups([(k.calls(), torch.device(dev), job_label(k, dev)) for k, dev in jobs])
    failed = [(k, dev, e) for (k, dev), e in zip(jobs, done, strict=True) if isinstance(e, MojoCompileError)]
    unbuilt, reports = {}, []
    for k, dev, e in failed:
        kind = bridge.device_kind(torch.device(dev))
        problems = parse_errors(e.log) or harness_errors(k.package, kind) or unlocated(e.log)
        every = k.op_names()
        broken = every if e.stage == "package" else frozenset(ops_broken_by(k.package, problems)) & every
        unbuilt[(k.package, dev)] = broken
        reports.append((k, dev, problems))
    if partial:   # the ops the errors leave alone, so that --check reports every kernel it could build
        rest = [(k, dev) for k, dev, _ in failed if unbuilt[(k.package, dev)] != k.op_names()]
        again = together.load_groups([(k.calls(unbuilt[(k.package, dev)]), torch.device(dev),
                                     job_label(k, dev) + " without those") for k, dev in rest])
        for (k, dev), e in zip(rest, again, strict=True):
            if isinstance(e, MojoCompileError):
                unbuilt[(k.package, dev)] = k.op_names()
    for k, dev, problems in reports:
        print_compile_problems(k.package, bridge.device_kind(torch.device(dev)), problems, unbuilt[(k.package, dev)])
    return unbuilt


def job_label(k: P22Kernels, dev: str) -> str:
    """A MAX build's words on the progress line: the package and its device."""
    return f"{shown(k.package)} for {bridge.device_kind(torch.device(dev))}"


def print_compile_problems(package: Path, kind: str, problems: list[CompileProblem], broken: frozenset[str]) -> None:
    print(f"\nCompile error: {shown(package)} does not build for {kind}")
    for p in problems[:3]:
        print(f"  {p.where(ROOT)}: in {region_of(p)}: error: {p.message}")
        for quoted in p.source:
            print(f"    {quoted}")
    if len(problems) > 3:
        more = len(problems) - 3
        print(f"  ... and {more} more error{'s' if more > 1 else ''}")
    print(f"  kernels that cannot run until it is fixed: {', '.join(sorted(broken))}\n")


DIRECT = {"cpu": P22Cpu, "cuda": P22Direct}   # how a verdict calls each device's kernels without MAX
Job = tuple[str, Path]   # (device, package) of a direct build


def built_direct(learner: P22Kernels, solution: P22Kernels, devices: list[str],
                 unbuilt: dict[tuple[Path, str], frozenset[str]]) -> dict[str, tuple[P22Cpu | P22Direct, ...]]:
    """Both packages' kernels for each device, built without MAX (``DIRECT``), every build at once; where some do
    not compile, the error is printed first and short, the ops it takes down go into ``unbuilt`` and the others
    are built without them. Returns device -> (learner's, solution's)."""
    jobs = {(dev, k.package): DIRECT[dev](k.package) for dev in devices for k in (learner, solution)}
    for (dev, package), (problems, broken) in build_all_reported(jobs, f"{shown(learner.package)} for "
                                                                  f"{', '.join(devices)}", partial=True).items():
        jobs[(dev, package)] = DIRECT[dev](package, skip=broken)
        if build_all({(dev, package): jobs[(dev, package)]}, f"{shown(package)} for {dev} without those"):
            broken = learner.op_names()
        unbuilt[(package, dev)] = broken
        print_compile_problems(package, bridge.device_kind(torch.device(dev)), problems, broken)
    return {dev: (jobs[(dev, learner.package)], jobs[(dev, solution.package)]) for dev in devices}


def build_all_reported(jobs: dict[Job, P22Cpu | P22Direct], label: str,
                       partial: bool = False) -> dict[Job, tuple[list[CompileProblem], frozenset[str]]]:
    """``build_all``, and for each job that does not compile: (its errors, the ops they take down), printed first and
    short unless ``partial`` (then the caller builds the others and prints them)."""
    failed = {}
    for (dev, package), e in build_all(jobs, label).items():
        problems = parse_errors(e.log) or unlocated(e.log)
        broken = frozenset(ops_broken_by(package, problems)) & P22Kernels(package).op_names()
        failed[(dev, package)] = problems, broken
        if not partial:
            print_compile_problems(package, bridge.device_kind(torch.device(dev)), problems, broken)
    return failed


def build_all(jobs: dict[Job, P22Cpu | P22Direct], label: str) -> dict[Job, MojoCompileError]:
    """``build()`` every one of ``jobs`` in threads of their own (each is a ``mojo`` process), one progress line for
    all; returns job -> its compile error, for those that do not compile. Any other error (a cache folder that cannot
    be used, say) is raised here, in the caller's thread."""
    errors: dict[Job, Exception] = {}

    def build(job: Job, d: P22Cpu | P22Direct) -> None:
        try:
            d.build()
        except Exception as e:  # noqa: BLE001 -- handed to the caller's thread below
            errors[job] = e

    def work() -> None:
        threads = [threading.Thread(target=build, args=item, daemon=True) for item in jobs.items()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    with progress.building(label) as b:
        b.run(work)
    for e in errors.values():
        if not isinstance(e, MojoCompileError):
            raise e
    return {job: e for job, e in errors.items() if isinstance(e, MojoCompileError)}
