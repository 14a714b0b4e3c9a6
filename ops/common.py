"""Helpers every op shares above the launch layer: output buffers, the C++ entries' lookup, autograd's
create_graph case, constants standing in for absent parameters, and the modules' parameter reads."""

from __future__ import annotations

import sys
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import NoReturn, TypeVar

import torch
from torch import nn

from ops.inputs import PLAIN_TENSORS, check_tensor
from ops.launch import bridge, direct


def empty(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An output buffer: uninitialised, or NaN in poison mode (tests: an unwritten element never passes)."""
    t = torch.empty(shape, dtype=dtype, device=device)
    return t.fill_(float("nan")) if bridge.poison_outputs else t


def native_entry(name: str) -> Callable | None:
    """The C++ entry ``name`` (``direct.NATIVE``) for an eager call to try first; None while torch.compile or
    torch.export traces (is_compiling first: dynamo must not read, and guard on, a builtin it cannot guard; the
    ops' fakes stand in) or ``torch.jit.trace`` records: a trace must record the same ops at every call, and the
    C++ entries decline a shape's first call (``torch_answers`` picks torch's ops then)."""
    if torch.compiler.is_compiling() or torch._C._is_tracing():
        return None
    return getattr(direct.NATIVE, name)


def no_grad_to_come(*tensors: object) -> bool:
    """Whether no gradient will be taken through a call on ``tensors`` (grad mode off, or none requires one)."""
    return not (torch.is_grad_enabled() and any(getattr(t, "requires_grad", False) for t in tensors))


def create_graph() -> bool:
    """Whether a backward runs under ``create_graph=True`` (a double backward, a gradient penalty): grad mode is
    on in it. Not under torch.compile, whose AOTAutograd traces the backward itself."""
    return torch.is_grad_enabled() and not torch.compiler.is_compiling()


def differentiable_grads(ctx: torch.autograd.function.FunctionCtx, y: torch.Tensor,
                         inputs: tuple[torch.Tensor, ...], dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    """A backward under ``create_graph``: the gradients of y (recomputed from the saved inputs by torch's
    differentiable ops) for the inputs that want one (``ctx.needs_input_grad``, from the first), so that they
    carry their own graph as torch's LayerNorm's do; our kernels' could not (ops/launch/direct.cpp does the same)."""
    wants = ctx.needs_input_grad[:len(inputs)]
    if not any(wants):
        return (None,) * len(inputs)
    grads = iter(torch.autograd.grad(y, [t for t, w in zip(inputs, wants, strict=True) if w], dy, create_graph=True,
                                     allow_unused=True))
    return tuple(next(grads) if w else None for w in wants)


CONSTANTS_MAX = 64   # tensors kept per table below (a model has a few widths; one that sees ever new ones must not
                     # grow them without end)
_constants: OrderedDict[tuple, torch.Tensor] = OrderedDict()


def kept(table: OrderedDict, key: tuple, make: Callable[[], torch.Tensor]) -> torch.Tensor:
    """``table[key]``, made by ``make`` when missing; the ``CONSTANTS_MAX`` most recently used kept. For tensors
    that depend on no tensor's values (so they cannot go stale), never written."""
    t = table.get(key)
    if t is None:
        t = table[key] = make()
        if len(table) > CONSTANTS_MAX:
            table.popitem(last=False)
    else:
        table.move_to_end(key)
    return t


def constant(value: float, h: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A [h] tensor of ``value`` that stands in for an absent weight or bias (``kept``)."""
    return kept(_constants, (value, h, dtype, device), lambda: torch.full((h,), value, dtype=dtype, device=device))


# the modules whose parameters weight_and_bias reads straight from _parameters (ours add themselves)
_PLAIN_MODULES: set[type] = {nn.LayerNorm, nn.Linear}


def plain_module(cls: type) -> type:
    """A class decorator: ``weight_and_bias`` reads ``cls``'s parameters straight from ``_parameters``."""
    _PLAIN_MODULES.add(cls)
    return cls


def weight_and_bias(module: nn.Module) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``module.weight`` and ``module.bias``, for the modules' forwards: read from ``_parameters`` (about a
    microsecond less per call than ``nn.Module.__getattr__``) where that is where they live (an ``nn.LayerNorm``,
    ``nn.Linear`` or our ``LayerNorm``, not a subclass, that holds both names there and not in its ``__dict__``);
    anything else (a parametrized or weight-normed module, a subclass, tracing) through ``getattr``."""
    params = module._parameters
    if (type(module) in _PLAIN_MODULES and "weight" in params and "bias" in params
            and "weight" not in module.__dict__ and "bias" not in module.__dict__
            and not torch.compiler.is_compiling()):
        return params["weight"], params["bias"]
    return module.weight, module.bias


def share_affine(dst: nn.LayerNorm, src: nn.LayerNorm) -> None:
    """``dst`` takes ``src``'s weight and bias themselves: parameters as parameters, buffers (a LayerNorm frozen into
    constants) as buffers, absent ones absent."""
    for name in ("weight", "bias"):
        p = getattr(src, name)
        if p is None or isinstance(p, nn.Parameter):
            setattr(dst, name, p)
        else:
            delattr(dst, name)
            dst.register_buffer(name, p)


def not_scriptable(module: nn.Module) -> NoReturn:
    """What ``torch.jit.script`` meets first in our modules (their ``__prepare_scriptable__``): a named error.
    Their forwards run Python that TorchScript cannot compile (autograd functions, the choice of route); torch
    deprecates TorchScript for ``torch.export``, which takes them, as ``torch.jit.trace`` does."""
    raise TypeError(f"torch.jit.script: {type(module).__name__} cannot be scripted (TorchScript compiles no Python "
                    "calls); use torch.export or torch.jit.trace")


def add_residual(x: object, residual: object, add_bias: object, residual_in_fp32: bool) -> torch.Tensor:
    """A pre-norm block's residual stream, s = x (+ add_bias) + residual, as the add-and-norm entries take it
    (``check_residual``); with ``residual_in_fp32``, s in float32 (x and residual widened first), else in x's dtype
    (torch's add: one rounding).

    Raises:
        TypeError, ValueError: the named error for residual or add_bias (x's own checks are the norm's).
    """
    check_residual(x, residual, add_bias)
    if residual_in_fp32:
        x, residual = x.float(), residual.float()
        add_bias = None if add_bias is None else add_bias.float()
    s = x if add_bias is None else x + add_bias
    return s + residual


def check_residual(x: object, residual: object, add_bias: object) -> None:
    """The add-and-norm entries' checks of their add: x and residual tensors of one shape and device, add_bias None
    or [x's last dim] on that device; the named error otherwise."""
    check_tensor("x", x, min_ndim=1, layout=False, dtypes=None)
    check_tensor("residual", residual, min_ndim=1, layout=False, dtypes=None)
    if residual.shape != x.shape or residual.device != x.device:
        raise ValueError(f"residual: shape {tuple(residual.shape)} on {residual.device} does not match x's "
                         f"{tuple(x.shape)} on {x.device}")
    if add_bias is not None:
        check_tensor("add_bias", add_bias, ndim=1, layout=False, dtypes=None)
        if add_bias.shape[0] != x.shape[-1] or add_bias.device != x.device:
            raise ValueError(f"add_bias: shape {tuple(add_bias.shape)} on {add_bias.device}, expected "
                             f"({x.shape[-1]},) on {x.device}")


def native_takes_add(x: object, residual: object, add_bias: object, weight: object, bias: object,
                     eps: object) -> bool:
    """Whether an add-and-norm call's arguments fit the C++ entry's schema (``add_norm``): plain tensors, x of at
    least one dim (its last is read before the checks), or None for add_bias, weight and bias, and a float eps. The
    entry checks the rest (shapes, dtypes, layouts, devices)."""
    return (x.__class__ in PLAIN_TENSORS and residual.__class__ in PLAIN_TENSORS and eps.__class__ is float
            and x.ndim >= 1 and all(t is None or t.__class__ in PLAIN_TENSORS for t in (add_bias, weight, bias)))


Entry = TypeVar("Entry")


def loaded_class_entry(obj: object, table: Mapping[tuple[str, str], Entry]) -> Entry | None:
    """The entry of ``table`` (keyed by a class's (module, name)) whose class ``obj`` is an instance of, among the
    classes whose module is loaded (a class of a library never imported here, such as transformers'); None if none."""
    for (module, name), entry in table.items():
        cls = getattr(sys.modules.get(module), name, None)
        if cls is not None and isinstance(obj, cls):
            return entry
    return None
