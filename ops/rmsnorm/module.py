"""``RMSNorm``: a ``torch.nn.RMSNorm`` whose forward runs ``rms_norm``, with the semantics of the module it stands in
for (``from_module``)."""

from __future__ import annotations

import torch
from torch import nn

from ops.common import loaded_class_entry
from ops.rmsnorm.checks import check_semantics
from ops.rmsnorm.config import HF_RMSNORMS
from ops.rmsnorm.functional import add_rms_norm, rms_norm, rms_norm_linear


def known_rmsnorm(m: object) -> tuple[str, str] | None:
    """(semantics, eps attribute) of a module of a known RMSNorm type: ``torch.nn.RMSNorm`` (ours among them) or a
    class of ``HF_RMSNORMS`` whose module is loaded; None for any other."""
    if isinstance(m, nn.RMSNorm):
        return getattr(m, "semantics", "torch"), "eps"
    return loaded_class_entry(m, HF_RMSNORMS)


class RMSNorm(nn.RMSNorm):
    """``torch.nn.RMSNorm`` on our kernels (its subclass: the same parameters, state dict and ``eps=None``).

    Args:
        normalized_shape, eps, elementwise_affine, device, dtype: as ``torch.nn.RMSNorm``'s.
        semantics: ``"torch"``, ``"llama"`` or ``"gemma"`` (``rms_norm``).

    Shape:
        input and output: ``[*, *normalized_shape]``.

    Returns:
        A module whose forward is ``rms_norm(x, normalized_shape, weight, eps, semantics=semantics)``.

    Raises:
        ValueError: an unknown semantics (and what ``torch.nn.RMSNorm`` raises).

    Example:
        >>> m = RMSNorm(8)
        >>> y = m(torch.randn(2, 8))
    """

    def __init__(self, normalized_shape: int | tuple[int, ...], eps: float | None = None,
                 elementwise_affine: bool = True, device: torch.device | None = None, dtype: torch.dtype | None = None,
                 *, semantics: str = "torch") -> None:
        super().__init__(normalized_shape, eps, elementwise_affine, device, dtype)
        self.semantics = check_semantics(semantics)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.normalized_shape, self.weight, self.eps, semantics=self.semantics)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, semantics={self.semantics!r}"

    @classmethod
    def from_module(cls, m: nn.Module, semantics: str | None = None) -> RMSNorm:
        """An ``RMSNorm`` computing what ``m`` computes, sharing its weight (the same parameter: an optimizer made
        before keeps training it): a ``torch.nn.RMSNorm`` ("torch"), or one of Hugging Face's RMSNorm classes
        (``config.HF_RMSNORMS``: Llama, Mistral, Qwen2, Qwen3, Phi-3, OLMo2, Gemma 1-3; recognized by type).
        ``semantics`` names how another module with a ``weight`` and an eps (``eps`` or ``variance_epsilon``) computes
        (a model's own copy of one of these), and is checked against a known type's.

        Raises:
            TypeError: a module of none of these types and no ``semantics``, or ``semantics`` not the type's, named.
        """
        known = known_rmsnorm(m)
        if known is not None and semantics not in (None, known[0]):
            raise TypeError(f"semantics: {type(m).__name__} computes {known[0]!r}, not {semantics!r}")
        if known is None and semantics is not None:
            eps_name = "variance_epsilon" if hasattr(m, "variance_epsilon") else "eps"
            if not isinstance(getattr(m, "weight", None), torch.Tensor) or not hasattr(m, eps_name):
                raise TypeError(f"m: {type(m).__name__} has no weight and eps (eps or variance_epsilon)")
            known = (check_semantics(semantics), eps_name)
        if known is None:
            raise TypeError(f"m: {type(m).__name__} is not an RMSNorm this library knows (torch.nn.RMSNorm, "
                            "ops.rmsnorm.config.HF_RMSNORMS); name its semantics to take it")
        semantics, eps_name = known
        weight = m.weight
        shape = tuple(m.normalized_shape) if isinstance(m, nn.RMSNorm) else tuple(weight.shape)
        out = cls(shape, getattr(m, eps_name), elementwise_affine=weight is not None, device="meta",
                  semantics=semantics)
        out.weight = weight
        return out

    @classmethod
    def from_torch(cls, m: nn.RMSNorm) -> RMSNorm:
        """``from_module`` of a ``torch.nn.RMSNorm``."""
        if not isinstance(m, nn.RMSNorm):
            raise TypeError(f"m: expected a torch.nn.RMSNorm, got {type(m).__name__}")
        return cls.from_module(m)


