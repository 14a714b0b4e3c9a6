"""The one bridge between PyTorch tensors and Mojo custom ops compiled by MAX.

Every op in ``ops/`` and every puzzle runner goes through this module. It:

* precompiles a Mojo source package once per *content* digest (``packages.py``: an edited ``.mojo`` file gives a
  new digest, so stale packages are never loaded);
* builds a MAX graph with symbolic dimensions once per (package digest, graph name, parameters, input dtypes/ranks,
  device), so a new shape never recompiles; processes sharing the cache build each package and graph once between
  them (``cache.built_once``: a lock per build);
* executes it on torch tensors with stream ordering against torch's current
  CUDA stream, and returns torch tensors that alias MAX's outputs (no copy).

Host cost is kept low by converting inputs with MAX's stream-aware DLPack
entry point, by caching the MAX view of tensors the caller marks as
weights (keyed on storage pointer, version counter and layout), and by
making no stream join at all where CUDA itself orders torch's stream with
MAX's queue (torch's legacy default stream against MAX's blocking queue:
4-12 us less host time per call on the H100, device time unchanged;
results/host.md (table bench_dispatch)).
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cache, cached_property
from pathlib import Path
from typing import Any

import torch

from ops.launch.cache import built_once
from ops.launch.packages import compile_package, forget_digests, package_digest

ROOT = Path(__file__).resolve().parents[2]
LIBRARY = ROOT / "ops" / "kernels"

@dataclass(frozen=True)
class Out:
    """One output of a graph: symbolic dims and where its dtype comes from.

    ``dims`` are names shared with the inputs' dims (``"rows"``, ``"k"``) or
    ints. ``dtype`` is either the index of an input whose dtype it copies or a
    fixed ``torch.dtype``.
    """

    dims: tuple[str | int, ...]
    dtype: int | torch.dtype = 0


@dataclass(frozen=True)
class GraphOp:
    """One registered Mojo op called in destination-passing style.

    Outputs are allocated by torch (so they live in torch's caching allocator
    and can be poisoned before a run) and handed to the op as mutable
    buffers, followed by the inputs. The graph is compiled once per input
    dtypes and device; every dim is symbolic, so shapes never recompile.

    Args:
        name: the name given to ``@extensibility.register`` in the package.
        package: Mojo source directory holding the op.
        inputs: symbolic dims of each input tensor, e.g. ``(("rows", "k"), ("k",))``.
        outputs: the outputs' dims and dtypes.
        parameters: compile-time parameters of the op (part of the cache key).
        weights: indices of inputs that usually repeat across calls (their MAX
            views are cached while the tensor is unchanged).
    """

    name: str
    package: Path
    inputs: tuple[tuple[str | int, ...], ...]
    outputs: tuple[Out, ...]
    parameters: tuple[tuple[str, Any], ...] = ()
    weights: frozenset[int] = field(default_factory=frozenset)
    # Per-op memo of load_model: (generation, dtypes, device) -> model. Skips
    # hashing the whole op on the hot path; clear_caches() bumps the generation.
    _memo: dict = field(default_factory=dict, init=False, repr=False, compare=False, hash=False)

    def __call__(self, *tensors: torch.Tensor, sizes: dict[str, int] | None = None) -> list[torch.Tensor]:
        """Run the op on ``tensors`` (already validated); returns new torch outputs.

        ``sizes`` gives output dims that no input carries (e.g. a scratch
        buffer's length); they stay symbolic in the graph, so no recompile.
        """
        outs = self.allocate(tensors, sizes)
        key = (_generation, tensors[0].get_device(), *[t.dtype for t in tensors])
        model = self._memo.get(key)
        if model is None:
            model = self._memo[key] = load_model(self, tuple(t.dtype for t in tensors), tensors[0].device)
        execute(model, outs, tensors, self.weights)
        return outs

    @cached_property
    def _out_plan(self) -> tuple[tuple[tuple, int | torch.dtype], ...]:
        """Per output: its dims as (input index, axis) where an input carries the name, else the
        int or the name of an extra size; and its dtype source. Made once, so a call only indexes."""
        where: dict[str, tuple[int, int]] = {}
        for i, dims in enumerate(self.inputs):
            for axis, d in enumerate(dims):
                if isinstance(d, str):
                    where.setdefault(d, (i, axis))
        return tuple((tuple(where.get(d, d) if isinstance(d, str) else d for d in out.dims), out.dtype)
                     for out in self.outputs)

    def allocate(self, tensors: Sequence[torch.Tensor], extra: dict[str, int] | None = None) -> list[torch.Tensor]:
        """Output tensors for these inputs: empty, or NaN-poisoned in poison mode."""
        if len(tensors) != len(self.inputs):
            raise ValueError(f"tensors: {self.name} takes {len(self.inputs)} inputs, got {len(tensors)}")
        device = tensors[0].device
        outs = []
        for dims, dtype in self._out_plan:
            shape = [d if isinstance(d, int) else
                     tensors[d[0]].shape[d[1]] if isinstance(d, tuple) else (extra or {})[d] for d in dims]
            outs.append(output(shape, tensors[dtype].dtype if isinstance(dtype, int) else dtype, device))
        return outs


# Tests and the puzzle checker turn this on: every output starts as NaN, so an
# element a kernel forgot to write can never pass a comparison.
poison_outputs = os.environ.get("OPS_POISON", "") == "1"


def output(shape: Sequence[int], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """An output tensor for a kernel to write: empty, or NaN-poisoned in poison mode."""
    t = torch.empty(shape, dtype=dtype, device=device)
    return t.fill_(float("nan")) if poison_outputs else t


# ---------------------------------------------------------------- sessions and models

def device_kind(device: torch.device) -> str:
    """``"gpu"`` for CUDA tensors, ``"cpu"`` for CPU tensors."""
    if device.type == "cuda":
        return "gpu"
    if device.type == "cpu":
        return "cpu"
    raise ValueError(f"device: {device} is not supported (use cpu or cuda)")


@cache
def _session(kind: str, index: int) -> Any:
    first_import = "max._mlir_context" not in sys.modules
    from max.driver import CPU, Accelerator
    from max.engine import InferenceSession

    if first_import and threading.current_thread() is not threading.main_thread():
        _balance_max_context_at_exit()
    return InferenceSession(devices=[Accelerator(index) if kind == "gpu" else CPU()])


def _balance_max_context_at_exit() -> None:
    """For MAX first imported off the main thread (a server's worker calling us first). ``max.engine``'s import
    enters MAX's default MLIR context in the importing thread, and MAX exits it from the main thread at interpreter
    exit, where nothing was entered: "Unbalanced Context enter/exit" is printed. The main thread enters it once
    at exit, just before MAX's own handler (atexit runs the later registration first)."""
    try:
        from max._mlir_context import default_mlir_context
    except ImportError:   # another MAX: nothing to balance
        return
    atexit.register(default_mlir_context().__enter__)


@cache
def _max_device(kind: str, index: int) -> Any:
    from max.driver import CPU, Accelerator

    return Accelerator(index) if kind == "gpu" else CPU()


def _device_ref(kind: str, index: int) -> Any:
    from max.graph import DeviceRef

    return DeviceRef.GPU(index) if kind == "gpu" else DeviceRef.CPU()


MODELS_MAX = 512   # compiled models kept (each is a graph of one op; ever new eps must not grow them without end)
_models: dict[tuple, Any] = {}
models_lock = threading.Lock()   # held while this process compiles or loads a model
compile_count = 0   # graphs compiled or loaded by this process (tests check reuse)
_generation = 0  # bumped by clear_caches(): invalidates every GraphOp memo


def _dtype(dtype: torch.dtype) -> Any:
    from max.experimental.torch import torch_dtype_to_max

    return torch_dtype_to_max(dtype)


def build_graph(op: GraphOp, dtypes: Sequence[torch.dtype], kind: str, index: int) -> Any:
    """Build (not compile) the MAX graph of ``op`` for these input dtypes.

    Graph inputs are the outputs (as mutable buffers) followed by the inputs;
    the graph is one in-place custom op call and returns nothing.
    """
    return build_multi_graph(op.name, [(op, dtypes)], kind, index)


def build_multi_graph(name: str, calls: Sequence[tuple[GraphOp, Sequence[torch.dtype]]], kind: str,
                      index: int, module: Any = None) -> Any:
    """One graph calling each (op, input dtypes) of ``calls`` once, all from one package.

    Compiling a graph costs mostly a fixed overhead, so checking many ops in
    one graph is several times cheaper than one graph each. Dims are
    namespaced per call when there are several. With ``module`` (a
    ``max.graph.Module``) the graph is added to it (``ops/launch/together.py``).
    """
    from max.graph import BufferType, Graph, TensorType, ops

    packages = {op.package for op, _ in calls}
    if len(packages) != 1:
        raise ValueError(f"calls: ops come from {len(packages)} packages; a graph takes one")
    dev = _device_ref(kind, index)
    types, spans = [], []
    for i, (op, dtypes) in enumerate(calls):
        def dims(ds: tuple, i: int = i) -> list:
            return [f"c{i}_{d}" if isinstance(d, str) and len(calls) > 1 else d for d in ds]
        for out in op.outputs:
            dtype = dtypes[out.dtype] if isinstance(out.dtype, int) else out.dtype
            types.append(BufferType(_dtype(dtype), dims(out.dims), dev))
        types += [TensorType(_dtype(dt), dims(ds), dev) for dt, ds in zip(dtypes, op.inputs, strict=True)]
        spans.append((len(op.outputs), len(op.inputs)))
    extra = {} if module is None else {"module": module}
    with Graph(name, input_types=types, custom_extensions=[compile_package(packages.pop())], **extra) as graph:
        at = 0
        for (op, _), (n_out, n_in) in zip(calls, spans, strict=True):
            values = [v.buffer for v in graph.inputs[at:at + n_out]]
            values += [v.tensor for v in graph.inputs[at + n_out:at + n_out + n_in]]
            ops.inplace_custom(op.name, dev, values, parameters=dict(op.parameters) or None)
            at += n_out + n_in
        graph.output()
    return graph


def _where(device: torch.device) -> tuple[str, int]:
    kind = device_kind(device)
    return kind, (device.index or 0) if kind == "gpu" else 0


def _model_key(op: GraphOp, dtypes: tuple[torch.dtype, ...], kind: str, index: int) -> tuple:
    return (package_digest(op.package), op.name, op.parameters, dtypes, kind, index)


def model_key(op: GraphOp, dtypes: tuple[torch.dtype, ...], device: torch.device) -> tuple:
    """What names ``op``'s compiled model for these input dtypes on ``device``: its package's content digest,
    the op, its parameters, the dtypes and the device."""
    return _model_key(op, dtypes, *_where(device))


def loaded(key: tuple) -> bool:
    """Whether this process holds the model ``key`` names."""
    return key in _models


def keep(key: tuple, model: Any) -> None:
    """Hold ``model`` as the one ``key`` names (``ops/launch/together.py`` compiles them several at a time)."""
    global compile_count
    _remember_model(key, model)
    compile_count += 1


def _remember_model(key: tuple, model: Any) -> None:
    """Keep ``model`` under ``key``; past ``MODELS_MAX``, the oldest let go (MAX's cache reloads it if needed)."""
    _models[key] = model
    if len(_models) > MODELS_MAX:
        _models.pop(next(iter(_models)))


def session(device: torch.device) -> Any:
    """MAX's inference session for ``device`` (one per device and process)."""
    return _session(*_where(device))


def load_model(op: GraphOp, dtypes: tuple[torch.dtype, ...], device: torch.device) -> Any:
    """Compiled model for ``op`` on ``device``; compiled on first use only."""
    global compile_count
    kind, index = _where(device)
    key = _model_key(op, dtypes, kind, index)
    model = _models.get(key)
    if model is not None:
        return model
    with models_lock:
        model = _models.get(key)
        if model is None:
            with built_once(f"graph {key}"):
                model = _session(kind, index).load(build_graph(op, dtypes, kind, index))
            _remember_model(key, model)
            compile_count += 1
        return model


# ---------------------------------------------------------------- execution

def _tensor_key(t: torch.Tensor) -> tuple:
    """What must match for a cached value derived from ``t`` to still hold: storage pointer,
    version counter (bumped by every in-place write), shape, strides, dtype, device index
    (-1 on the CPU; cheaper than building a torch.device)."""
    return (t.data_ptr(), t._version, t.shape, t.stride(), t.dtype, t.get_device())


class DerivedCache:
    """Values computed from tensors that repeat across calls (weights), bounded LRU.

    A hit needs every source's ``_tensor_key`` and the very same tensor objects
    (checked through weak references), so a freed-and-reused address or an
    in-place write never returns a stale value.
    """

    def __init__(self, capacity: int = 64) -> None:
        self.capacity = capacity
        # slot (the source's id, or the tuple of the sources' ids) -> (weak refs, their keys, value):
        # a cheap lookup, then the full keys and the objects' identity decide whether it is a hit
        self._entries: OrderedDict[int | tuple[int, ...], tuple[tuple[weakref.ref, ...], tuple, Any]] = OrderedDict()

    def get(self, sources: tuple[torch.Tensor, ...], compute: Callable[..., Any]) -> Any:
        """``compute(*sources)``, or its cached value while the sources are unchanged."""
        slot = tuple([id(t) for t in sources])
        keys = tuple([_tensor_key(t) for t in sources])
        hit = self._entries.get(slot)
        if hit is not None and hit[1] == keys and all([ref() is t for ref, t in zip(hit[0], sources, strict=True)]):
            self._entries.move_to_end(slot)
            return hit[2]
        return self._store(slot, sources, keys, compute(*sources))

    def get1(self, t: torch.Tensor, compute: Callable[..., Any], *args: Any) -> Any:
        """``compute(t, *args)``, or its cached value while ``t`` is the same unchanged tensor: ``get``
        for one source without the tuples, the per-call hot path."""
        key = _tensor_key(t)
        hit = self._entries.get(id(t))
        if hit is not None and hit[1] == key and hit[0][0]() is t:
            self._entries.move_to_end(id(t))
            return hit[2]
        return self._store(id(t), (t,), key, compute(t, *args))

    def _store(self, slot: int | tuple[int, ...], sources: tuple[torch.Tensor, ...], keys: tuple, value: Any) -> Any:
        """Keep ``value`` for ``slot`` (replacing what the slot held: stale entries never pile up)."""
        self._entries[slot] = (tuple(weakref.ref(t) for t in sources), keys, value)
        self._entries.move_to_end(slot)
        if len(self._entries) > self.capacity:
            self._entries.popitem(last=False)
        return value

    def clear(self) -> None:
        self._entries.clear()


weight_cache = DerivedCache()  # MAX views of weight tensors


# How MAX's queue is ordered with torch's current stream:
#   "dlpack": each input's DLPack view carries torch's stream and MAX waits on it;
#   "events": one torch event recorded and waited on explicitly per call;
# and in both, torch's stream waits for MAX's queue (an event) after every call.
#   "auto" (default): no join at all where CUDA orders the two streams itself
#     (``_StreamSync.implicit``), else as "dlpack".
STREAM_MODE = os.environ.get("OPS_STREAM_MODE", "auto")


def to_buffer(t: torch.Tensor, stream: int | None = None) -> Any:
    """Zero-copy MAX view of ``t``; on CUDA with ``stream``, MAX's queue waits on that stream."""
    from max.driver import Buffer

    if t.requires_grad:  # DLPack refuses autograd leaves; the kernel never records history anyway
        t = t.detach()
    if stream is None:
        return Buffer.from_dlpack(t)
    capsule = torch.utils.dlpack.to_dlpack(t)
    return Buffer._from_dlpack(capsule, _max_device("gpu", t.device.index or 0), stream)


# torch's private getter returns the current stream's handle without building a
# torch.cuda.Stream object (which costs about 8 us of host time per call).
_current_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _raw_stream(device: torch.device) -> int:
    """Handle of torch's current CUDA stream on ``device``."""
    if _current_raw_stream is None:
        return torch.cuda.current_stream(device).cuda_stream
    return _current_raw_stream(device.index or 0)


def execute(model: Any, outs: Sequence[torch.Tensor], tensors: Sequence[torch.Tensor],
            weights: frozenset[int] = frozenset()) -> None:
    """Run ``model`` writing into ``outs``, ordered with torch's current stream.

    On CUDA, MAX's queue first waits for torch's current stream (so kernels
    see data torch is still writing) and torch's stream then waits for MAX's
    queue (so torch ops that read the outputs, or reuse freed inputs' memory,
    come after the kernels).
    """
    device = outs[0].device
    if device.type != "cuda":
        _execute(model, outs, tensors, weights, None)
        return
    sync = stream_sync(device)
    stream = None if STREAM_MODE == "events" else _raw_stream(device)
    if STREAM_MODE == "auto" and sync.implicit(stream):
        # The views name MAX's own queue, so MAX waits on nothing, and no event is needed after.
        _execute(model, outs, tensors, weights, sync.queue_handle)
        return
    if stream is None:
        sync.before()
    _execute(model, outs, tensors, weights, stream)
    sync.after(stream)


def _execute(model: Any, outs: Sequence[torch.Tensor], tensors: Sequence[torch.Tensor], weights: frozenset[int],
             stream: int | None) -> None:
    """Convert every tensor (views carrying ``stream``, cached for weights) and run ``model`` on them."""
    bufs = [to_buffer(t, stream) for t in outs]
    # A cached weight view was ordered when it was made; the other inputs
    # carry this call's stream, so MAX still waits for torch's latest work.
    bufs += [weight_cache.get1(t, to_buffer, stream) if i in weights else to_buffer(t, stream)
             for i, t in enumerate(tensors)]
    # Every buffer is a contiguous MAX Buffer already (inputs are validated), so skip
    # Model.execute's per-argument conversion and checks (~5-9 us on the H100).
    model._execute_device_tensors(bufs)


class _StreamSync:
    """Two reusable CUDA events joining torch's current stream and MAX's queue."""

    def __init__(self, device: torch.device) -> None:
        queue = _max_device("gpu", device.index or 0).default_queue
        self.queue_handle = queue.native_stream_handle
        self.max_stream = torch.cuda.ExternalStream(self.queue_handle, device=device)
        # torch's legacy default stream (handle 0) and a blocking stream of the same context are
        # ordered by CUDA itself: each waits for the other's earlier work.
        self.legacy_ordered = _blocking_in_primary_context(self.queue_handle, device.index or 0)
        self.device = device
        self.into_max = torch.cuda.Event()
        self.out_of_max = torch.cuda.Event()
        self._streams: dict[int, torch.cuda.Stream] = {}  # raw handle -> torch's object for it

    def current(self, raw: int | None = None) -> torch.cuda.Stream:
        """torch's current stream, its object built once per stream handle (not per call)."""
        raw = _raw_stream(self.device) if raw is None else raw
        stream = self._streams.get(raw)
        if stream is None:
            if len(self._streams) >= 64:
                self._streams.clear()
            stream = self._streams[raw] = torch.cuda.current_stream(self.device)
        return stream

    def implicit(self, raw: int) -> bool:
        """Whether CUDA orders torch's stream ``raw`` with MAX's queue without any join: it is
        MAX's queue, or it is the legacy default stream and MAX's queue blocks on it."""
        return raw == self.queue_handle or (raw == 0 and self.legacy_ordered)

    def before(self) -> None:
        self.into_max.record(self.current())
        self.max_stream.wait_event(self.into_max)

    def after(self, raw: int | None = None) -> None:
        """torch's current stream (``raw``: its handle, when the caller has it) waits for MAX's queue."""
        self.out_of_max.record(self.max_stream)
        self.current(raw).wait_event(self.out_of_max)


@cache
def stream_sync(device: torch.device) -> _StreamSync:
    return _StreamSync(device)


def _blocking_in_primary_context(handle: int, index: int) -> bool:
    """Whether the CUDA stream ``handle`` is a blocking stream (flags 0, so the legacy default
    stream synchronises with it) of device ``index``'s primary context (the one torch uses).
    False whenever the driver cannot say."""
    import ctypes

    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    flags, ctx, primary, dev = ctypes.c_uint(), ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_int()
    stream = ctypes.c_void_p(handle)
    if (cuda.cuStreamGetFlags(stream, ctypes.byref(flags)) or cuda.cuStreamGetCtx(stream, ctypes.byref(ctx))
            or cuda.cuDeviceGet(ctypes.byref(dev), index)
            or cuda.cuDevicePrimaryCtxRetain(ctypes.byref(primary), dev)):
        return False
    cuda.cuDevicePrimaryCtxRelease(dev)
    return flags.value == 0 and ctx.value == primary.value


def clear_caches() -> None:
    """Forget compiled models and cached weight views (tests use this)."""
    global _generation
    _generation += 1
    with models_lock:
        _models.clear()
    forget_digests()
    weight_cache.clear()
