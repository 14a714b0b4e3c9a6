"""Host cost of calling a Mojo op from PyTorch: ops/bridge.py vs MAX's CustomOpLibrary.

For ops with 1, 3 and 6 input tensors (ops/kernels/dispatch.mojo, trivial
kernels on 1024 floats) it reports the median host microseconds per call,
the cost of each part of a bridge call (tensor conversion, execute, stream
sync, output allocation), and a torch.profiler (CUPTI) kernel list showing
which device kernels each path launches. Writes results/bench_dispatch.{md,csv}.

    poe bench-dispatch            (needs a CUDA GPU)
"""

from __future__ import annotations

import csv
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from ops import bridge  # noqa: E402
from ops.bridge import LIBRARY  # noqa: E402
from ops.dispatch import dispatch_op  # noqa: E402
from ops.timing import commit, gpu_name, kernel_times  # noqa: E402

CALLS = 2000
N_ELEMS = 1024
OUT = ROOT / "results"


def host_us(fn, calls: int = CALLS) -> float:
    """Median host time of ``fn()`` over ``calls`` calls (no sync in between)."""
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times)


def measure_op(n: int, lib: object, dev: torch.device) -> tuple[dict, dict, dict[str, dict[str, tuple[int, float]]]]:
    """Check, then time, the n-input op through the bridge and through CustomOpLibrary."""
    from max.driver import Buffer

    xs = [torch.randn(N_ELEMS, device=dev) for _ in range(n)]
    expected = torch.stack(xs).sum(0)
    ours, ours_w = dispatch_op(n), dispatch_op(n, weights=True)
    theirs = getattr(lib, f"dispatch_{n}")
    out = torch.full((N_ELEMS,), float("nan"), device=dev)
    theirs(out, *xs)
    for name, got in [("bridge", ours(*xs)[0]), ("bridge+weights", ours_w(*xs)[0]), ("CustomOpLibrary", out)]:
        if not torch.allclose(got, expected, rtol=1e-6, atol=1e-6):
            raise SystemExit(f"{name} dispatch_{n}: WRONG RESULT")
    row = {
        "inputs": n,
        "bridge_us": host_us(lambda: ours(*xs)),
        "bridge_weights_cached_us": host_us(lambda: ours_w(*xs)),
        "custom_op_library_us": host_us(lambda: theirs(out, *xs)),
    }
    model = bridge.load_model(ours, tuple(t.dtype for t in xs), dev)
    stream = bridge._raw_stream(dev)
    bufs = [bridge.to_buffer(t, stream) for t in [out, *xs]]
    sync = bridge._stream_sync(dev)
    saved = bridge.STREAM_MODE
    bridge.STREAM_MODE = "events"
    events_us = host_us(lambda: ours(*xs))
    bridge.STREAM_MODE = saved
    part = {
        "inputs": n,
        "bridge_events_mode_us": events_us,
        "Buffer.from_dlpack_per_tensor_us": host_us(lambda: Buffer.from_dlpack(xs[0])),
        "to_buffer_with_stream_per_tensor_us": host_us(lambda: bridge.to_buffer(xs[0], stream)),
        "current_stream_handle_us": host_us(lambda: bridge._raw_stream(dev)),
        "model.execute_us": host_us(lambda: model.execute(*bufs)),
        "model._execute_device_tensors_us": host_us(lambda: model._execute_device_tensors(bufs)),
        "event_sync_before_us": host_us(sync.before),
        "event_sync_after_us": host_us(sync.after),
        "output_alloc_us": host_us(lambda: ours.allocate(xs)),
    }
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
    return tensors * part["to_buffer_with_stream_per_tensor_us"] + part["model._execute_device_tensors_us"]


def write(rows: list[dict], parts: list[dict], profiles: dict[str, dict[str, tuple[int, float]]]) -> None:
    OUT.mkdir(exist_ok=True)
    stamp = f"GPU: {gpu_name()}, float32, {N_ELEMS} elements, commit {commit()}, torch {torch.__version__}"
    with open(OUT / "bench_dispatch.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=[*rows[0], *list(parts[0])[1:]])
        w.writeheader()
        for r, p in zip(rows, parts, strict=True):
            w.writerow({**r, **p})
    lines = [f"# Host cost per call (scripts/bench_dispatch.py)\n\n{stamp}\n",
             "Median host microseconds per call over 2000 calls (no synchronisation between calls).\n",
             "| inputs | bridge | bridge, weights cached | CustomOpLibrary |", "|---|---|---|---|"]
    lines += [f"| {r['inputs']} | {r['bridge_us']:.1f} | {r['bridge_weights_cached_us']:.1f} | "
              f"{r['custom_op_library_us']:.1f} |" for r in rows]
    keys = list(parts[0])[1:]
    lines += ["\nParts of one bridge call (median host us):\n",
              "| inputs | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
    lines += ["| " + " | ".join([str(p["inputs"])] + [f"{p[k]:.1f}" for k in keys]) + " |" for p in parts]
    lines += ["\nMAX's own floor per call: its cheapest conversion of every tensor (the inputs and the one "
              "output) plus `_execute_device_tensors`, before any work of ours (from the parts above):\n"]
    lines += [f"- {p['inputs']} inputs: {max_floor_us(p):.1f} us" for p in parts]
    for name, kernels in profiles.items():
        lines += [f"\nDevice kernels over 20 calls of the 6-input op, {name} (torch.profiler / CUPTI):\n"]
        lines += [f"- {count} x `{kname[:100]}`" for kname, (count, _) in kernels.items()]
    text = "\n".join(lines) + "\n"
    (OUT / "bench_dispatch.md").write_text(text)
    print(text)


if __name__ == "__main__":
    sys.exit(main())