class AddRMSNorm(RMSNorm):
    """A pre-norm block's residual add and RMSNorm as a module: ``forward(x, residual)`` returns (y, s) of
    ``add_rms_norm``, s = x (+ add_bias) + residual and y = RMSNorm(s) over the last dim by ``semantics``. An
    ``RMSNorm`` (so a ``torch.nn.RMSNorm``): the same parameters and state dict.

    Args:
        normalized_shape, eps, elementwise_affine, device, dtype, semantics: as ``RMSNorm``'s (one dim).
        residual_in_fp32: keep s in float32 (y in x's dtype).

    Shape:
        x, residual, y, s: ``[*, H]``.

    Returns:
        ``forward(x, residual, add_bias=None)``: (y, s).

    Raises:
        ValueError: a ``normalized_shape`` of more than one dim, an unknown semantics; from ``forward``, what
            ``add_rms_norm`` names.

    Example:
        >>> m = AddRMSNorm(8)
        >>> y, s = m(torch.randn(2, 8), torch.randn(2, 8))
    """

    def __init__(self, normalized_shape: int | tuple[int, ...], eps: float | None = None,
                 elementwise_affine: bool = True, device: torch.device | None = None, dtype: torch.dtype | None = None,
                 *, semantics: str = "torch", residual_in_fp32: bool = False) -> None:
        super().__init__(normalized_shape, eps, elementwise_affine, device, dtype, semantics=semantics)
        if len(self.normalized_shape) != 1:
            raise ValueError(f"normalized_shape: the add and norm take the last dim alone, got "
                             f"{tuple(self.normalized_shape)}")
        self.residual_in_fp32 = residual_in_fp32

    @classmethod
    def from_module(cls, m: nn.Module, residual_in_fp32: bool = False, semantics: str | None = None) -> AddRMSNorm:
        """The add and norm computing what ``m`` computes after the add, on its weight itself (``RMSNorm.from_module``,
        which ``semantics`` goes to).

        Raises:
            TypeError: a module ``RMSNorm.from_module`` does not take, named.
        """
        norm = RMSNorm.from_module(m, semantics)
        out = cls(norm.normalized_shape, norm.eps, norm.weight is not None, device="meta", semantics=norm.semantics,
                  residual_in_fp32=residual_in_fp32)
        out.weight = norm.weight
        return out

    def forward(self, x: torch.Tensor, residual: torch.Tensor,   # type: ignore[override]
                add_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return add_rms_norm(x, residual, self.weight, self.eps, add_bias=add_bias,
                            residual_in_fp32=self.residual_in_fp32, semantics=self.semantics)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, residual_in_fp32={self.residual_in_fp32}"


class FusedRMSNormLinear(nn.Sequential):
    """Drop-in for ``nn.Sequential(nn.RMSNorm(K), nn.Linear(K, N))``: the same submodules (so its state dict loads),
    the forward ``rms_norm_linear`` (eager on a GPU: our RMSNorm and cuBLASLt's Linear, one autograd node).

    Args:
        in_features, out_features: K and N.
        eps: the RMSNorm's (None: ``torch.finfo(x.dtype).eps``).
        bias: whether the Linear has a bias.
        device, dtype: of the parameters.
        semantics: the RMSNorm's (``rms_norm``).

    Shape:
        input ``[*, K]``; output ``[*, N]``.

    Returns:
        ``forward(x)``: Linear(RMSNorm(x)) in x's dtype.

    Raises:
        TypeError, ValueError: from ``forward``, for an input ``rms_norm`` or ``F.linear`` refuses.

    Example:
        >>> m = FusedRMSNormLinear(64, 256)
        >>> y = m(torch.randn(2, 8, 64))
    """

    def __init__(self, in_features: int, out_features: int, eps: float | None = None, bias: bool = True,
                 device: torch.device | None = None, dtype: torch.dtype | None = None, *,
                 semantics: str = "torch") -> None:
        kw = {"device": device, "dtype": dtype}
        super().__init__(RMSNorm(in_features, eps, semantics=semantics, **kw),
                         nn.Linear(in_features, out_features, bias, **kw))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        norm, lin = self[0], self[1]
        if len(norm.normalized_shape) != 1:   # a norm over more dims than the Linear's (from_torch keeps it)
            return nn.functional.linear(norm(x), lin.weight, lin.bias)
        return rms_norm_linear(x, norm.weight, lin.weight, lin.bias, norm.eps, semantics=norm.semantics)

    @classmethod
    def from_torch(cls, seq: nn.Sequential, semantics: str | None = None) -> FusedRMSNormLinear:
        """The drop-in for ``seq`` = ``nn.Sequential(norm, nn.Linear)`` with ``norm`` one ``RMSNorm.from_module``
        takes (``semantics`` goes to it), sharing their parameters (the Linear itself, the norm's weight).

        Raises:
            TypeError: ``seq`` is not such a pair, named.
        """
        if not (isinstance(seq, nn.Sequential) and len(seq) == 2 and isinstance(seq[1], nn.Linear)):
            raise TypeError(f"seq: expected nn.Sequential(an RMSNorm, nn.Linear), got {type(seq).__name__}")
        try:
            norm = RMSNorm.from_module(seq[0], semantics)
        except TypeError as e:
            raise TypeError(f"seq: its first module: {e}") from None
        out = cls.__new__(cls)
        nn.Sequential.__init__(out, norm, seq[1])
        return out
