"""LayerNorm (optionally followed by GELU) over the last dim, forward and backward, from Mojo.

Shapes: x [..., H] with H >= 1; weight (gamma) and bias (beta) [H], the same
dtype as x (float32, float16 or bfloat16); mean and rstd [...] float32.
Kernels: ``ops/kernels/layernorm.mojo`` (registered ``layernorm_fwd`` and
``layernorm_bwd``). Layers of API, lowest first:

* ``layernorm_fwd`` / ``layernorm_bwd``: validated calls of the two ops;
* ``torch.ops.mojo.layernorm_fwd`` / ``layernorm_bwd``: the same as
  ``torch.library`` custom ops with fake implementations (torch.compile);
* ``layernorm`` (``LayerNormFunction``): autograd;
* ``LayerNorm``: an ``nn.Module`` that loads an ``nn.LayerNorm`` state dict.
"""

from __future__ import annotations

import os
import struct
from functools import cache

import torch
from torch import nn

from ops.bridge import LIBRARY, GraphOp, Out
from ops.validate import check_same, check_size, check_tensor

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# The forward kernel progression (ops/kernels/layernorm.mojo's header says what each changes).
VARIANTS = {"row_thread": 1, "block_smem": 2, "block_warp": 3, "vector": 4, "fast": 5}
FORCE_CONFIG = 100  # layernorm.mojo's V_FORCE
# "gelu" is the erf form (torch's default), "gelu_tanh" the tanh approximation.
ACTIVATIONS = {"none": 0, "gelu_tanh": 1, "gelu": 2}

# Backward: rows are dealt to `parts` row groups whose dgamma/dbeta partials
# ([parts, H] float32 each) a second kernel reduces. Parts come as a whole
# number of groups per SM (a fractional wave leaves SMs idle at the end).
# Short rows want more groups per SM to keep loads in flight, until the
# registers of their kernel config cap residency; each group wants ~8 rows so
# its partials stay small next to what it reads. An H100 sweep of 11 shapes in
# fp32 and bf16 (session 15) put the best count at 16 KB of row bytes per SM,
# the row's bytes rounded up to a power of two, at most 12 groups per SM.
BWD_ROW_BYTES_PER_SM = 16384
BWD_MAX_PER_SM = 12
BWD_ROWS_PER_GROUP = 8

_ROWS_H = ("rows", "h")


def eps_bits(eps: float) -> int:
    """float32 bit pattern of eps (MAX op parameters are ints)."""
    return struct.unpack("<I", struct.pack("<f", eps))[0]


@cache
def fwd_op(activation: str, eps: float) -> GraphOp:
    """The registered forward: outputs y [rows, h], mean [rows], rstd [rows]."""
    return GraphOp(
        "layernorm_fwd", LIBRARY,
        inputs=(_ROWS_H, ("h",), ("h",), ("variant",)),
        outputs=(Out(_ROWS_H), Out(("rows",), torch.float32), Out(("rows",), torch.float32)),
        parameters=(("act", ACTIVATIONS[activation]), ("eps_bits", eps_bits(eps))),
        weights=frozenset({1, 2, 3}),
    )


@cache
def bwd_op(activation: str) -> GraphOp:
    """The registered backward: outputs dx [rows, h], dgamma, dbeta [h], two partials [parts, h]."""
    return GraphOp(
        "layernorm_bwd", LIBRARY,
        inputs=(_ROWS_H, _ROWS_H, ("h",), ("h",), ("rows",), ("rows",)),
        outputs=(Out(_ROWS_H), Out(("h",), 2), Out(("h",), 2),
                 Out(("parts", "h"), torch.float32), Out(("parts", "h"), torch.float32)),
        parameters=(("act", ACTIVATIONS[activation]),),
        weights=frozenset({2, 3}),
    )


_selectors: dict[tuple[torch.device, int], torch.Tensor] = {}


def _variant_number(variant: str) -> int:
    """VARIANTS[variant]; "config:<i>" forces register configuration i (benchmark sweeps)."""
    if variant in VARIANTS:
        return VARIANTS[variant]
    if variant.startswith("config:") and variant[7:].isdigit():
        return FORCE_CONFIG + int(variant[7:])
    raise ValueError(f"variant: {variant!r} is not one of {list(VARIANTS)} (or config:<i>)")


