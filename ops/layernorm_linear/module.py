"""``FusedLayerNormLinear``: the drop-in for ``nn.Sequential(nn.LayerNorm(K), nn.Linear(K, N))``."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

import torch
from torch import nn
from torch.nn.modules import module as _nn_module  # the global module hooks nn.Module.__call__ runs

from ops.common import (
    not_scriptable,
    share_affine,
    weight_and_bias,
)
from ops.inputs import (
    as_eps,
    as_shape,
    as_size,
)
from ops.layernorm import LayerNorm
from ops.layernorm import functional as ln_functional
from ops.layernorm_linear.algo import pick_algo
from ops.layernorm_linear.functional import module_forward


class FusedLayerNormLinear(nn.Sequential):
    """Drop-in for ``nn.Sequential(nn.LayerNorm(K), nn.Linear(K, N))`` on our kernels: the same submodules, so its
    state dict loads; the forward runs ``layernorm_linear``.

    Args:
        in_features, out_features: K and N.
        eps: the LayerNorm's.
        bias: whether the Linear has a bias (``nn.Linear``'s ``bias``).
        device, dtype: of the parameters.
        algo: the forward algorithm (``ALGOS``; see the module docstring).
        elementwise_affine, norm_bias: the LayerNorm's ``elementwise_affine`` and ``bias``.
        normalized_shape: the LayerNorm's, when it normalizes more than the last dim (its last entry must be K);
            such a module runs our LayerNorm, then ``F.linear``.

    Shape:
        input ``[*, K]`` (``[*, *normalized_shape]``), any layout; output ``[*, N]``.

    Returns:
        ``forward(x)``: Linear(LayerNorm(x)) in x's dtype (under CUDA autocast, what the torch modules give).

    Raises:
        TypeError, ValueError: from ``forward``, for an input ``layernorm_linear`` refuses (named).

    Example:
        >>> m = FusedLayerNormLinear(768, 3072)
        >>> y = m(torch.randn(8, 512, 768))
    """

    def __init__(self, in_features: int, out_features: int, eps: float = 1e-5, bias: bool = True,
                 device: torch.device | None = None, dtype: torch.dtype | None = None, algo: str = "auto", *,
                 elementwise_affine: bool = True, norm_bias: bool = True,
                 normalized_shape: int | tuple[int, ...] | None = None) -> None:
        kw = {"device": device, "dtype": dtype}
        in_features, out_features = as_size("in_features", in_features), as_size("out_features", out_features)
        shape = (in_features,) if normalized_shape is None else as_shape(normalized_shape)
        super().__init__(nn.LayerNorm(shape, as_eps(eps), elementwise_affine, norm_bias, **kw),
                         nn.Linear(in_features, out_features, bias, **kw))
        if shape[-1] != in_features:
            raise ValueError(f"normalized_shape: its last entry must be in_features ({in_features}), got {shape}")
        pick_algo(algo, torch.device("cpu"), torch.float32, 1, out_features)  # reject a bad name now
        self.algo = algo

    @classmethod
    def from_torch(cls, seq: nn.Sequential, algo: str = "auto") -> FusedLayerNormLinear:
        """Ours in place of ``nn.Sequential(nn.LayerNorm(...), nn.Linear(K, N))``, with ``seq``'s children
        themselves, so their parameters (a tied weight stays tied, a frozen one frozen, and an optimizer made
        before the swap trains ours) and whatever they carry (hooks, parametrizations such as ``weight_norm``,
        pruning: the forward then runs them as ``nn.Sequential`` would).

        Args:
            seq: the Sequential; an ``ops.layernorm.LayerNorm`` first child (no activation) becomes an
                ``nn.LayerNorm`` on its parameters, so that the fused call runs.
            algo: the forward algorithm (``ALGOS``).

        Returns:
            A ``FusedLayerNormLinear`` whose children are ``seq``'s.

        Raises:
            TypeError: ``seq`` is not a LayerNorm then a Linear, or its LayerNorm applies an activation.
            ValueError: an unknown ``algo``.

        Example:
            >>> seq = torch.nn.Sequential(torch.nn.LayerNorm(8), torch.nn.Linear(8, 4))
            >>> m = FusedLayerNormLinear.from_torch(seq)
            >>> assert m[1] is seq[1]
        """
        if (not isinstance(seq, nn.Sequential) or len(seq) != 2 or not isinstance(seq[0], nn.LayerNorm)
                or not isinstance(seq[1], nn.Linear)):
            raise TypeError("seq: expected nn.Sequential(nn.LayerNorm(K), nn.Linear(K, N))")
        if getattr(seq[0], "activation", "none") != "none":
            raise TypeError(f"seq: its LayerNorm applies activation={seq[0].activation!r}, which the fused "
                            "module does not")
        ln, lin = seq[0], seq[1]
        m = cls(lin.in_features, lin.out_features, ln.eps, lin.bias is not None, device="meta", algo=algo,
                elementwise_affine=ln.elementwise_affine, norm_bias=ln.bias is not None,
                normalized_shape=ln.normalized_shape)
        if type(ln) is LayerNorm and runs_as_its_class(ln):
            share_affine(m[0], ln)
        else:
            m[0] = ln
        m[1] = lin
        return m

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        modules = self._modules
        if len(modules) == 2:
            ln, lin = modules.values()
            if type(ln) is nn.LayerNorm and type(lin) is nn.Linear and runs_as_its_class(ln, lin):
                ln_weight, ln_bias = weight_and_bias(ln)
                weight, bias = weight_and_bias(lin)
                return module_forward(x, ln.normalized_shape, ln_weight, ln_bias, weight, bias, ln.eps, self.algo)
        return _children_forward(x, modules.values())

    def __getitem__(self, idx: int | slice) -> nn.Module:
        """A child, as ``nn.Sequential`` gives it; a slice as an ``nn.Sequential`` of those children (a part of
        LayerNorm then Linear is no longer one)."""
        if isinstance(idx, slice):
            return nn.Sequential(OrderedDict(list(self._modules.items())[idx]))
        return super().__getitem__(idx)

    def __prepare_scriptable__(self) -> nn.Module:
        not_scriptable(self)


def runs_as_its_class(*modules: nn.Module) -> bool:
    """Whether calling each of ``modules`` would run only its class's forward (what ``FusedLayerNormLinear``
    computes in place of a plain ``nn.LayerNorm`` and ``nn.Linear``): no hooks on it (pruning's, an observer's)
    nor global module hooks, and no ``forward`` patched onto it (accelerate's offload)."""
    if (_nn_module._global_forward_pre_hooks or _nn_module._global_forward_hooks
            or _nn_module._global_backward_pre_hooks or _nn_module._global_backward_hooks):
        return False
    for m in modules:
        if (m._forward_pre_hooks or m._forward_hooks or m._backward_pre_hooks or m._backward_hooks
                or "forward" in m.__dict__):
            return False
    return True


def _children_forward(x: torch.Tensor, modules: Iterable[nn.Module]) -> torch.Tensor:
    """x through ``modules`` as ``nn.Sequential`` runs them, for a ``FusedLayerNormLinear`` whose children are not
    a plain LayerNorm and Linear (replaced, subclassed, parametrized, hooked, more or fewer of them): each called
    (its hooks, its own forward), except a plain ``nn.LayerNorm`` (``runs_as_its_class``), run on our kernels."""
    for m in modules:
        if type(m) is nn.LayerNorm and runs_as_its_class(m):
            x = ln_functional.layer_norm(x, m.normalized_shape, m.weight, m.bias, m.eps)
        else:
            x = m(x)
    return x


# torch.fx.symbolic_trace records the forward's calls of these as calls (they run at the graph's run, not while
# it is traced: their checks read tensors, which a trace has not); fx.wrap patches the calling module's names
torch.fx.wrap("module_forward")
