"""``apply_to``: put this library's norms into a model the user already has (a Hugging Face one, or any
``nn.Module``), in place and undoably, recognizing each norm by its type, and fuse the adds and projections around
them in the blocks it knows.

What it replaces: ``nn.LayerNorm`` (by our ``LayerNorm``), ``nn.RMSNorm`` and Hugging Face's RMSNorm classes
(``ops.rmsnorm.config.HF_RMSNORMS``: Llama, Mistral, Qwen2, Qwen3 with its per-head ``q_norm``/``k_norm``, Phi-3,
OLMo2, Gemma 1-3) by our ``RMSNorm`` with the class's semantics. Each replacement shares the original's parameters
(the same ``Parameter`` objects, so tied weights stay tied and an optimizer made before keeps training them) and has
its ``state_dict`` keys. Then the blocks of ``ops.hf_blocks.FUSIONS`` get fused forwards of their own instance
(``projections=True``: a pre-norm MLP's norm, first projection and activation as one op, in GPT-2, ViT and OPT;
``residual=True``: a residual add and the norm after it as one op, in Llama, Mistral, Qwen2, Qwen3 and BERT, and in
ViT and OPT where their projections are not fused). Nothing global is patched: two models in one process can differ.
With FSDP2, patch before ``fully_shard``: a norm whose parameters are sharded already is skipped and reported.
The norms before Llama's q/k/v and gate/up are not fused into them yet (issue 71); those projections, and ViT's,
OPT's and BERT's q/k/v, can run as one ``linears`` call each (``hf_blocks.SHARED_INPUT_PROJECTIONS``, off).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType

import torch
from torch import nn

from ops import hf_blocks
from ops.common import loaded_class_entry
from ops.hf_blocks import FUSIONS
from ops.layernorm import LayerNorm
from ops.layernorm.module import AddLayerNorm
from ops.rmsnorm import RMSNorm
from ops.rmsnorm.module import AddRMSNorm, known_rmsnorm

OURS = (LayerNorm, AddLayerNorm, RMSNorm, AddRMSNorm)   # already this library's: left as they are

@dataclass
class Report:
    """What ``apply_to`` did, by each module's qualified name in the model: ``replaced`` (name, original class,
    replacement, with an RMSNorm's semantics), ``fused`` (name, class, what runs as one) and ``skipped`` (name, class,
    why) for modules that look like norms (a class name with "Norm") or blocks of ``FUSIONS`` it left alone."""

    replaced: list[tuple[str, str, str]] = field(default_factory=list)
    fused: list[tuple[str, str, str]] = field(default_factory=list)
    skipped: list[tuple[str, str, str]] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"replaced {len(self.replaced)}, fused {len(self.fused)}, skipped {len(self.skipped)}"]
        lines += [f"  replaced {name}: {old} -> {new}" for name, old, new in self.replaced]
        lines += [f"  fused {name}: {cls}: {what}" for name, cls, what in self.fused]
        lines += [f"  skipped {name}: {cls} ({why})" for name, cls, why in self.skipped]
        return "\n".join(lines)


class PatchHandle:
    """Undoes an ``apply_to``: ``remove()`` puts every original module back (also on leaving a ``with`` block).
    ``report`` says what was replaced and what was skipped."""

    def __init__(self, undo: list[Callable[[], None]], report: Report) -> None:
        self._undo = undo
        self.report = report

    def remove(self) -> None:
        """Put the original modules and forwards back, in the reverse order of the changes (a second call does
        nothing)."""
        for step in reversed(self._undo):
            step()
        self._undo = []

    def __enter__(self) -> PatchHandle:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.remove()


def sharded(m: nn.Module) -> bool:
    """Whether ``m`` holds a parameter as a DTensor (sharded by FSDP2's ``fully_shard`` or tensor parallelism), which
    a replacement module would keep sharded: FSDP2 gathers the parameters of the module it was given, not ours."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in m.parameters(recurse=False))


def replacement(m: nn.Module) -> tuple[nn.Module | None, str]:
    """Our module for ``m`` sharing its parameters, and a word on it (the class it became, or why not: None then)."""
    if isinstance(m, OURS):
        return None, "already this library's"
    if sharded(m):
        return None, "its parameters are sharded (DTensors): apply_to before fully_shard or parallelize_module"
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


def apply_to(model: nn.Module, *, norms: bool = True, residual: bool = True, projections: bool = True) -> PatchHandle:
    """Replace ``model``'s norms with this library's, in place, and fuse the adds and projections around them in the
    blocks it knows (see the module docstring for which).

    Args:
        model: any ``nn.Module``; its submodules are swapped where they sit (every place a shared norm sits).
        norms: replace the norms (False: change nothing, report only).
        residual: with ``norms``, run a known block's residual add and the norm after it as one op.
        projections: with ``norms``, run a known block's norm, the projection after it and its activation as one op
            (preferred to ``residual`` where a block has both around one norm).

    Returns:
        A ``PatchHandle``: ``handle.remove()`` (or leaving ``with apply_to(model) as handle:``) restores the model;
        ``handle.report`` lists what was replaced, what was fused, and what was skipped and why.

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
    report, undo = Report(), []
    swap_norms(model, norms, report, undo)
    if norms:
        shared = projections and hf_blocks.SHARED_INPUT_PROJECTIONS
        fuse_blocks(model, {kind for kind, on in (("residual", residual), ("projections", projections),
                                                  ("shared", shared)) if on}, report, undo)
    return PatchHandle(undo, report)


def swap_norms(model: nn.Module, norms: bool, report: Report, undo: list[Callable[[], None]]) -> None:
    """``apply_to``'s norms: each module ``replacement`` knows swapped where it sits (one replacement per module)."""
    made: dict[int, nn.Module | None] = {}
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
            undo.append(lambda parent=parent, attr=attr, child=child: setattr(parent, attr, child))
            setattr(parent, attr, made[id(child)])


def fuse_blocks(model: nn.Module, kinds: set[str], report: Report, undo: list[Callable[[], None]]) -> None:
    """``apply_to``'s fusions: each block of ``FUSIONS`` gets the fused forwards of its first fusion whose kind is
    asked for and which ``Fusion.why_not`` takes; where none does, the reasons are reported."""
    for qualified, block in model.named_modules():
        fusions = [f for f in loaded_class_entry(block, FUSIONS) or () if f.kind in kinds]
        reasons = []
        for fusion in fusions:
            if why := fusion.why_not(block):
                reasons.append(why)
                continue
            undo.extend(fusion.install(block))
            report.fused.append((qualified, type(block).__name__, fusion.what))
            break
        else:
            if reasons:
                report.skipped.append((qualified, type(block).__name__, "; ".join(dict.fromkeys(reasons))))
