"""``LayerNorm``: the drop-in ``nn.LayerNorm`` subclass on our kernels; ``AddLayerNorm``: a pre-norm block's residual
add and LayerNorm as one module."""

from __future__ import annotations

import torch
from torch import nn

from ops.common import not_scriptable, plain_module, share_affine, weight_and_bias
from ops.inputs import as_eps, as_shape
from ops.layernorm.checks import check_activation
from ops.layernorm.functional import add_layer_norm, layer_norm, layernorm


@plain_module
class LayerNorm(nn.LayerNorm):
    """Drop-in for ``nn.LayerNorm`` on our kernels: a subclass (``isinstance(m, nn.LayerNorm)`` holds, so code that
    picks LayerNorms by type, such as weight-decay groups, treats it as one), with the same arguments, parameters
    and state dict; only the forward differs.

    Args:
        normalized_shape: the trailing dims to normalize over (an int for the last dim alone).
        eps: added to the variance.
        elementwise_affine: learnable gamma (ones) and beta (zeros) of ``normalized_shape``.
        bias: with ``elementwise_affine``, whether beta is learned (else it is 0).
        device, dtype: of the parameters (float32 parameters take 16-bit input, as torch's do).
        activation: ``"gelu"`` or ``"gelu_tanh"`` applies GELU in the same pass.
        variant: the forward kernel's variant (benchmarks).

    Shape:
        input and output: ``[*, *normalized_shape]``, any layout.

    Returns:
        ``forward(x)``: act(LayerNorm(x)) in x's dtype (float32 under CUDA autocast, as torch's).

    Raises:
        TypeError, ValueError: from ``forward``, for an input ``layer_norm`` refuses (named).

    Example:
        >>> ln = LayerNorm(768)
        >>> y = ln(torch.randn(4, 16, 768))
    """

    def __init__(self, normalized_shape: int | tuple[int, ...] | list[int], eps: float = 1e-5,
                 elementwise_affine: bool = True, bias: bool = True, device: torch.device | None = None,
                 dtype: torch.dtype | None = None, activation: str = "none", variant: str = "fast") -> None:
        check_activation(activation)
        super().__init__(as_shape(normalized_shape), as_eps(eps), elementwise_affine, bias, device, dtype)
        self.activation, self.variant = activation, variant

    @classmethod
    def from_torch(cls, ln: nn.LayerNorm, activation: str | None = None) -> LayerNorm:
        """Ours in place of ``ln``, with its parameters themselves (the same ``nn.Parameter`` objects, as
        ``nn.SyncBatchNorm.convert_sync_batchnorm`` shares them): a tied weight stays tied, a frozen one frozen, and
        an optimizer made before the swap trains ours. Weights held as buffers stay the same buffers.

        Args:
            ln: an ``nn.LayerNorm`` (ours too); its hooks are not carried over.
            activation: ours' activation; None keeps ``ln``'s (``"none"`` for torch's).

        Returns:
            A ``LayerNorm`` of ``ln``'s shape and eps on ``ln``'s parameters.

        Raises:
            TypeError: ``ln`` is not an ``nn.LayerNorm``, or is parametrized or pruned (no plain parameters).

        Example:
            >>> torch_ln = torch.nn.LayerNorm(8)
            >>> ln = LayerNorm.from_torch(torch_ln)
            >>> assert ln.weight is torch_ln.weight
        """
        if not isinstance(ln, nn.LayerNorm):
            raise TypeError(f"ln: expected an nn.LayerNorm, got {type(ln).__name__}")
        m = cls(ln.normalized_shape, ln.eps, ln.elementwise_affine, ln.bias is not None, device="meta",
                activation=getattr(ln, "activation", "none") if activation is None else activation)
        have, want = ln.state_dict().keys(), m.state_dict().keys()
        if have != want:
            raise TypeError(f"ln: its state dict holds {sorted(have)}, not a LayerNorm's {sorted(want)} "
                            "(a parametrized or pruned LayerNorm); remove those first")
        share_affine(m, ln)
        return m

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = weight_and_bias(self)
        if len(self.normalized_shape) > 1 or weight is None or bias is None:
            # absent parameters are 1 and 0 on x's device (``constant``), as torch's module has none to move
            return layer_norm(x, self.normalized_shape, weight, bias, self.eps, activation=self.activation,
                              variant=self.variant)
        return layernorm(x, weight, bias, self.eps, self.activation, self.variant)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, activation={self.activation!r}"

    def __prepare_scriptable__(self) -> nn.Module:
        not_scriptable(self)


class AddLayerNorm(nn.LayerNorm):
    """A pre-norm block's residual add and LayerNorm as a module: ``forward(x, residual)`` returns (y, s) of
    ``add_layer_norm``, s = x (+ add_bias) + residual and y = LayerNorm(s) over the last dim. An ``nn.LayerNorm``
    subclass: the same parameters and state dict, so ``from_torch`` takes a block's own norm.

    Args:
        normalized_shape: the last dim (an int, or a shape of one dim).
        eps, elementwise_affine, bias, device, dtype: as ``nn.LayerNorm``'s.
        residual_in_fp32: keep s in float32 (y in x's dtype).

    Shape:
        x, residual, y, s: ``[*, H]``.

    Returns:
        ``forward(x, residual, add_bias=None)``: (y, s).

    Raises:
        ValueError: a ``normalized_shape`` of more than one dim; from ``forward``, what ``add_layer_norm`` names.

    Example:
        >>> m = AddLayerNorm(8)
        >>> y, s = m(torch.randn(2, 8), torch.randn(2, 8))
    """

    def __init__(self, normalized_shape: int | tuple[int, ...] | list[int], eps: float = 1e-5,
                 elementwise_affine: bool = True, bias: bool = True, device: torch.device | None = None,
                 dtype: torch.dtype | None = None, *, residual_in_fp32: bool = False) -> None:
        shape = as_shape(normalized_shape)
        if len(shape) != 1:
            raise ValueError(f"normalized_shape: the add and norm take the last dim alone, got {shape}")
        super().__init__(shape, as_eps(eps), elementwise_affine, bias, device, dtype)
        self.residual_in_fp32 = residual_in_fp32

    @classmethod
    def from_torch(cls, ln: nn.LayerNorm, residual_in_fp32: bool = False) -> AddLayerNorm:
        """The add and norm on ``ln``'s parameters themselves (as ``LayerNorm.from_torch``).

        Raises:
            TypeError: ``ln`` is not an ``nn.LayerNorm`` of plain parameters.
            ValueError: ``ln`` normalizes more than the last dim.
        """
        if not isinstance(ln, nn.LayerNorm):
            raise TypeError(f"ln: expected an nn.LayerNorm, got {type(ln).__name__}")
        m = cls(ln.normalized_shape, ln.eps, ln.elementwise_affine, ln.bias is not None, device="meta",
                residual_in_fp32=residual_in_fp32)
        share_affine(m, ln)
        return m

    def forward(self, x: torch.Tensor, residual: torch.Tensor,
                add_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        weight, bias = weight_and_bias(self)
        return add_layer_norm(x, residual, weight, bias, self.eps, add_bias=add_bias,
                              residual_in_fp32=self.residual_in_fp32)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, residual_in_fp32={self.residual_in_fp32}"

    def __prepare_scriptable__(self) -> nn.Module:
        not_scriptable(self)


# torch.fx.symbolic_trace records the forward's calls of these as calls (they run at the graph's run, not while
# it is traced: their checks read tensors, which a trace has not); fx.wrap patches the calling module's names
torch.fx.wrap("layernorm")
torch.fx.wrap("layer_norm")
