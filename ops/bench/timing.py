"""Honest timing shared by every benchmark: device time and host latency, reported apart.

Device time: CUDA events around each call, after warm-up, median over many
calls, cycling through several input sets so caches don't flatter. A spin
kernel queued before the start event keeps the GPU busy while the host
enqueues the call, so host launch cost never shows up as device time. On CPU
the "device" is the host, so wall time per call is reported instead.
Kernel time (optional): what CUPTI (torch.profiler) records for the call's own
kernels, memsets and copies, without the launch gaps and stream hops that the
events also count; each call is delimited by a tiny spin kernel.
Pipelined time (the headline, what a user's loop feels): PIPELINE calls back to back,
allocations included, one synchronisation, divided; the median of REPEATS such runs.
It is the larger of host and device time per call, plus whatever they fail to overlap.
Host time: in the same runs, the time until the last call has returned (before the
synchronisation), divided: what a call costs the host while it runs ahead of the device.
(A median of single calls timed apart, as before 2026-11-26, read up to 5x the pipelined
time of host-bound calls, which cannot be: see docs/library.md.)
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import os
import re
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

# About 5 ms at H100 clocks: longer than the host needs to enqueue any call we
# time (the unfused p22 path is four bridge calls).
SPIN_CYCLES = 10_000_000
# The marker between profiled calls: long enough to show up, short enough not to matter.
MARK_CYCLES = 1_000
PIPELINE = 200   # calls per pipelined run
PIPELINE_BUDGET_US = 200_000   # measure(): a pipelined run of slow calls is cut to about this long
REPEATS = 5      # pipelined runs (median)
MARK_KERNEL = "spin_kernel"  # the name of the kernel torch.cuda._sleep launches
_NOT_WORK = re.compile("annotation|sync")  # CUPTI device records that are not kernels, memsets or copies


@dataclass(frozen=True)
class Timing:
    """One call's medians in microseconds: device time, host time and pipelined time (NaN and None when not
    timed pipelined), and optionally kernel time; ``pipelined_runs``: each pipelined run's time per call (the
    median's repeats)."""

    device_us: float
    host_us: float
    runs: int
    kernel_us: float | None = None
    pipelined_us: float | None = None
    pipelined_runs: tuple[float, ...] = ()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(fn: Callable[..., object], input_sets: Sequence[Sequence[torch.Tensor]],
            iters: int = 50, warmup: int = 5, kernels: bool = False, pipelined: bool = True) -> Timing:
    """Time ``fn(*inputs)`` cycling through ``input_sets``; with ``kernels`` (CUDA only) also its kernel time;
    with ``pipelined`` its pipelined time too (``side_by_side`` times several contenders' interleaved instead).
    The warm-up runs every input set at least once, so first-use costs (compiles, a set's first allocation)
    stay out of the timing; what an op derives from the weights it derives in every call, timed ones too."""
    device = input_sets[0][0].device
    for i in range(max(warmup, len(input_sets))):
        fn(*input_sets[i % len(input_sets)])
    _sync(device)
    device_times = []
    for i in range(iters):
        args = input_sets[i % len(input_sets)]
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(SPIN_CYCLES)
            start.record()
            fn(*args)
            end.record()
            end.synchronize()
            device_times.append(start.elapsed_time(end) * 1e3)
        else:
            t0 = time.perf_counter()
            fn(*args)
            device_times.append((time.perf_counter() - t0) * 1e6)
    kernel = kernel_us(fn, input_sets, iters) if kernels and device.type == "cuda" else None
    device_us = statistics.median(device_times)
    if not pipelined:
        return Timing(device_us, math.nan, iters, kernel)
    runs = pipelined_runs({"fn": _cycling(fn, input_sets)}, pipeline_calls(device_us), REPEATS, device)["fn"]
    return Timing(device_us, runs.host_us, iters, kernel, runs.pipelined_us, runs.runs)


def pipeline_calls(device_us: float) -> int:
    """Calls per pipelined run: PIPELINE, fewer for slow calls (a run of about PIPELINE_BUDGET_US), at least 20."""
    return max(20, min(PIPELINE, int(PIPELINE_BUDGET_US / max(device_us, 1.0))))


def side_by_side(contenders: Sequence[tuple], iters: int = 50, kernels: bool = False) -> dict[str, Timing]:
    """``measure`` each contender, ``(name, fn, input sets)`` or ``(name, fn, input sets, iters)``, for device,
    host and kernel time, then their pipelined times with the contenders' runs interleaved
    (``pipelined_runs``: a drift in the host's speed falls on all alike), median of REPEATS runs each."""
    timings = {c[0]: measure(c[1], c[2], c[3] if len(c) > 3 else iters, kernels=kernels, pipelined=False)
               for c in contenders}
    cycling = {c[0]: _cycling(c[1], c[2]) for c in contenders}
    calls = pipeline_calls(max(t.device_us for t in timings.values()))
    runs = pipelined_runs(cycling, calls, REPEATS, contenders[0][2][0][0].device)
    return {name: dataclasses.replace(t, pipelined_us=runs[name].pipelined_us, host_us=runs[name].host_us,
                                      pipelined_runs=runs[name].runs) for name, t in timings.items()}


