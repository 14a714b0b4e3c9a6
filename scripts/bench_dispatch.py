"""Host cost of calling a Mojo op from PyTorch: ops/launch/bridge.py vs MAX's CustomOpLibrary.

For ops with 1, 3 and 6 input tensors (ops/kernels/dispatch.mojo, trivial
kernels on 1024 floats) it reports the median host microseconds per call,
the cost of each part of a bridge call (tensor conversion, execute, stream
sync, output allocation), and a torch.profiler (CUPTI) kernel list showing
which device kernels each path launches. Writes results/host.{csv,md} (table bench_dispatch).

    poe bench-dispatch            (needs a CUDA GPU)
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from ops.bench.dispatch import dispatch_op  # noqa: E402
from ops.bench.reports import commit, gpu_name, write_report  # noqa: E402
from ops.bench.timing import kernel_times  # noqa: E402
from ops.launch import bridge  # noqa: E402
from ops.launch.bridge import LIBRARY  # noqa: E402

CALLS = 2000
BLOCK = 20  # consecutive calls of one contender (see host_us)
N_ELEMS = 1024


def host_us(fns: dict[str, Callable[[], object]], calls: int = CALLS) -> dict[str, float]:
    """Median host time of each ``fns`` entry over ``calls`` calls (no sync in between).

    The entries take turns in blocks of BLOCK calls, so the host's drift (tens of us between
    runs on the H100 machine) hits them all alike; the first call of a block is not counted,
    because a call pays part of the cost of the call before it (about 10 us after a
    CustomOpLibrary call, measured), which would tax whichever entry follows that one.
    """
    for _ in range(50):
        for fn in fns.values():
            fn()
    torch.cuda.synchronize()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(-(-calls // BLOCK)):
        for name, fn in fns.items():
            fn()
            for _ in range(BLOCK):
                t0 = time.perf_counter()
                fn()
                times[name].append((time.perf_counter() - t0) * 1e6)
        torch.cuda.synchronize()  # keep the device queue short
    return {name: statistics.median(ts) for name, ts in times.items()}


def in_mode(mode: str, fn: Callable[[], object]) -> Callable[[], object]:
    """``fn`` called with the bridge in stream mode ``mode``."""
    def run() -> object:
        saved, bridge.STREAM_MODE = bridge.STREAM_MODE, mode
        try:
            return fn()
        finally:
            bridge.STREAM_MODE = saved
    return run


def measure_op(n: int, lib: object, dev: torch.device) -> tuple[dict, dict, dict[str, dict[str, tuple[int, float]]]]:
    """Check, then time, the n-input op through the bridge and through CustomOpLibrary."""
    from max.driver import Buffer

    xs = [torch.randn(N_ELEMS, device=dev) for _ in range(n)]
    expected = torch.stack(xs).sum(0)
    ours, ours_w = dispatch_op(n), dispatch_op(n, weights=True)
    theirs = getattr(lib, f"dispatch_{n}")
    out = torch.full((N_ELEMS,), float("nan"), device=dev)
    theirs(out, *xs)
    for name, got in [("bridge", ours(*xs)[0]), ("bridge+weights", ours_w(*xs)[0]),
                      ("bridge dlpack mode", in_mode("dlpack", lambda: ours(*xs))()[0]), ("CustomOpLibrary", out)]:
        if not torch.allclose(got, expected, rtol=1e-6, atol=1e-6):
            raise SystemExit(f"{name} dispatch_{n}: WRONG RESULT")
    row = {"inputs": n, **host_us({
        "bridge_us": lambda: ours(*xs),
        "bridge_weights_cached_us": lambda: ours_w(*xs),
        "bridge_dlpack_mode_us": in_mode("dlpack", lambda: ours(*xs)),
        "custom_op_library_us": lambda: theirs(out, *xs),
    })}
    model = bridge.load_model(ours, tuple(t.dtype for t in xs), dev)
    stream = bridge._raw_stream(dev)
    bufs = [bridge.to_buffer(t, stream) for t in [out, *xs]]
    sync = bridge.stream_sync(dev)
    part = {"inputs": n, **host_us({
        "bridge_events_mode_us": in_mode("events", lambda: ours(*xs)),
        "Buffer.from_dlpack_per_tensor_us": lambda: Buffer.from_dlpack(xs[0]),
        "to_buffer_with_stream_per_tensor_us": lambda: bridge.to_buffer(xs[0], stream),
        "to_buffer_own_queue_per_tensor_us": lambda: bridge.to_buffer(xs[0], sync.queue_handle),
        "current_stream_handle_us": lambda: bridge._raw_stream(dev),
        "model.execute_us": lambda: model.execute(*bufs),
        "model._execute_device_tensors_us": lambda: model._execute_device_tensors(bufs),
        "event_sync_before_us": sync.before,
        "event_sync_after_us": sync.after,
        "output_alloc_us": lambda: ours.allocate(xs),
        # What any bridge must do per call, as one step: a fresh MAX view of every tensor, then run.
        "convert_all_and_execute_us": lambda: model._execute_device_tensors(
            [bridge.to_buffer(t, sync.queue_handle) for t in [out, *xs]]),
    })}
    profiles = {}
    if n == 6:
        profiles["bridge"] = kernel_times(lambda: ours(*xs))
        profiles["CustomOpLibrary"] = kernel_times(lambda: theirs(out, *xs))
    return row, part, profiles


def main() -> int:
    if not torch.cuda.is_available():
        print("bench_dispatch needs a CUDA GPU")
        return 1
    from max.experimental.torch import CustomOpLibrary

    dev = torch.device("cuda")
    lib = CustomOpLibrary(LIBRARY)
    rows, parts, profiles = [], [], {}
    for n in (1, 3, 6):
        row, part, prof = measure_op(n, lib, dev)
        rows.append(row)
        parts.append(part)
        profiles.update(prof)
    write(rows, parts, profiles)
    return 0


def max_floor_us(part: dict) -> float:
    """Host us MAX itself needs per call: a stream-aware conversion per tensor plus the execute."""
    tensors = part["inputs"] + 1
    per_tensor = min(part["to_buffer_with_stream_per_tensor_us"], part["to_buffer_own_queue_per_tensor_us"])
    return tensors * per_tensor + part["model._execute_device_tensors_us"]


def write(rows: list[dict], parts: list[dict], profiles: dict[str, dict[str, tuple[int, float]]]) -> None:
    """The bench_dispatch table (results/host.{csv,md}): per op, its calls' host us and a bridge call's parts;
    the note says what MAX's own floor is and which kernels each path launched."""
    stamp = f"GPU: {gpu_name()}; float32, {N_ELEMS} elements; commit {commit()}; torch {torch.__version__}"
    lines = [f"Median host microseconds per call over {CALLS} calls (no synchronisation between calls); the "
             f"contenders of a table take turns in blocks of {BLOCK} calls. `bridge` is the default stream mode, "
             "\"auto\": on torch's default stream no join at all (CUDA orders it with MAX's blocking queue); "
             "\"dlpack\" mode is what a side stream of torch's costs (DLPack wait plus an event join). The "
             "other columns: the parts of one bridge call (median host us).", "",
             "MAX's own floor per call, before any work of ours: a fresh view of every tensor (the inputs "
             "and the one output) by its cheapest conversion, then `_execute_device_tensors`; as the sum of "
             "those parts, and measured as one step (`convert_all_and_execute_us`):", ""]
    lines += [f"- {p['inputs']} inputs: {max_floor_us(p):.1f} us summed, "
              f"{p['convert_all_and_execute_us']:.1f} us as one step" for p in parts]
    for name, kernels in profiles.items():
        lines += ["", f"Device kernels over 20 calls of the 6-input op, {name} (torch.profiler / CUPTI):", ""]
        lines += [f"- {count} x `{kname[:100]}`" for kname, (count, _) in kernels.items()]
    merged = [{**r, **{k: round(v, 2) for k, v in p.items() if k != "inputs"}}
              for r, p in zip(rows, parts, strict=True)]
    fields = [*rows[0], *list(parts[0])[1:]]
    write_report("bench_dispatch", merged, fields, stamp, "Host cost per call (scripts/bench_dispatch.py)",
                 "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
