"""``apply_to``: put this library's norms into a model the user already has (a Hugging Face one, or any
``nn.Module``), in place and undoably, recognizing each norm by its type.

What it replaces: ``nn.LayerNorm`` (by our ``LayerNorm``), ``nn.RMSNorm`` and Hugging Face's RMSNorm classes
(``ops.rmsnorm.config.HF_RMSNORMS``: Llama, Mistral, Qwen2, Qwen3 with its per-head ``q_norm``/``k_norm``, Phi-3,
OLMo2, Gemma 1-3) by our ``RMSNorm`` with the class's semantics. Each replacement shares the original's parameters
(the same ``Parameter`` objects, so tied weights stay tied and an optimizer made before keeps training them) and has
its ``state_dict`` keys. Nothing global is patched: two models in one process can differ. Fusing the residual add
before a norm and the projections after it into the model's blocks is not built yet (issue 71).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import TracebackType

from torch import nn

from ops.layernorm import LayerNorm
from ops.layernorm.module import AddLayerNorm
from ops.rmsnorm import RMSNorm
from ops.rmsnorm.module import AddRMSNorm, known_rmsnorm

OURS = (LayerNorm, AddLayerNorm, RMSNorm, AddRMSNorm)   # already this library's: left as they are


@dataclass
class Report:
    """What ``apply_to`` did, by each module's qualified name in the model: ``replaced`` (name, original class,
    replacement, with an RMSNorm's semantics) and ``skipped`` (name, class, why) for modules that look like norms
    (a class name with "Norm") it left alone."""

    replaced: list[tuple[str, str, str]] = field(default_factory=list)
    skipped: list[tuple[str, str, str]] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"replaced {len(self.replaced)}, skipped {len(self.skipped)}"]
        lines += [f"  replaced {name}: {old} -> {new}" for name, old, new in self.replaced]
        lines += [f"  skipped {name}: {cls} ({why})" for name, cls, why in self.skipped]
        return "\n".join(lines)


class PatchHandle:
    """Undoes an ``apply_to``: ``remove()`` puts every original module back (also on leaving a ``with`` block).
    ``report`` says what was replaced and what was skipped."""

    def __init__(self, swaps: list[tuple[nn.Module, str, nn.Module]], report: Report) -> None:
        self._swaps = swaps
        self.report = report

    def remove(self) -> None:
        """Put the original modules back, in the reverse order of the swaps (a second call does nothing)."""
        for parent, name, original in reversed(self._swaps):
            setattr(parent, name, original)
        self._swaps = []

    def __enter__(self) -> PatchHandle:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.remove()


def replacement(m: nn.Module) -> tuple[nn.Module | None, str]:
    """Our module for ``m`` sharing its parameters, and a word on it (the class it became, or why not: None then)."""
    if isinstance(m, OURS):
        return None, "already this library's"
    known = known_rmsnorm(m)
    try:
        if isinstance(m, nn.LayerNorm):
            new, word = LayerNorm.from_torch(m), "LayerNorm"
        elif known is not None:
            new, word = RMSNorm.from_module(m), f"RMSNorm(semantics={known[0]!r})"
        else:
            return None, "a class this library does not know"
    except TypeError as e:   # e.g. a parametrized weight: no plain parameter to share
        return None, str(e)
    return new.train(m.training), word


def apply_to(model: nn.Module, *, norms: bool = True) -> PatchHandle:
    """Replace ``model``'s norms with this library's, in place (see the module docstring for which).

    Args:
        model: any ``nn.Module``; its submodules are swapped where they sit (every place a shared norm sits).
        norms: replace the norms (False: change nothing, report only).

    Returns:
        A ``PatchHandle``: ``handle.remove()`` (or leaving ``with apply_to(model) as handle:``) restores the model;
        ``handle.report`` lists what was replaced and what was skipped and why.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``, named.

    Example:
        >>> model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))
        >>> handle = apply_to(model)
        >>> type(model[1]).__name__
        'LayerNorm'
        >>> handle.remove()
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected an nn.Module, got {type(model).__name__}")
    report, swaps, made = Report(), [], {}
    for qualified, child in list(model.named_modules(remove_duplicate=False)):   # every place a module sits
        if not qualified:
            continue
        parent_name, _, attr = qualified.rpartition(".")
        if id(child) not in made:
            new, word = replacement(child)
            made[id(child)] = new
            if new is not None and norms:
                report.replaced.append((qualified, type(child).__name__, word))
            elif "Norm" in type(child).__name__:
                report.skipped.append((qualified, type(child).__name__, "norms=False" if new is not None else word))
        if made[id(child)] is not None and norms:
            parent = model.get_submodule(parent_name)
            swaps.append((parent, attr, child))
            setattr(parent, attr, made[id(child)])
    return PatchHandle(swaps, report)