def _selector(device: torch.device, variant: str) -> torch.Tensor:
    """A tensor whose length is the variant number: the kernel reads it as a run-time choice."""
    key = (device, _variant_number(variant))
    t = _selectors.get(key)
    if t is None:
        t = _selectors[key] = torch.zeros(key[1], device=device)
    return t


@cache
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def bwd_parts(rows: int, h: int, dtype: torch.dtype, device: torch.device) -> int:
    """Row groups of the backward (CPU: one, it runs the rows in order)."""
    if device.type != "cuda":
        return 1
    forced = os.environ.get("OPS_LN_BWD_PARTS")  # tuning knob for benchmarks
    if forced:
        return min(rows, int(forced))
    sms = sm_count(device)
    row_bytes = 1 << (h * dtype.itemsize - 1).bit_length()
    per_sm = min(BWD_MAX_PER_SM, max(1, BWD_ROW_BYTES_PER_SM // row_bytes),
                 max(1, round(rows / (BWD_ROWS_PER_GROUP * sms))))
    return min(rows, per_sm * sms)


def _check_activation(activation: str) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation: {activation!r} is not one of {list(ACTIVATIONS)}")


def validate(x: object, weight: object, bias: object, names: tuple[str, str, str] = ("x", "weight", "bias")) -> None:
    """Raise ValueError/TypeError naming the first bad argument (``names`` as the caller calls them)."""
    nx, nw, nb = names
    check_tensor(nx, x, min_ndim=1, dtypes=DTYPES)
    check_tensor(nw, weight, ndim=1, dtypes=DTYPES)
    check_tensor(nb, bias, ndim=1, dtypes=DTYPES)
    check_same({nx: x, nw: weight, nb: bias})
    check_size(nw, weight, 0, x.shape[-1], f"{nx}'s last dim")
    check_size(nb, bias, 0, x.shape[-1], f"{nx}'s last dim")


def check_eps(eps: float) -> None:
    """eps must be a positive number (it is added to the variance)."""
    if not eps > 0:
        raise ValueError(f"eps: must be positive, got {eps}")


def layernorm_fwd(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-5,
                  variant: str = "fast", activation: str = "none") -> tuple[torch.Tensor, ...]:
    """y = act(LayerNorm(x)) [..., H] (x's dtype), mean and rstd [...] (float32)."""
    validate(x, weight, bias)
    _check_activation(activation)
    check_eps(eps)
    h = x.shape[-1]
    y, mean, rstd = fwd_op(activation, float(eps))(x.view(-1, h), weight, bias, _selector(x.device, variant))
    return y.view(x.shape), mean.view(x.shape[:-1]), rstd.view(x.shape[:-1])


def layernorm_bwd(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                  mean: torch.Tensor, rstd: torch.Tensor, activation: str = "none") -> tuple[torch.Tensor, ...]:
    """dx [..., H], dweight and dbias [H] (x's dtype) from the upstream gradient dy [..., H]."""
    validate(x, weight, bias)
    _check_activation(activation)
    check_tensor("dy", dy, dtypes=DTYPES)
    check_same({"x": x, "dy": dy})
    if dy.shape != x.shape:
        raise ValueError(f"dy: shape {tuple(dy.shape)} does not match x {tuple(x.shape)}")
    for name, t in (("mean", mean), ("rstd", rstd)):
        check_tensor(name, t, min_ndim=0, dtypes=(torch.float32,))
        if t.shape != x.shape[:-1] or t.device != x.device:
            raise ValueError(f"{name}: expected shape {tuple(x.shape[:-1])} on {x.device}, "
                             f"got {tuple(t.shape)} on {t.device}")
    h = x.shape[-1]
    rows = x.numel() // h
    dx, dweight, dbias, _, _ = bwd_op(activation)(
        dy.view(-1, h), x.view(-1, h), weight, bias, mean.view(-1), rstd.view(-1),
        sizes={"parts": bwd_parts(rows, h, x.dtype, x.device)})
    return dx.view(x.shape), dweight, dbias


# ---------------------------------------------------------------- torch.library

@torch.library.custom_op("mojo::layernorm_fwd", mutates_args=())
def _fwd_custom(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
                variant: str, activation: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return layernorm_fwd(x, weight, bias, eps, variant, activation)


@_fwd_custom.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
      variant: str, activation: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    stats = x.new_empty(x.shape[:-1], dtype=torch.float32)
    return torch.empty_like(x), stats, torch.empty_like(stats)


@torch.library.custom_op("mojo::layernorm_bwd", mutates_args=())
def _bwd_custom(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                mean: torch.Tensor, rstd: torch.Tensor, activation: str
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return layernorm_bwd(dy, x, weight, bias, mean, rstd, activation)


@_bwd_custom.register_fake
def _(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
      mean: torch.Tensor, rstd: torch.Tensor, activation: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.empty_like(x), torch.empty_like(weight), torch.empty_like(bias)


# ---------------------------------------------------------------- autograd and nn.Module

class LayerNormFunction(torch.autograd.Function):
    """Autograd for act(LayerNorm(x)): gradients for x, weight and bias."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor, eps: float, variant: str, activation: str) -> torch.Tensor:
        y, mean, rstd = torch.ops.mojo.layernorm_fwd(x, weight, bias, eps, variant, activation)
        ctx.save_for_backward(x, weight, bias, mean, rstd)
        ctx.activation = activation
        return y

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, dy: torch.Tensor) -> tuple:
        x, weight, bias, mean, rstd = ctx.saved_tensors
        dx, dweight, dbias = torch.ops.mojo.layernorm_bwd(dy.contiguous(), x, weight, bias, mean, rstd,
                                                           ctx.activation)
        return dx, dweight, dbias, None, None, None


def layernorm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-5,
              activation: str = "none", variant: str = "fast") -> torch.Tensor:
    """act(LayerNorm(x)) over the last dim with autograd; x [..., H], weight/bias [H]."""
    return LayerNormFunction.apply(x, weight, bias, eps, variant, activation)


class LayerNorm(nn.Module):
    """Drop-in for ``nn.LayerNorm(H)`` (same parameter names, so its state dict loads).

    ``activation="gelu"`` or ``"gelu_tanh"`` makes it LayerNorm followed by
    GELU in the same pass. Only the last dim is normalized.
    """

    def __init__(self, normalized_shape: int | tuple[int, ...] | list[int], eps: float = 1e-5,
                 elementwise_affine: bool = True, bias: bool = True, device: torch.device | None = None,
                 dtype: torch.dtype | None = None, activation: str = "none", variant: str = "fast") -> None:
        super().__init__()
        shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
        if len(shape) != 1:
            raise ValueError(f"normalized_shape: only the last dim is supported, got {shape}")
        _check_activation(activation)
        self.normalized_shape, self.eps = shape, eps
        self.activation, self.variant = activation, variant
        kw = {"device": device, "dtype": dtype}
        ones, zeros = torch.ones(shape, **kw), torch.zeros(shape, **kw)
        self.weight = nn.Parameter(ones) if elementwise_affine else None
        self.bias = nn.Parameter(zeros) if elementwise_affine and bias else None
        # Without affine parameters the kernels still take gamma = 1 and beta = 0.
        if self.weight is None:
            self.register_buffer("_ones", ones, persistent=False)
        if self.bias is None:
            self.register_buffer("_zeros", zeros, persistent=False)

    @classmethod
    def from_torch(cls, ln: nn.LayerNorm, activation: str = "none") -> LayerNorm:
        """A copy of ``ln`` (same shape, eps, parameters, device and dtype)."""
        ref = ln.weight if ln.weight is not None else next(iter(ln.buffers()), None)
        m = cls(ln.normalized_shape, ln.eps, ln.elementwise_affine, ln.bias is not None,
                device=None if ref is None else ref.device, dtype=None if ref is None else ref.dtype,
                activation=activation)
        m.load_state_dict(ln.state_dict())
        return m

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight if self.weight is not None else self._ones
        bias = self.bias if self.bias is not None else self._zeros
        return layernorm(x, weight, bias, self.eps, self.activation, self.variant)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, activation={self.activation!r}"