def _cycling(fn: Callable[..., object], input_sets: Sequence[Sequence[torch.Tensor]]) -> Callable[[], object]:
    """``fn`` as a call without arguments that takes the next input set each time."""
    sets = itertools.cycle(input_sets)
    return lambda: fn(*next(sets))


def copy_into(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The copy contenders' call: x into y."""
    return y.copy_(x)


def copy_contender(name: str, sets: Sequence[Sequence[torch.Tensor]]) -> tuple:
    """A contender copying each set's x (its first tensor) into a new contiguous tensor: the ceiling at that size,
    or, with a strided x, the copy that our ops make of it first."""
    return (name, copy_into, [(x, torch.empty(x.shape, dtype=x.dtype, device=x.device)) for x, *_ in sets])


def call_fields(t: Timing, baseline: Timing) -> dict[str, float | int | None]:
    """The report columns of how a call feels to a user: pipelined and host time per call, the pipelined ratio to
    ``baseline`` (torch eager), the headline of every benchmark, and its repeat statistics: how many runs the
    median is over (``pipe_runs``) and their spread, (slowest - fastest) / median (``pipe_spread``)."""
    runs = t.pipelined_runs
    return {"pipe_us": round(t.pipelined_us, 2), "host_us": round(t.host_us, 2),
            "pipe_vs_torch": round(t.pipelined_us / baseline.pipelined_us, 3), "pipe_runs": len(runs),
            "pipe_spread": round((max(runs) - min(runs)) / t.pipelined_us, 3) if runs else None}


@dataclass(frozen=True)
class Pipelined:
    """Per call, medians over runs of back-to-back calls: until the synchronisation returned (``pipelined_us``)
    and until the last call returned (``host_us``), in microseconds; ``runs``: each run's pipelined time per call,
    round by round (for ``paired_ratio``)."""

    pipelined_us: float
    host_us: float
    runs: tuple[float, ...] = ()


def paired_ratio(a: Pipelined, b: Pipelined) -> float:
    """The median over rounds of a's run over b's run in the same round (``pipelined_runs``: the two ran next to
    each other, or one run apart), so that a drift in the host's speed slower than a round cancels out of each
    ratio instead of only out of the medians."""
    if not a.runs or len(a.runs) != len(b.runs):
        raise ValueError("paired_ratio: both need the runs of one pipelined_runs call")
    return statistics.median(x / y for x, y in zip(a.runs, b.runs, strict=True))


def pipelined_runs(fns: dict[str, Callable[[], object]], calls: int = PIPELINE, repeats: int = 9,
                   device: torch.device | str = "cuda") -> dict[str, Pipelined]:
    """Runs of ``calls`` back-to-back calls with one synchronisation, of several contenders, their runs
    interleaved and the order rotated each round (A B C, B C A, C A B, ...), so that a drift in the host's speed
    (a noisy machine) and any cost of going first or after another fall on all of them alike; per contender the
    medians of ``repeats`` runs."""
    device = torch.device(device)
    pipe: dict[str, list[float]] = {name: [] for name in fns}
    host: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            fn = fns[name]
            _sync(device)
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            t1 = time.perf_counter()
            _sync(device)
            host[name].append((t1 - t0) * 1e6 / calls)
            pipe[name].append((time.perf_counter() - t0) * 1e6 / calls)
    return {name: Pipelined(statistics.median(pipe[name]), statistics.median(host[name]), tuple(pipe[name]))
            for name in fns}


def _thread_ids() -> list[int]:
    return [int(tid) for tid in os.listdir("/proc/self/task")]


def _set_affinity(tid: int, cpus: set[int]) -> None:
    with contextlib.suppress(ProcessLookupError):   # a thread that ended since it was listed
        os.sched_setaffinity(tid, cpus)


def check_pin_core(core: int, name: str = "pin core") -> None:
    """Raise ValueError, naming ``name``, unless ``core`` is one of the CPUs this process may run on
    (``pinned_threads``' check, for a caller to make before it spends minutes compiling)."""
    allowed = os.sched_getaffinity(0)
    if core not in allowed:
        raise ValueError(f"{name}: expected one of this process's CPUs {sorted(allowed)}, got {core}")


@contextlib.contextmanager
def pinned_threads(core: int | None) -> Iterator[None]:
    """Every thread of this process on the one CPU ``core`` while the block runs (``None``: nothing changes), then
    each back on the CPUs it had (a thread started inside, on those the calling thread had). For timing
    host-bound calls: the threads stop migrating between cores, so runs vary less (docs/direct_launch.md,
    "A precise A/B"). Linux only (``/proc/self/task``).

    Raises:
        ValueError: ``core`` is not one of the CPUs this process may run on.
    """
    if core is None:
        yield
        return
    check_pin_core(core)
    allowed = os.sched_getaffinity(0)
    before = {}
    for tid in _thread_ids():
        with contextlib.suppress(ProcessLookupError):   # a thread that ended since it was listed
            before[tid] = os.sched_getaffinity(tid)
    for tid in before:
        _set_affinity(tid, {core})
    try:
        yield
    finally:
        for tid in _thread_ids():
            _set_affinity(tid, before.get(tid, allowed))


def captured(fn: Callable[[], object], warmup: int = 3, before_capture: Callable[[], None] | None = None,
             keep_graph: bool = False) -> tuple[torch.cuda.CUDAGraph, object]:
    """``fn`` run ``warmup`` times on a side stream (first-use work, such as our ops handing plans to the C++
    entries, stays out of the graph), then captured by ``torch.cuda.graph`` on a capture stream of the current
    device: the graph and what the captured call returned (its outputs, rewritten by every replay).
    ``before_capture`` runs between the two; ``keep_graph`` keeps the graph after instantiation (for
    ``debug_dump``). (torch.cuda.graph's default capture stream is made once per process,
    on the device current at the first capture: later captures on another device would run on it.)"""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    if before_capture is not None:
        before_capture()
    graph = torch.cuda.CUDAGraph(keep_graph=keep_graph)
    with torch.cuda.graph(graph, stream=torch.cuda.Stream()):
        out = fn()
    return graph, out


def kernel_us(fn: Callable[..., object], input_sets: Sequence[Sequence[torch.Tensor]], iters: int = 50) -> float:
    """Median over ``iters`` calls of the device time CUPTI records for one call's kernels (the union of
    their busy intervals), cycling through ``input_sets``; a marker kernel goes before each call."""
    return statistics.median(marked_calls_us(lambda i: fn(*input_sets[i % len(input_sets)]), iters))


def marked_calls_us(call: Callable[[int], object], calls: int) -> list[float]:
    """The device time CUPTI records for each of ``call(0)``, ..., ``call(calls - 1)`` (the union of each
    call's busy intervals), in order; a marker kernel goes before each call."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(calls):
            torch.cuda._sleep(MARK_CYCLES)
            call(i)
        torch.cuda.synchronize()
    spans = [(e.name(), e.start_ns(), e.end_ns()) for e in prof.profiler.kineto_results.events()
             if e.device_type().name == "CUDA" and not _NOT_WORK.search(_activity(e))]
    per_call = busy_us_per_call(spans)
    if len(per_call) != calls:
        raise RuntimeError(f"kernel_us: CUPTI showed {len(per_call)} marked calls, expected {calls}")
    return per_call


def _activity(event: object) -> str:
    """CUPTI's record kind of a kineto event ("kernel", "gpu_memset", ...); older torch does not expose it."""
    return event.activity_type() if hasattr(event, "activity_type") else ""


def busy_us_per_call(spans: Sequence[tuple[str, int, int]]) -> list[float]:
    """Split device activity ``(name, start_ns, end_ns)`` at each marker kernel and return, per marked call,
    the microseconds in which at least one of its kernels ran. A call whose work CUPTI never saw is an error."""
    calls: list[list[tuple[int, int]]] = []
    for name, start, end in sorted(spans, key=lambda s: s[1]):
        if MARK_KERNEL in name:
            calls.append([])
        elif calls:  # anything before the first marker belongs to no timed call
            calls[-1].append((start, end))
    if any(not c for c in calls):
        raise RuntimeError("kernel_us: a timed call launched no device work that CUPTI recorded")
    return [_union_ns(c) / 1e3 for c in calls]


def _union_ns(intervals: list[tuple[int, int]]) -> int:
    total, reach = 0, None
    for start, end in sorted(intervals):
        if reach is None or start >= reach:
            total += end - start
            reach = end
        elif end > reach:
            total += end - reach
            reach = end
    return total


def kernel_times(fn: Callable[[], object], calls: int = 20) -> dict[str, tuple[int, float]]:
    """Device kernels CUPTI saw over ``calls`` calls of ``fn`` (after one warm-up call):
    name -> (launches, device microseconds per call of ``fn``), busiest first."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    found = {e.key: (e.count, e.device_time_total / calls) for e in prof.key_averages()
             if e.device_type.name == "CUDA"}
    return dict(sorted(found.items(), key=lambda kv: -kv[1][1]))
